"""Prefill seeds the expert pool: the experts a prompt's whole-layer reads brought in stay.

A prompt's chunks that touch most of a layer read it whole (`ExpertStore.whole_layer`), outside
the expert cache, and the buffer goes once the layer has computed. The prompt's last token then
runs as a one-token forward through the cache, and would read its experts again. Instead, each
whole-layer read copies the experts the chunk routed to into the pool's slots (memory traffic,
not disk), as far as the layer's share of the cache goes.

Which first: the experts the chunk used most, a use counting for less the further it is from the
chunk's end. The next forward's token follows the last positions, and neighbouring tokens route
alike more often than distant ones; but an expert used all along is also likely next. On the
demo's replies to README prompts, with a cache of a fraction of its experts, this order gave the
first token more hits than either the last positions alone or plain use counts (the figures are in
the commit that made it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .pool import ExpertPool
from .reads import convert_into

# Positions back from a chunk's end over which an expert's use counts for half as much.
HALF_LIFE = 16
# The safetensors name `convert_into` takes for an MLX floating dtype (others copy as they are).
_DTYPE_NAMES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}


def seed_from_whole_layer(
    pool: ExpertPool, layer: int, experts: list[int], whole: dict[str, mx.array]
) -> int:
    """Copy `experts` of `layer` (most wanted first: `by_recent_use`) from its whole-layer
    tensors `whole` into the pool. Returns how many were copied."""
    host = {key: _host_view(array) for key, array in whole.items()}

    def write(expert: int, views: dict[str, np.ndarray]) -> None:
        for key, slot in views.items():
            source, dtype = host[key]
            convert_into(source[expert], dtype, slot)

    return pool.seed(layer, experts, write)


def by_recent_use(routed: np.ndarray) -> list[int]:
    """The experts `routed` (`[..., tokens, k]`) names, each once, most used first, a use
    counting for less the further it is from its row's last position (halving every
    `HALF_LIFE` positions)."""
    k = routed.shape[-1]
    tokens = routed.shape[-2] if routed.ndim > 1 else 1
    rows = routed.reshape(-1, tokens, k)
    back = np.arange(tokens)[::-1]  # positions before each row's last
    weights = np.broadcast_to((0.5 ** (back / HALF_LIFE))[None, :, None], rows.shape)
    score = np.bincount(rows.ravel(), weights=weights.ravel())
    order = np.argsort(-score, kind="stable")
    return order[score[order] > 0].tolist()


def _host_view(array: mx.array) -> tuple[np.ndarray, str]:
    """`array`'s bytes as a NumPy array (bfloat16, which NumPy lacks, as its uint16 bits) and its
    dtype's safetensors name."""
    bits = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    mx.eval(bits)
    return np.asarray(memoryview(bits)), _DTYPE_NAMES.get(array.dtype, "")

"""Prefill seeds the expert pool: the experts a prompt's whole-layer reads brought in stay.

A prompt's chunks that touch most of a layer read it whole (`ExpertStore.whole_layer`), outside
the expert cache, and the buffer goes once the layer has computed. The prompt's last token then
runs as a one-token forward through the cache, and would read its experts again. Instead, each
whole-layer read copies the experts the chunk routed to into the pool's slots (memory traffic,
not disk), as far as the layer's share of the cache goes.

Which first: the experts of the chunk's last positions, walking back. The next forward's token
follows those positions, and neighbouring tokens route alike more often than a token and the
prompt's bulk (a system prompt, an earlier turn) do; counting uses over the chunk would favour
the bulk.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .pool import ExpertPool
from .reads import convert_into

# The safetensors name `convert_into` takes for an MLX floating dtype (others copy as they are).
_DTYPE_NAMES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}


def seed_from_whole_layer(
    pool: ExpertPool, layer: int, routed: np.ndarray, whole: dict[str, mx.array]
) -> int:
    """Copy `layer`'s experts that `routed` (`[..., tokens, k]` on the host) names from its
    whole-layer tensors `whole` into the pool, latest positions first. Returns how many were
    copied."""
    host = {key: _host_view(array) for key, array in whole.items()}

    def write(expert: int, views: dict[str, np.ndarray]) -> None:
        for key, slot in views.items():
            source, dtype = host[key]
            convert_into(source[expert], dtype, slot)

    return pool.seed(layer, latest_first(routed), write)


def latest_first(routed: np.ndarray) -> list[int]:
    """The experts `routed` names, each once, by the last position that routed to it, latest
    first (rows of a batch interleaved: every row's last position, then the one before...)."""
    k = routed.shape[-1]
    rows = routed.reshape(-1, routed.shape[-2] if routed.ndim > 1 else 1, k)
    flat = rows[:, ::-1].transpose(1, 0, 2).ravel()
    _, first = np.unique(flat, return_index=True)
    return flat[np.sort(first)].tolist()


def _host_view(array: mx.array) -> tuple[np.ndarray, str]:
    """`array`'s bytes as a NumPy array (bfloat16, which NumPy lacks, as its uint16 bits) and its
    dtype's safetensors name."""
    bits = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    mx.eval(bits)
    return np.asarray(memoryview(bits)), _DTYPE_NAMES.get(array.dtype, "")

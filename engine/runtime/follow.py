"""Ranks in step: rank 0 announces each reply, the other ranks follow it.

Every MoE layer sums over the ranks (engine/experts/share.py), so every rank must run the same
forwards in the same order. Rank 0 is the command the user runs (generate, the server, the
bench); before each reply it sends the request to the others (`announce`), and wherever it asks
whether to stop (before each prefill chunk, after each token) it sends its answer with the K and
mode the next step will use (`agree`): a client that disconnects, or a K switched mid-reply,
reaches every rank at the same step. The other ranks run `Engine.follow`. Rank 0 runs the K and
mode it told the others, never a switch asked on another thread since (the app's): that one waits
for the next agreement.

Messages travel as sums: rank 0 adds its values, every other rank zeros.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from ..errors import Edge0Error
from ..experts.share import ExpertShare


def _summed(share: ExpertShare, values: np.ndarray) -> np.ndarray:
    """Rank 0's `values` on every rank (the others give zeros of the same shape)."""
    mine = values if share.rank == 0 else np.zeros_like(values)
    summed = mx.distributed.all_sum(mx.array(mine), group=share.group)
    return share.host_reads.read([summed], "rank 0's word to the other ranks")[0]


def announce(share: ExpertShare, message: dict | None) -> dict | None:
    """Rank 0 sends `message` (None: the end) and every rank returns it."""
    data = b"" if message is None else json.dumps(message).encode()
    size = int(_summed(share, np.array([len(data)], dtype=np.int64))[0])
    if size == 0:
        return None
    payload = np.frombuffer(data, dtype=np.uint8).astype(np.int32) if share.rank == 0 else None
    if payload is None:
        payload = np.zeros(size, dtype=np.int32)
    return json.loads(_summed(share, payload).astype(np.uint8).tobytes())


def agree(share: ExpertShare, stop: bool, k: int, mode: int) -> tuple[bool, int, int]:
    """Rank 0's answer to "stop here?", and the K and mode (an index) of its next step."""
    stop_, k_, mode_ = _summed(share, np.array([int(stop), k, mode], dtype=np.int64)).tolist()
    return bool(stop_), int(k_), int(mode_)


def ranks_lost(error: RuntimeError) -> Edge0Error:
    """What MLX's distributed layer raised in a reply (a rank ended, the link to it broke), as the
    reply's error: the ranks are out of step from here."""
    said = " ".join(str(error).split())
    return Edge0Error(f"the ranks lost each other mid-reply ({said}): restart the ranks")

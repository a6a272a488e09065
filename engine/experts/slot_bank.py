"""Slot banks: the memory the expert pool lives in.

A bank is one persistent `[slots, ...]` MLX tensor per expert tensor ("gate_proj.weight",
"gate_proj.scales", ...), shared by every MoE layer whose experts have the same layout. A resident
expert is a slot index; a read lands straight in its slot's bytes (pread into the MLX buffer, the
way `reads.py` already fills whole layers), and a layer computes its routed experts with one
`gather_qmm` per projection over the bank, indexed by slot: the same kernel and math as mlx-lm's
resident `SwitchGLU`, with no per-expert arrays to build and no per-expert products (the paper's
staged path): 3 products a layer, whatever its K.

Which expert sits in which slot is the expert pool's (`pool.py`): a bank only hands slots out and
back. A slot is written only when nothing queued on the MLX stream still reads it: the pool evicts
only experts that no pending layer uses (`ExpertPool.use`), and a read ahead that was dropped while
in flight keeps its slot until the read has finished (`give` with its future).
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# Host views of bank storage: bfloat16 has no NumPy type, so such a bank is stored as uint16 and
# computed through an MLX view of the same buffer.
_STORAGE = {mx.bfloat16: mx.uint16}


@dataclass(frozen=True)
class SlotPart:
    """One expert tensor of a layout: its name, one expert's shape, its dtype in the bank and its
    dtype in the checkpoint (safetensors name; "" where it does not matter)."""

    key: str  # "gate_proj.weight"
    shape: tuple[int, ...]
    dtype: mx.Dtype
    source: str = ""

    @property
    def widens_bf16(self) -> bool:
        """bf16 in the checkpoint, float32 in the bank: a float32 whose low 16 bits are zero *is*
        the bf16 widened, so the bank keeps those bits zero and a read writes only the high ones."""
        return self.dtype == mx.float32 and self.source == "BF16" and sys.byteorder == "little"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size


class SlotBank:
    """`capacity` expert slots of one layout, allocated once; slots are handed out and back."""

    def __init__(self, parts: tuple[SlotPart, ...], capacity: int) -> None:
        self.parts = parts
        self.capacity = capacity
        self.slot_nbytes = sum(part.nbytes for part in parts)
        # What the layers compute with, and writable NumPy views of the same bytes for the reads.
        self.arrays: dict[str, mx.array] = {}
        self._host: dict[str, np.ndarray] = {}
        for part in parts:
            storage = mx.zeros((capacity, *part.shape), dtype=_STORAGE.get(part.dtype, part.dtype))
            mx.eval(storage)
            computed = storage if storage.dtype == part.dtype else storage.view(part.dtype)
            mx.eval(computed)  # a view shares the storage's buffer
            self.arrays[part.key] = computed
            host = np.asarray(memoryview(storage))
            if part.widens_bf16:
                # The high halves of the (zeroed) float32s. Copying bf16 bits there is one strided
                # copy, no casting: faster than a widening shift into the whole float32 for the
                # small parts, no slower for large ones (docs/benchmarks.md).
                host = host.view(np.uint16)[..., 1::2]
            self._host[part.key] = host
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        # Slots of reads ahead that were dropped while in flight: free once the read has finished.
        self._draining: dict[int, Future] = {}

    @property
    def nbytes(self) -> int:
        return self.capacity * self.slot_nbytes

    def take(self) -> int | None:
        """A free slot, or None when every slot holds an expert (the caller evicts one)."""
        self._reclaim(block=not self._free)
        return self._free.pop() if self._free else None

    def give(self, slot: int, writing: Future | None = None) -> None:
        """Hand `slot` back; with `writing`, a read that may still be writing into it."""
        if writing is not None and not writing.done():
            self._draining[slot] = writing
        else:
            self._free.append(slot)

    def views(self, slot: int) -> dict[str, np.ndarray]:
        """Writable host views of one slot, by tensor key: each a contiguous block, except for
        parts that widen bf16 (`SlotPart.widens_bf16`), whose view is the high 16 bits of each
        float32, in uint16: the checkpoint's bf16 bits are written there as they are."""
        return {key: host[slot] for key, host in self._host.items()}

    def _reclaim(self, block: bool) -> None:
        """Free the slots whose dropped reads have finished; with `block` and none finished yet,
        wait for the first of them (it is in flight: it finishes on its own)."""
        if not self._draining:
            return
        if block:
            wait(self._draining.values(), return_when=FIRST_COMPLETED)
        for slot, future in list(self._draining.items()):
            if future.done():
                del self._draining[slot]
                self._free.append(slot)

"""Host reads of device arrays: the one counted place.

Asking for a value the device computed (`mx.eval`, `.item()`, `.tolist()`, `np.array(x)` of an
array not yet evaluated) makes the host wait for it. On Metal that drains the GPU's queue: the GPU
idles while the host reads the value and encodes what comes next. On a CPU backend the same wait
looks free, so a count is the only honest measure here. Every such read in the engine goes
through `HostReads.read` (or `synchronize`), which counts it by reason; a step reports its count
as `host_syncs`.

`cost_s` makes each read wait that long before it returns: a model of the queue drain a Metal or
CUDA device would add (`edge0 bench --sync-cost`). Reads of arrays already evaluated are free and
need not come here.
"""

from __future__ import annotations

import time
from collections import Counter

import mlx.core as mx
import numpy as np


class HostReads:
    """Counts the host's waits on the device, each with the reason it is needed."""

    def __init__(self, cost_s: float = 0.0) -> None:
        if cost_s < 0:
            raise ValueError("a sync cost cannot be negative")
        self.cost_s = cost_s
        self.count = 0  # since the last `take`
        self.by_reason: Counter[str] = Counter()  # since the last `take`

    def read(self, arrays: list[mx.array], why: str, also: list | None = None) -> list[np.ndarray]:
        """Evaluate `arrays` in one wait and return them as NumPy arrays (bfloat16 as float32:
        NumPy has none). `also` is evaluated in the same wait and left on the device."""
        arrays = [a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in arrays]
        self.wait([arrays, also or []], why)
        return [np.array(a) for a in arrays]

    def wait(self, arrays, why: str) -> None:
        """Evaluate `arrays` (any tree `mx.eval` takes) in one wait, keeping them on the device."""
        mx.eval(arrays)
        self._counted(why)

    def synchronize(self, why: str) -> None:
        """Wait until everything queued on the device has run."""
        mx.synchronize()
        self._counted(why)

    def take(self) -> tuple[int, dict[str, int]]:
        """The reads since the last call, and their reasons; counting starts again."""
        count, reasons = self.count, dict(self.by_reason)
        self.count = 0
        self.by_reason.clear()
        return count, reasons

    def _counted(self, why: str) -> None:
        self.count += 1
        self.by_reason[why] += 1
        if self.cost_s:
            time.sleep(self.cost_s)

"""Eviction policies: given the experts that may go, which one goes.

A policy is the pure part of the expert pool (`pool.py`): it sees every use of a resident expert
(`touch`) and every expert that left (`remove`), and answers `victim(excluded)` with the expert to
evict among those not excluded. It owns no slot, byte or pin; the pool asks it and acts.

- `lru`: least recently used.
- `lfu-aging`: least frequently used, where every use adds 1 to an expert's score and all scores
  decay by half every `half_life` steps. Recency and frequency both count: an expert used on every
  token survives a burst of one-off experts, and a formerly hot expert fades. Scores outlive
  residency (a ghost history), so an expert that keeps coming back is kept over one-offs even when
  the pool is smaller than one step's working set. It is kept as a heap on a static key,
  `log(score) + step * ln2 / half_life`, since uniform decay never reorders entries.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Container
from typing import Protocol

ExpertKey = tuple[int, int]  # (layer, expert)


class EvictionPolicy(Protocol):
    def touch(self, key: ExpertKey, step: int) -> None: ...
    def remove(self, key: ExpertKey) -> None: ...
    def victim(self, excluded: Container[ExpertKey]) -> ExpertKey | None: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def touch(self, key: ExpertKey, step: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, excluded: Container[ExpertKey]) -> ExpertKey | None:
        return next((k for k in self._order if k not in excluded), None)


class LFUAgingPolicy:
    def __init__(self, half_life: float = 32.0) -> None:
        self._rate = math.log(2) / half_life
        # key -> (score, step of last use, version) for every expert ever used, resident or not: an
        # expert evicted and routed again comes back with its history, so in a pool smaller than a
        # step's working set the experts that recur win over one-offs (else all newcomers tie).
        self._score: dict[ExpertKey, tuple[float, int, int]] = {}
        self._resident: set[ExpertKey] = set()
        # Heap entries carry the version they were pushed with: an entry superseded by a later
        # touch, or of an expert no longer resident, is skipped.
        self._heap: list[tuple[float, int, ExpertKey]] = []
        self._version = 0

    def touch(self, key: ExpertKey, step: int) -> None:
        score, last, _ = self._score.get(key, (0.0, step, 0))
        score = score * math.exp(-self._rate * (step - last)) + 1.0
        self._version += 1
        self._score[key] = (score, step, self._version)
        self._resident.add(key)
        heapq.heappush(self._heap, (self._priority(score, step), self._version, key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._heap = [
                (self._priority(s, t), v, k)
                for k, (s, t, v) in self._score.items()
                if k in self._resident
            ]
            heapq.heapify(self._heap)

    def _priority(self, score: float, step: int) -> float:
        return math.log(score) + self._rate * step

    def remove(self, key: ExpertKey) -> None:
        self._resident.discard(key)

    def victim(self, excluded: Container[ExpertKey]) -> ExpertKey | None:
        kept, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, version, key = entry
            if key not in self._resident or self._score[key][2] != version:
                continue  # superseded by a later touch, or evicted
            kept.append(entry)
            if key not in excluded:
                found = key
                break
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return found


def make_policy(name: str) -> EvictionPolicy:
    # Half-life 32 steps: the best of 4/8/32 in `python -m engine.measure.microbench eviction` on
    # the demo's real routing (the figures, per budget against LRU: docs/benchmarks.md).
    return LRUPolicy() if name == "lru" else LFUAgingPolicy(half_life=32.0)

"""The bounded pool of routed experts resident in MLX memory.

One byte budget covers every layer. Each resident expert is its own set of MLX arrays, so a miss
allocates only that expert and an eviction frees only that expert: nothing is re-stacked.

Eviction policies:
- `lru`: least recently used.
- `lfu-aging`: least frequently used, where every use adds 1 to an expert's score and all scores
  decay by half every `half_life` steps. Recency and frequency both count: an expert used on every
  token survives a burst of one-off experts, and a formerly hot expert fades. It is kept as a heap on
  a static key, `log(score) + step * ln2 / half_life`, since uniform decay never reorders entries.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import mlx.core as mx

ExpertKey = tuple[int, int]  # (layer, expert)


@dataclass
class ResidentExpert:
    arrays: dict[str, mx.array]  # "gate_proj.weight" -> array
    nbytes: int


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def touch(self, key: ExpertKey, step: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, protected: Collection[ExpertKey]) -> ExpertKey | None:
        return next((k for k in self._order if k not in protected), None)


class LFUAgingPolicy:
    def __init__(self, half_life: float = 8.0) -> None:
        self._rate = math.log(2) / half_life
        # key -> (score, step of last use, version); heap entries carry the version they were pushed
        # with, so an entry superseded by a later touch is recognised and skipped.
        self._score: dict[ExpertKey, tuple[float, int, int]] = {}
        self._heap: list[tuple[float, int, ExpertKey]] = []
        self._version = 0

    def touch(self, key: ExpertKey, step: int) -> None:
        score, last, _ = self._score.get(key, (0.0, step, 0))
        score = score * math.exp(-self._rate * (step - last)) + 1.0
        self._version += 1
        self._score[key] = (score, step, self._version)
        heapq.heappush(self._heap, (self._priority(score, step), self._version, key))
        if len(self._heap) > 4 * len(self._score) + 64:
            self._heap = [(self._priority(s, t), v, k) for k, (s, t, v) in self._score.items()]
            heapq.heapify(self._heap)

    def _priority(self, score: float, step: int) -> float:
        return math.log(score) + self._rate * step

    def remove(self, key: ExpertKey) -> None:
        self._score.pop(key, None)

    def victim(self, protected: Collection[ExpertKey]) -> ExpertKey | None:
        kept, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, version, key = entry
            current = self._score.get(key)
            if current is None or current[2] != version:
                continue  # superseded by a later touch, or already removed
            kept.append(entry)
            if key not in protected:
                found = key
                break
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return found


def make_policy(name: str) -> LRUPolicy | LFUAgingPolicy:
    return LRUPolicy() if name == "lru" else LFUAgingPolicy()


class ExpertPool:
    """Resident experts under a byte budget. Experts in `protected` are never evicted."""

    def __init__(self, budget_bytes: int, policy: str = "lfu-aging") -> None:
        self.budget_bytes = budget_bytes
        self.policy = make_policy(policy)
        self._experts: dict[ExpertKey, ResidentExpert] = {}
        self.resident_bytes = 0
        self.evictions = 0
        self.step = 0

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._experts

    def __len__(self) -> int:
        return len(self._experts)

    def get(self, key: ExpertKey) -> ResidentExpert | None:
        expert = self._experts.get(key)
        if expert is not None:
            self.policy.touch(key, self.step)
        return expert

    def put(
        self, key: ExpertKey, expert: ResidentExpert, protected: Collection[ExpertKey] = ()
    ) -> None:
        """Admit an expert, evicting others (never `protected` ones) until the budget holds.

        If only protected experts remain the pool runs over budget until they are released: the
        experts a layer routes to are always all there.
        """
        if key in self._experts:
            self._drop(key)
        while self.resident_bytes + expert.nbytes > self.budget_bytes:
            victim = self.policy.victim(protected)
            if victim is None:
                break
            self._drop(victim)
            self.evictions += 1
        self._experts[key] = expert
        self.resident_bytes += expert.nbytes
        self.policy.touch(key, self.step)

    def _drop(self, key: ExpertKey) -> None:
        expert = self._experts.pop(key)
        self.resident_bytes -= expert.nbytes
        self.policy.remove(key)

    def keys(self) -> list[ExpertKey]:
        return list(self._experts)

    def clear(self) -> None:
        for key in list(self._experts):
            self._drop(key)

"""The bounded pool of routed experts resident in MLX memory.

One byte budget covers every layer. A resident expert is a slot of a `SlotBank` (the store owns
the banks and hands slots out); the pool decides which experts stay, and gives an evicted expert's
slot back through `on_drop`.

Eviction policies:
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
from collections.abc import Callable, Collection
from dataclasses import dataclass

ExpertKey = tuple[int, int]  # (layer, expert)


@dataclass
class ResidentExpert:
    slot: int  # in its layer's slot bank
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

    def victim(self, protected: Collection[ExpertKey]) -> ExpertKey | None:
        kept, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            _, version, key = entry
            if key not in self._resident or self._score[key][2] != version:
                continue  # superseded by a later touch, or evicted
            kept.append(entry)
            if key not in protected:
                found = key
                break
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return found


def make_policy(name: str) -> LRUPolicy | LFUAgingPolicy:
    # Half-life 32 steps: the best of 4/8/32 in `python -m engine.measure.microbench eviction`. On the
    # demo model's real routing (4,800 layer fetches) LFU-aging beat LRU at 10%, 50% and 75%
    # budgets (8.3 vs 0.0%, 55.5 vs 49.7%, 79.8 vs 76.7% hits) and lost at 25% (27.9 vs 31.2%);
    # on the synthetic small model it won or tied at every budget.
    return LRUPolicy() if name == "lru" else LFUAgingPolicy(half_life=32.0)


class ExpertPool:
    """Resident experts under a byte budget. Experts in `protected` are never evicted."""

    def __init__(
        self,
        budget_bytes: int,
        policy: str = "lfu-aging",
        on_drop: Callable[[ExpertKey, ResidentExpert], None] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.on_drop = on_drop  # an expert left the pool (evicted or cleared): free its slot
        self.policy = make_policy(policy)
        self._experts: dict[ExpertKey, ResidentExpert] = {}
        self.resident_bytes = 0
        # Bytes promised to reads ahead in flight or waiting for their step (`reserve`): they count
        # against the budget from the moment they are issued, so experts read ahead never take
        # memory beyond it.
        self.reserved_bytes = 0
        self.evictions = 0
        self.step = 0
        # Experts a step is known to route to (predictions), with the step: never evicted until
        # that step's layer has computed (`unpin_computed`) or the step ended (`unpin_through`).
        self.pinned: dict[ExpertKey, int] = {}
        # Experts a layer of this step computes with (`use`): their slots must not be written
        # while the layer may still be queued on the MLX stream. Released like pins.
        self.in_use: dict[ExpertKey, int] = {}
        # Layers whose misses block the forward while others' are read a step ahead (prerouter
        # mode: the layers that route by their own router). Their experts are evicted last: a
        # miss there costs blocked time, a predicted layer's miss only a read hidden under compute.
        self.kept_layers: frozenset[int] = frozenset()

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
        self._make_room(expert.nbytes, protected)
        self._experts[key] = expert
        self.resident_bytes += expert.nbytes
        self.policy.touch(key, self.step)

    def reserve(self, nbytes: int) -> bool:
        """Promise `nbytes` to a read ahead, evicting (never pinned experts) to keep the budget.
        False, promising nothing, when even that leaves no room: the read is then not made ahead
        (its layer reads it when it runs) rather than taking memory beyond the budget."""
        self._make_room(nbytes, ())
        if self.resident_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            return False
        self.reserved_bytes += nbytes
        return True

    def pin(self, key: ExpertKey, step: int) -> None:
        self.pinned[key] = max(step, self.pinned.get(key, step))

    def use(self, key: ExpertKey) -> None:
        """A layer of this step computes with `key`."""
        self.in_use[key] = self.step

    def unpin_computed(self, layer: int) -> None:
        """This step's pins of `layer` and of every layer before it end: the layer has computed,
        and MLX's stream runs in order, so every layer before it has too (pins for later steps
        stay)."""
        for held in (self.pinned, self.in_use):
            done = [k for k, step in held.items() if k[0] <= layer and step <= self.step]
            for key in done:
                del held[key]

    def unpin_through(self, step: int) -> None:
        """Every pin and use for `step` or before ends: the step is over."""
        self.pinned = {k: s for k, s in self.pinned.items() if s > step}
        self.in_use = {k: s for k, s in self.in_use.items() if s > step}

    def release(self, nbytes: int) -> None:
        """Take back a promise: the read ahead was admitted with `put`, or dropped."""
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)

    def evict_one(
        self, layers: Collection[int] | None = None, protected: Collection[ExpertKey] = ()
    ) -> bool:
        """Evict one expert of `layers` (None: any layer), never a protected, pinned or in-use
        one, kept layers' last. False when there is none to evict."""
        excluded = _Excluded(protected, self.pinned, self.in_use, self.kept_layers, layers)
        victim = self.policy.victim(excluded)
        if victim is None and self.kept_layers:
            excluded.kept_layers = frozenset()
            victim = self.policy.victim(excluded)
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        return True

    def _make_room(self, nbytes: int, protected: Collection[ExpertKey]) -> None:
        """Evict until `nbytes` more fit in the budget, or only protected (or pinned, or in-use)
        experts are left."""
        while self.resident_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            if not self.evict_one(protected=protected):
                break

    def _drop(self, key: ExpertKey) -> None:
        expert = self._experts.pop(key)
        self.resident_bytes -= expert.nbytes
        self.policy.remove(key)
        if self.on_drop is not None:
            self.on_drop(key, expert)

    def keys(self) -> list[ExpertKey]:
        return list(self._experts)

    def clear(self) -> None:
        for key in list(self._experts):
            self._drop(key)


class _Excluded:
    """The keys `evict_one` must not pick (`in` only): protected, pinned, in use, of a kept layer,
    or of a layer outside `layers` (None: every layer is in)."""

    def __init__(self, protected, pinned, in_use, kept_layers: frozenset[int], layers) -> None:
        self.protected = protected
        self.pinned = pinned
        self.in_use = in_use
        self.kept_layers = kept_layers
        self.layers = layers

    def __contains__(self, key: object) -> bool:
        return (
            key in self.protected
            or key in self.pinned
            or key in self.in_use
            or key[0] in self.kept_layers
            or (self.layers is not None and key[0] not in self.layers)
        )

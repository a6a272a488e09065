"""The expert pool keeps its byte budget, never evicts what the current layer needs, and evicts by
its policy."""

from __future__ import annotations

import pytest

from engine.experts.pool import ExpertPool, LFUAgingPolicy, ResidentExpert


def _expert(nbytes: int = 100) -> ResidentExpert:
    return ResidentExpert(slot=0, nbytes=nbytes)


@pytest.mark.parametrize("policy", ["lru", "lfu-aging"])
def test_budget_holds_and_protected_survive(policy):
    pool = ExpertPool(budget_bytes=300, policy=policy)
    for e in range(3):
        pool.put((0, e), _expert())
    assert pool.resident_bytes == 300
    protected = [(0, 0), (0, 1), (0, 2)]
    pool.put((1, 0), _expert(), protected=protected)
    # Everything else is protected: the pool runs over budget rather than drop a routed expert.
    assert all(k in pool for k in protected) and (1, 0) in pool
    assert pool.resident_bytes == 400
    pool.put((1, 1), _expert(), protected=[(1, 1)])
    assert pool.resident_bytes <= 300 + 100
    assert (1, 1) in pool


def test_lru_evicts_least_recent():
    pool = ExpertPool(budget_bytes=300, policy="lru")
    for e in range(3):
        pool.put((0, e), _expert())
    pool.get((0, 0))  # 0 is now the most recent; 1 the least
    pool.put((0, 3), _expert())
    assert (0, 1) not in pool and (0, 0) in pool and pool.evictions == 1


def test_lfu_aging_keeps_frequent_then_forgets_them():
    pool = ExpertPool(budget_bytes=300, policy="lfu-aging")
    pool.put((0, 0), _expert())
    for _ in range(5):
        pool.step += 1
        pool.get((0, 0))  # hot expert
    pool.step += 1
    pool.put((0, 1), _expert())
    pool.put((0, 2), _expert())
    pool.step += 1
    pool.put((0, 3), _expert())  # a one-off burst evicts a one-off expert, not the hot one
    assert (0, 0) in pool
    assert len(pool) == 3
    # Many steps later its score has decayed below fresh experts': the stale one-offs go first
    # (their scores were lower still), then the formerly hot expert.
    pool.step += 200
    pool.put((0, 4), _expert())
    pool.put((0, 5), _expert())
    assert (0, 0) in pool
    pool.put((0, 6), _expert())
    assert (0, 0) not in pool


def test_lfu_heap_stays_bounded():
    policy = LFUAgingPolicy(half_life=4)
    for step in range(2000):
        policy.touch((0, step % 7), step)
    assert len(policy._heap) <= 4 * 7 + 64
    assert policy.victim(protected=()) is not None


def test_pins_last_until_their_step_or_their_layer_has_computed():
    """A pin holds an expert for the step that routes to it: `unpin_computed` ends this step's pins
    of a layer that has computed and of the layers before it (a pin made for the next step stays),
    `unpin_through` ends a step's."""
    pool = ExpertPool(budget_bytes=300, policy="lru")
    pool.step = 5
    for key in ((1, 0), (1, 1), (2, 0)):
        pool.put(key, _expert())
    pool.pin((1, 0), 5)  # this step routes layer 1 to expert 0
    pool.pin((1, 1), 6)  # the next step routes layer 1 to expert 1
    pool.pin((2, 0), 5)
    assert not pool.reserve(100)  # everything pinned: no room for a read ahead
    pool.unpin_computed(1)  # layer 1 has computed this step
    assert set(pool.pinned) == {(1, 1), (2, 0)}
    assert pool.reserve(100)  # the expert layer 1 no longer needs made room
    assert (1, 0) not in pool and (1, 1) in pool and (2, 0) in pool
    pool.unpin_through(5)  # the step ended
    assert set(pool.pinned) == {(1, 1)}
    pool.pin((1, 1), 5)  # an earlier step's pin never shortens a later one
    assert pool.pinned[(1, 1)] == 6


def test_experts_in_use_are_never_evicted_until_their_layer_has_computed():
    """An expert a layer of this step computes with keeps its slot until that layer (or a later
    one) is known computed; `evict_one` picks only among the given layers; every eviction hands
    the expert back through `on_drop` (its slot is freed there)."""
    dropped = []
    pool = ExpertPool(budget_bytes=300, policy="lru", on_drop=lambda k, e: dropped.append(k))
    pool.step = 3
    for key in ((0, 0), (1, 0), (1, 1)):
        pool.put(key, _expert())
        pool.use(key)
    assert not pool.evict_one({0, 1})  # all in use
    pool.unpin_computed(0)  # layer 0 has computed: its expert may go, layer 1's may not
    assert not pool.evict_one({1})
    assert pool.evict_one({0, 1}) and dropped == [(0, 0)]
    pool.unpin_through(3)
    assert pool.evict_one({1}) and dropped == [(0, 0), (1, 0)]
    pool.clear()
    assert dropped == [(0, 0), (1, 0), (1, 1)]

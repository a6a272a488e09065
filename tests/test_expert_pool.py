"""The expert pool keeps its byte budget, never evicts what the current layer needs, gives a miss
a slot whatever else holds them, and evicts by its policy."""

from __future__ import annotations

from concurrent.futures import Future

import mlx.core as mx
import pytest

from engine.experts.eviction import LFUAgingPolicy
from engine.experts.pool import ExpertPool
from engine.experts.slot_bank import SlotPart

EXPERT = (SlotPart("w", (100,), mx.uint8),)  # one expert: 100 bytes


def _pool(budget_bytes: int, policy: str = "lru", layers: int = 4) -> ExpertPool:
    """A pool over `layers` MoE layers of 8 experts, all in one bank."""
    return ExpertPool(
        {n: EXPERT for n in range(layers)}, dict.fromkeys(range(layers), 8), budget_bytes, policy
    )


def _admit(pool: ExpertPool, key, protected=()) -> None:
    """What the store does for a miss: a slot, then the expert in it."""
    pool.admit(key, pool.slot_for_miss(key[0], protected), protected)


def _touch(pool: ExpertPool, key) -> None:
    """A use that ends with its layer: the expert counts as used, and may go again."""
    assert pool.use(key) is not None
    pool.layer_computed(key[0])


def _done_read() -> Future:
    read = Future()
    read.set_result(None)
    return read


@pytest.mark.parametrize("policy", ["lru", "lfu-aging"])
def test_budget_holds_and_protected_survive(policy):
    pool = _pool(300, policy)
    pool.require_slots(4)  # a routed set of 4 is bigger than the budget's share
    for e in range(3):
        _admit(pool, (0, e))
    assert pool.resident_bytes == 300
    protected = [(0, 0), (0, 1), (0, 2), (1, 0)]
    _admit(pool, (1, 0), protected)
    # Everything else is protected: the pool runs over budget rather than drop a routed expert.
    assert all(k in pool for k in protected)
    assert pool.resident_bytes == 400
    _admit(pool, (1, 1), [(1, 1)])
    assert pool.resident_bytes <= 300 and (1, 1) in pool
    # Every resident expert has a slot of its own in the bank.
    slots = [pool.slot_of(k) for k in pool.keys()]
    assert len(set(slots)) == len(slots) and all(0 <= s < 4 for s in slots)


def test_lru_evicts_least_recent():
    pool = _pool(300, "lru")
    for e in range(3):
        _admit(pool, (0, e))
    _touch(pool, (0, 0))  # 0 is now the most recent; 1 the least
    _admit(pool, (0, 3))
    assert (0, 1) not in pool and (0, 0) in pool and pool.evictions == 1


def test_lfu_aging_keeps_frequent_then_forgets_them():
    pool = _pool(300, "lfu-aging")
    _admit(pool, (0, 0))
    for _ in range(5):
        pool.begin_step()
        _touch(pool, (0, 0))  # hot expert
    pool.begin_step()
    _admit(pool, (0, 1))
    _admit(pool, (0, 2))
    pool.begin_step()
    _admit(pool, (0, 3))  # a one-off burst evicts a one-off expert, not the hot one
    assert (0, 0) in pool
    assert len(pool) == 3
    # Many steps later its score has decayed below fresh experts': the stale one-offs go first
    # (their scores were lower still), then the formerly hot expert.
    pool.step += 200
    _admit(pool, (0, 4))
    _admit(pool, (0, 5))
    assert (0, 0) in pool
    _admit(pool, (0, 6))
    assert (0, 0) not in pool


def test_lfu_heap_stays_bounded():
    policy = LFUAgingPolicy(half_life=4)
    for step in range(2000):
        policy.touch((0, step % 7), step)
    assert len(policy._heap) <= 4 * 7 + 64
    assert policy.victim(excluded=()) is not None


def test_pins_last_until_their_step_or_their_layer_has_computed():
    """A pin holds an expert for the step that routes to it: `layer_computed` ends this step's
    pins of a layer that has computed and of the layers before it (a pin made for the next step
    stays), `end_step` ends the step's."""
    pool = _pool(300, "lru")
    pool.step = 5
    for key in ((1, 0), (1, 1), (2, 0)):
        _admit(pool, key)
    pool.pin((1, 0), 5)  # this step routes layer 1 to expert 0
    pool.pin((1, 1), 6)  # the next step routes layer 1 to expert 1
    pool.pin((2, 0), 5)
    assert not pool.read_ahead((3, 0), 6, lambda into: _done_read())  # all pinned: no room
    assert pool.reserved_bytes == 0
    pool.layer_computed(1)  # layer 1 has computed this step
    assert pool.read_ahead((3, 0), 6, lambda into: _done_read())  # layer 1's expert made room
    assert (1, 0) not in pool and (1, 1) in pool and (2, 0) in pool
    assert pool.reserved_bytes == 100 and pool.is_read_ahead((3, 0))
    pool.end_step()  # step 5 ended: (2, 0)'s pin too, not (1, 1)'s for step 6
    pool.step = 6
    assert pool.claim_read_ahead((3, 0)) is not None and pool.reserved_bytes == 0
    pool.pin((1, 1), 5)  # an earlier step's pin never shortens a later one
    pool.end_step()
    assert not pool.in_use


def test_experts_in_use_are_never_evicted_until_their_layer_has_computed():
    """An expert a layer of this step computes with keeps its slot until that layer (or a later
    one) is known computed; a slot for a miss is taken only from experts that may go."""
    pool = _pool(300, "lru")
    pool.step = 3
    for key in ((0, 0), (1, 0), (1, 1)):
        _admit(pool, key)
        pool.use(key)
    assert not pool.read_ahead((2, 0), 4, lambda into: _done_read())  # all in use
    pool.layer_computed(0)  # layer 0 has computed: its expert may go, layer 1's may not
    assert pool.read_ahead((2, 0), 4, lambda into: _done_read())
    assert (0, 0) not in pool and (1, 0) in pool and (1, 1) in pool
    pool.end_step()  # the read ahead was for step 4: it stays
    assert pool.is_read_ahead((2, 0))
    pool.clear()
    assert len(pool) == 0 and pool.resident_bytes == 0


def test_a_miss_takes_a_pin_then_a_read_ahead_before_failing():
    """The forward's miss never waits for a slot: with every slot pinned or read into, it unpins
    the prediction needed latest, then gives up the read ahead needed latest (counted for the step
    it was for), and only a bank of experts all in use this step is an error."""
    pool = _pool(300, "lru", layers=2)
    pool.step = 1
    _admit(pool, (0, 0))
    _admit(pool, (0, 1))
    pool.pin((0, 0), 2)
    pool.pin((0, 1), 3)
    reading = Future()  # still being written: its slot comes back once the read is done
    assert pool.read_ahead((1, 0), 3, lambda into: reading)
    slot = pool.slot_for_miss(1, [(1, 1)])  # unpins (0, 1), pinned for the latest step
    assert (0, 1) not in pool and (0, 0) in pool and pool.is_read_ahead((1, 0))
    pool.admit((1, 1), slot, [(1, 1)])
    pool.use((1, 1))
    slot = pool.slot_for_miss(1, [(1, 1), (1, 2)])  # then (0, 0)'s pin
    pool.admit((1, 2), slot, [(1, 1), (1, 2)])
    pool.use((1, 2))
    reading.set_result(None)
    slot = pool.slot_for_miss(1, [(1, 1), (1, 2), (1, 3)])  # then the read ahead, given up
    assert not pool.is_read_ahead((1, 0)) and pool.pop_given_up(3) == 1
    pool.admit((1, 3), slot, [(1, 1), (1, 2), (1, 3)])
    pool.use((1, 3))
    with pytest.raises(RuntimeError, match="in use at once"):
        pool.slot_for_miss(1, [(1, 1), (1, 2), (1, 3), (1, 4)])


def test_kept_layers_are_evicted_last():
    pool = _pool(400, "lru")
    pool.keep_layers({0})
    for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        _admit(pool, key)
    _touch(pool, (1, 0))
    _touch(pool, (1, 1))  # layer 0's experts are now the least recent: LRU alone would evict them
    _admit(pool, (2, 0))
    _admit(pool, (2, 1))
    assert (0, 0) in pool and (0, 1) in pool
    # Only kept and protected experts left: a kept layer's expert goes rather than overrun.
    _admit(pool, (3, 0), [(2, 0), (2, 1), (3, 0)])
    assert pool.resident_bytes <= 400 and (3, 0) in pool and (0, 0) not in pool

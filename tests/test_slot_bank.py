"""Slot banks: resident experts are slots of persistent tensors, written by reads and never while a
queued layer may still read them."""

from __future__ import annotations

import shutil
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import pytest
from adapters import write_random_profile

from engine import Engine, EngineConfig, GenerationConfig
from engine.experts.reads import convert_into
from engine.experts.slot_bank import SlotBank, SlotPart

GREEDY = GenerationConfig(max_tokens=24)


def test_a_slot_written_on_the_host_is_what_the_bank_computes_with():
    """Host views write the MLX buffers themselves; a bfloat16 part is stored as uint16 and
    computed through a view of the same bytes."""
    parts = (SlotPart("w", (2, 3), mx.float32), SlotPart("s", (4,), mx.bfloat16))
    bank = SlotBank(parts, capacity=3)
    assert bank.nbytes == 3 * (2 * 3 * 4 + 4 * 2)
    slot = bank.take()
    views = bank.views(slot)
    views["w"][...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    convert_into(np.array([1.5, -2.0, 0.25, 3.0], dtype=np.float32), "F32", views["s"])
    assert bank.arrays["w"][slot].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert bank.arrays["s"].dtype == mx.bfloat16
    assert bank.arrays["s"][slot].astype(mx.float32).tolist() == [1.5, -2.0, 0.25, 3.0]
    other = bank.take()
    assert other != slot and bank.arrays["w"][other].tolist() == [[0] * 3] * 2


def test_bf16_widened_into_a_float32_slot_is_what_mlx_casts_whatever_the_slot_held():
    """The reads widen bf16 scales into float32 slots: a slot that held other floats gets
    exactly MLX's cast."""
    values = mx.array([1.5, -2.0, 3.0e-39, float("inf"), float("nan"), 0.1], dtype=mx.bfloat16)
    bits = np.array(values.view(mx.uint16))
    slot = np.full((2, 3), np.pi, dtype=np.float32)  # low halves not zero
    convert_into(bits.reshape(2, 3), "BF16", slot)
    expected = np.array(values.astype(mx.float32)).reshape(2, 3)
    assert slot.view(np.uint32).tolist() == expected.view(np.uint32).tolist()


def test_a_bank_that_widens_bf16_takes_the_checkpoints_bits_in_its_high_halves():
    """A float32 part read from bf16 is written as it is, into the high 16 bits of each float32
    (the low ones stay zero): that is MLX's cast, slot after slot, with no shift per read."""
    values = mx.array([1.5, -2.0, 3.0e-39, float("inf"), float("nan"), 0.1], dtype=mx.bfloat16)
    bits = np.array(values.view(mx.uint16)).reshape(2, 3)
    bank = SlotBank((SlotPart("s", (2, 3), mx.float32, "BF16"),), capacity=2)
    for slot in (bank.take(), bank.take()):
        view = bank.views(slot)["s"]
        assert view.dtype == np.uint16 and not view.flags.c_contiguous
        convert_into(bits, "BF16", view)
        expected = np.array(values.astype(mx.float32)).reshape(2, 3)
        held = np.array(bank.arrays["s"][slot])
        assert held.view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    # A part of another source dtype (or none given) is a plain float32 slot.
    plain = SlotBank((SlotPart("s", (2, 3), mx.float32, "F16"),), capacity=1)
    assert plain.views(plain.take())["s"].dtype == np.float32


def test_a_slot_still_being_written_is_not_handed_out_until_the_write_ends():
    bank = SlotBank((SlotPart("w", (8,), mx.uint8),), capacity=2)
    first, second = bank.take(), bank.take()
    assert bank.take() is None  # all taken: the caller evicts
    bank.give(first)
    assert bank.take() == first
    writing: Future = Future()
    writing.set_running_or_notify_cancel()
    bank.give(second, writing=writing)
    bank.give(first)
    assert bank.take() == first  # the free slot, not the one still written
    writing.set_result(None)
    assert bank.take() == second  # the write ended: its slot comes back


@pytest.fixture(scope="module")
def profiled(checkpoint_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("slots") / "qwen3_moe-tiny"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    write_random_profile(model, 4)
    return model


@pytest.mark.parametrize("mode", ["on-demand", "prerouter"])
def test_the_cache_size_never_changes_the_tokens(profiled, mode):
    """A cache of a routed set and a little more (every slot reused layer after layer, reads ahead
    given up, the stream drained to free slots) gives the tokens of a cache holding everything:
    no slot is ever written while a queued layer reads it. The bank never exceeds the budget."""
    big = EngineConfig(mode=mode, k=4, expert_cache_bytes=1 << 30)
    with Engine(profiled, big) as engine:
        want = engine.generate([5, 9, 13, 17], GREEDY).tokens
        one = engine.store.resident_expert_nbytes(min(engine.store.index.layers))
    for budget in (5 * one, 9 * one):
        tight = EngineConfig(mode=mode, k=4, expert_cache_bytes=budget)
        with Engine(profiled, tight) as engine:
            evicted_in_use = _watch_evictions(engine.store)
            result = engine.generate([5, 9, 13, 17], GREEDY)
            assert evicted_in_use == [], budget
            decode = [s for s in result.steps if s.phase == "decode"]
            assert result.tokens == want, budget
            assert sum(s.loads for s in decode) > len(decode)  # evicting all along
            assert engine.store.bank_bytes <= budget
            assert not engine.store.pool.in_use  # every use ended with its step


def _watch_evictions(store) -> list:
    """Record every expert evicted while a layer that used it this step is not yet known to have
    computed (its slot could then be rewritten under it). Watched from the outside: which experts
    each layer fetched, and which layers the pool was told have computed."""
    pool = store.pool
    used: dict = {}  # key -> step it was fetched in
    computed: dict = {}  # step -> the last layer known computed
    violations: list = []
    fetch, drop = store.fetch, pool._drop
    layer_computed, end_step = pool.layer_computed, pool.end_step

    def watched_fetch(layer, experts):
        slots = fetch(layer, experts)
        for expert in experts:
            used[(layer, expert)] = pool.step
        return slots

    def watched_layer_computed(layer):
        computed[pool.step] = max(layer, computed.get(pool.step, -1))
        layer_computed(layer)

    def watched_end_step():  # the step is over: all of it computed
        computed[pool.step] = float("inf")
        end_step()

    def watched_drop(key):
        if used.get(key) == pool.step and key[0] > computed.get(pool.step, -1):
            violations.append((pool.step, key))
        drop(key)

    store.fetch = watched_fetch
    pool.layer_computed = watched_layer_computed
    pool.end_step = watched_end_step
    pool._drop = watched_drop
    return violations


def test_a_bank_too_small_for_a_wider_k_is_made_again_at_the_next_step(profiled):
    """`set_top_k` (any thread) only records the K; the engine's next step remakes a bank that
    cannot hold one routed set of it, and the tokens do not change. (With one layout the budget
    check already guarantees room; a model whose layers differ in layout can need this.)"""
    with Engine(profiled, EngineConfig(mode="on-demand", k=4)) as engine:
        one = engine.store.resident_expert_nbytes(min(engine.store.index.layers))
    config = EngineConfig(mode="on-demand", k=4, expert_cache_bytes=6 * one)
    with Engine(profiled, config) as engine:
        want = engine.generate([5, 9, 13, 17], GREEDY).tokens
        store = engine.store
        layer = min(store.index.layers)
        small = store.bank(layer)
        assert small.capacity == 6
        store.pool.require_slots(small.capacity + 1)  # as a wider K's `set_top_k` does
        assert engine.generate([5, 9, 13, 17], GREEDY).tokens == want
        assert store.bank(layer) is not small
        assert store.bank(layer).capacity == small.capacity + 1

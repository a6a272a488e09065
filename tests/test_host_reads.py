"""The host's waits on the device: counted in one place, as few as each mode needs.

On Metal every host read of a device array drains the GPU's queue; on this CPU it looks free, so
the count is what is tested. A census from outside the engine (every `mx.eval`, `synchronize`,
and conversion of an array not yet evaluated) must agree with the engine's own count.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from adapters import profile_k, write_random_profile

from engine.config import EngineConfig, GenerationConfig
from engine.host_reads import HostReads
from engine.measure.host_read_census import census
from engine.runtime.generation import Engine

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"
GREEDY = GenerationConfig(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = GenerationConfig(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
# Every decode step routes by the heads' predictions: a dozen steps compare as many routings.
GREEDY_12 = replace(GREEDY, max_tokens=12)


def _decode_waits(engine: Engine, prompt: list[int], gen: GenerationConfig):
    """Per decoded token: the census's count of host waits, and the step's own `host_syncs`."""
    counted, own = [], []
    with census() as waits:
        for token in engine.stream(prompt, gen):
            counted.append(waits.take())
            own.append(token.step.host_syncs)
    # The first token ends the prefill; with a step built ahead, a token's count can land on
    # its neighbour's, so whole runs are compared as well as single steps.
    return counted[1:], own[1:]


@pytest.mark.parametrize(
    ("mode", "k", "cache", "most"),
    [
        ("prerouter", 4, "4M", 1),  # the demo's chat: its first layer held, the rest predicted
        ("prerouter", 4, "64M", 1),  # every expert held: built ahead of the token's read
        ("on-demand", 8, "64M", 1),  # fits: as resident, one wait a token
        ("prefetch", 8, "64M", 1),
        ("on-demand", 8, "4M", 7),  # a wall: each of 6 MoE layers reads its routing back
    ],
)
def test_decode_waits_on_the_demo_counted_from_outside(mode, k, cache, most):
    from engine import parse_size

    config = EngineConfig(mode=mode, k=k, expert_cache_bytes=parse_size(cache))
    with Engine(DEMO, config) as engine:
        prompt = engine.encode("Write a short story about a lighthouse keeper.", chat=True)
        for gen in (GREEDY, SAMPLED):
            counted, own = _decode_waits(engine, prompt, gen)
            assert len(counted) == gen.max_tokens - 1
            assert max(own) == most and sum(counted) == sum(own)
            assert max(counted) <= most + 1  # (a built-ahead step's wait may land one early)


def test_prerouter_tokens_are_the_same_however_much_of_the_model_is_held(
    checkpoint_dir, tmp_path, family
):
    """Prerouter routes by the same predictions whether a consumer layer is held (routed by the
    device array, no read), read from disk (routed by the host's copy of it), or every layer
    is held and steps are built ahead: the same tokens, for every family with heads."""
    model_dir = tmp_path / family
    shutil.copytree(checkpoint_dir(family), model_dir)
    write_random_profile(model_dir, profile_k(family))
    tokens, held = [], []
    for cache in (1 << 30, 200_000, 60_000):
        config = EngineConfig(mode="prerouter", expert_cache_bytes=cache)
        with Engine(model_dir, config) as engine:
            tokens.append(engine.generate([5, 9, 13, 17, 21, 3], GREEDY_12).tokens)
            held.append(len(engine.store.pool.held_layers))
    assert held[0] == len(engine.loaded.index.layers) and held[-1] == 0
    assert tokens[0] == tokens[1] == tokens[2]


def test_a_read_evaluates_once_and_returns_host_arrays():
    reads = HostReads()
    a = mx.arange(4) * 2
    b = mx.ones((2,), dtype=mx.bfloat16)
    kept = mx.zeros((3,)) + 1
    with census() as waits:
        host = reads.read([a, b], "a test", also=[kept])
        again = np.array(kept)  # evaluated in the same wait: free
    assert waits.count == 1 and reads.take() == (1, {"a test": 1})
    assert host[0].tolist() == [0, 2, 4, 6] and host[1].dtype == np.float32
    assert again.tolist() == [1, 1, 1]


def test_a_sync_cost_makes_each_read_wait():
    """--sync-cost: each counted read waits that long more (a model of a GPU queue drain)."""
    reads = HostReads(cost_s=0.02)
    started = time.perf_counter()
    reads.read([mx.arange(3)], "one")
    reads.synchronize("two")
    assert time.perf_counter() - started >= 0.04
    assert reads.take()[0] == 2
    with pytest.raises(ValueError):
        HostReads(cost_s=-1)

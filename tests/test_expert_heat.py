"""The expert heat picture (engine/experts/heat.py) against a real run: every one-token step's
picture is taken on the engine's thread as the step ends and checked against the engine's own
figures for that step (its routing trace, its routed-by-layer table, its loads and hits, the
pool's content)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from adapters import write_random_profile

from engine.config import EngineConfig, GenerationConfig
from engine.experts.heat import HALF_LIFE_STEPS, ExpertEvent, HeatPicture
from engine.runtime.generation import Engine

GREEDY = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 13, 17, 21]
# Small enough that every decode step reads experts (tests/test_tui_app.py's cache).
SMALL_CACHE = 200_000


def _run(model_dir, **config) -> tuple[Engine, list[tuple[HeatPicture, object]], list]:
    """Generate with the store's routing trace on; (engine, [(picture, step metrics)] of every
    token's step, trace). The engine is closed by the caller."""
    engine = Engine(model_dir, EngineConfig(**config))
    engine.store.trace = []
    pictures = []
    for token in engine.stream(PROMPT, GREEDY):
        picture = engine.expert_heat()
        pool = set(engine.store.pool.keys())
        pictures.append((picture, token.step, pool))
    return engine, pictures, engine.store.trace


def _routed_in(trace, step: int) -> dict[int, set[int]]:
    routed: dict[int, set[int]] = {}
    for at, layer, experts in trace:
        if at == step:
            routed.setdefault(layer, set()).update(experts)
    return routed


def _check_step(picture: HeatPicture, step, pool: set, trace) -> None:
    counts = picture.counts()
    by_event = counts.sum(axis=0)
    # Reads the layers waited for or claimed from a read ahead: the step's loads.
    reads = by_event[[ExpertEvent.AHEAD_USED, ExpertEvent.READ_WARM, ExpertEvent.READ_COLD]]
    assert reads.sum() == step.loads
    assert by_event[ExpertEvent.HIT] == step.hits
    routed = _routed_in(trace, picture.step)
    for row, layer in enumerate(picture.layers):
        table = step.routed_by_layer[layer]
        assert counts[row, ExpertEvent.HIT] == table["resident"]
        assert counts[row, ExpertEvent.AHEAD_USED] == table["heads"] + table["lookahead"]
        missed = counts[row, ExpertEvent.READ_WARM] + counts[row, ExpertEvent.READ_COLD]
        assert missed == table["missed"]
        assert picture.routed(row) == routed[layer]
        assert {(layer, e) for e in picture.in_pool(row)} == {k for k in pool if k[0] == layer}
    # Cold reads are the reads with cold bytes: none when the step read nothing cold.
    assert (by_event[ExpertEvent.READ_COLD] > 0) == (step.cold_fraction > 0)
    assert picture.blocked_ms == step.blocked_ms


@pytest.fixture
def model(checkpoint_dir):
    return checkpoint_dir("qwen3_moe", "tiny")


@pytest.mark.parametrize("page_cache", [None, 1], ids=["page cache", "cold reads"])
def test_each_steps_picture_is_what_the_engine_did(model, page_cache):
    engine, pictures, trace = _run(
        model, mode="on-demand", expert_cache_bytes=SMALL_CACHE, page_cache_bytes=page_cache
    )
    try:
        layers = tuple(sorted(engine.loaded.index.layers))
        assert len(pictures) == GREEDY.max_tokens
        for picture, step, pool in pictures:
            assert picture.layers == layers
            assert picture.experts == tuple(
                engine.loaded.index.layers[n].num_experts for n in layers
            )
            _check_step(picture, step, pool, trace)
        cold = sum(p.counts()[:, ExpertEvent.READ_COLD].sum() for p, _, _ in pictures)
        if page_cache == 1:  # expert pages are dropped after every step: reads go to disk
            assert cold > 0
        # On-demand reads nothing ahead.
        assert all(p.counts()[:, ExpertEvent.AHEAD_UNUSED].sum() == 0 for p, _, _ in pictures)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["prefetch", "prerouter"])
def test_reads_ahead_show_as_used_or_unused(model, tmp_path, mode):
    """Prefetch (no profile) reads the lookahead's guesses ahead for the step that guesses;
    prerouter reads the heads' predictions a step ahead. Each read shows in the step that used
    it, or as unused in the step it was for. Prerouter's unused reads can only be guesses of
    its first layer (which this cache cannot hold whole): a prediction is the routing."""
    model_dir = tmp_path / "model"
    shutil.copytree(model, model_dir)
    if mode == "prerouter":
        write_random_profile(model_dir, 4)
    engine, pictures, trace = _run(
        model_dir, mode=mode, expert_cache_bytes=SMALL_CACHE, prefetch_min_expert_bytes=0
    )
    try:
        for picture, step, pool in pictures:
            _check_step(picture, step, pool, trace)
        ahead = sum(p.counts()[:, ExpertEvent.AHEAD_USED].sum() for p, _, _ in pictures)
        unused = sum(p.counts()[:, ExpertEvent.AHEAD_UNUSED].sum() for p, _, _ in pictures)
        assert not engine.store.pool.held_layers
        assert ahead > 0
        if mode == "prerouter":
            assert unused == sum(s.lookahead_dropped for _, s, _ in pictures)
        else:
            assert unused > 0
        if mode == "prefetch":
            # Unless one was given up for a miss's slot, each read issued is used or not.
            whole = [(p, s) for p, s, _ in pictures if s.prefetch_given_up == 0]
            assert whole
            for picture, step in whole:
                counts = picture.counts().sum(axis=0)
                shown = counts[ExpertEvent.AHEAD_USED] + counts[ExpertEvent.AHEAD_UNUSED]
                assert shown == step.lookahead_issued
    finally:
        engine.close()


def test_use_is_the_decayed_share_of_one_token_steps_that_routed_each_expert(model):
    engine, pictures, trace = _run(model, mode="on-demand", expert_cache_bytes=SMALL_CACHE)
    try:
        last = pictures[-1][0]
        one_token_steps = [p.step for p, _, _ in pictures]  # every token's step is one token
        assert last.counted_steps == len(one_token_steps)
        decay = 0.5 ** (1 / HALF_LIFE_STEPS)
        weights = {s: decay ** (one_token_steps[-1] - s) for s in one_token_steps}
        expected = np.zeros(last.use.shape)
        for step in one_token_steps:
            for layer, experts in _routed_in(trace, step).items():
                expected[last.layers.index(layer), sorted(experts)] += weights[step]
        expected = expected / sum(weights.values()) * 255
        assert np.abs(last.use.astype(float) - expected).max() <= 1.0
        assert (last.use > 0).sum() > 0
    finally:
        engine.close()


def test_the_picture_is_bounded_and_small_for_a_large_model():
    """94 layers of 512 experts (Qwen3-235B's shape): three byte-sized arrays, 144 KB."""
    from engine.experts.heat import ExpertHeat

    heat = ExpertHeat(dict.fromkeys(range(94), 512))
    heat.begin_step(1)
    heat.routed(3, [0, 511])
    heat.used((3, 511), ExpertEvent.READ_COLD)
    heat.end_step()
    pooled = np.zeros((94, 512), bool)
    pooled[3, 0] = pooled[93, 7] = True
    picture = heat.picture(pooled)
    assert picture.events.nbytes + picture.pooled.nbytes + picture.use.nbytes == 3 * 94 * 512
    assert picture.routed(3) == {511}  # only `used` marks an event
    assert picture.in_pool(93) == {7} and picture.use[3, 0] == 255

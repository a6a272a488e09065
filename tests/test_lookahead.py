"""Exact lookahead: prefetch guesses each next MoE layer's routing from this layer's input, reads
the guessed experts ahead, and never changes a token (the true router still routes)."""

from __future__ import annotations

import shutil
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import pytest
from adapters import profile_k, write_random_profile
from test_expert_pool import _admit, _done_read, _pool
from test_parity import _all_but_one_budget

from engine.config import EngineConfig, GenerationConfig, mode_label
from engine.experts.ledger import MIN_SCORED, HeadReadGate
from engine.routing.functions import route
from engine.runtime.generation import Engine

GREEDY = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
SAMPLED = GenerationConfig(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
PROMPT = [5, 9, 13, 17, 21]
# The tiny checkpoints' experts are far below the size prefetch reads ahead by default.
READ_EVERY_GUESS = {"prefetch_min_expert_bytes": 0}


def _one_layer_budget(model_dir) -> int:
    """One expert more than a layer's routed set: experts are evicted every step."""
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    try:
        layer = max(engine.store.index.layers)
        return (engine.loaded.top_k + 1) * engine.store.resident_expert_nbytes(layer)
    finally:
        engine.close()


def _run(model_dir, mode: str, gen: GenerationConfig, **config):
    engine = Engine(model_dir, EngineConfig(mode=mode, **READ_EVERY_GUESS, **config))
    try:
        result = engine.generate(PROMPT, gen)
        return result, engine.k
    finally:
        engine.close()


@pytest.mark.parametrize("heads", ["no heads", "heads"])
def test_prefetch_gives_on_demand_tokens_with_a_cache_that_evicts_every_step(
    checkpoint_dir, tmp_path, family, heads
):
    """For every family: the same greedy tokens as on-demand (itself resident's: test_parity),
    with and without trained heads, while the lookahead reads ahead into a cache that holds
    little more than one layer's routed set."""
    model_dir = tmp_path / family
    shutil.copytree(checkpoint_dir(family), model_dir)
    k = None
    if heads == "heads":
        k = profile_k(family)
        write_random_profile(model_dir, k)
    budget = _one_layer_budget(model_dir)
    on_demand, _ = _run(model_dir, "on-demand", GREEDY, k=k, expert_cache_bytes=budget)
    prefetch, _ = _run(model_dir, "prefetch", GREEDY, k=k, expert_cache_bytes=budget)

    assert prefetch.tokens == on_demand.tokens
    decode = [s for s in prefetch.steps if s.phase == "decode"]
    assert sum(s.predicted for s in decode) == 0  # every layer routed by its true router
    guessed = [s.routed_by_layer for s in decode]
    assert all(sum(r["guessed_of"] for r in layers.values()) > 0 for layers in guessed)
    assert prefetch.summary["lookahead_recall"] is not None
    if heads == "heads":
        assert sum(s.prefetch_issued for s in decode) > 0  # the heads still read a step ahead


@pytest.mark.parametrize("family_name", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_sampled_tokens_are_on_demands_too(checkpoint_dir, family_name):
    model_dir = checkpoint_dir(family_name)
    budget = _one_layer_budget(model_dir)
    on_demand, _ = _run(model_dir, "on-demand", SAMPLED, expert_cache_bytes=budget)
    prefetch, _ = _run(model_dir, "prefetch", SAMPLED, expert_cache_bytes=budget)
    assert prefetch.tokens == on_demand.tokens


def test_prefetch_needs_no_profile_and_runs_at_the_native_k(checkpoint_dir):
    """A model without any adapter file: prefetch is offered, loads at the model's own K, and
    reads ahead what the lookahead guesses."""
    model_dir = checkpoint_dir("qwen3_moe")
    engine = Engine(
        model_dir, EngineConfig(mode="prefetch", expert_cache_bytes=60_000, **READ_EVERY_GUESS)
    )
    try:
        assert engine.modes() == ["on-demand", "prefetch"]
        assert engine.k == engine.loaded.top_k
        result = engine.generate(PROMPT, GREEDY)
    finally:
        engine.close()
    decode = [s for s in result.steps if s.phase == "decode"]
    issued = sum(s.lookahead_issued for s in decode)
    used = sum(s.lookahead_in_time + s.lookahead_late for s in decode)
    dropped = sum(s.lookahead_dropped for s in decode)
    assert issued > 0 and used > 0
    assert used + dropped <= issued  # a read is used, dropped when its layer routes, or at step end
    by_layer = result.summary["routed_by_layer"]
    first = min(by_layer)
    assert by_layer[first]["guessed_of"] > 0  # the first MoE layer's guess from the embedding
    for row in by_layer.values():
        routed = row["resident"] + row["heads"] + row["lookahead"] + row["missed"]
        assert row["guessed_right"] <= row["guessed_of"] == routed
        assert row["heads"] == 0


def test_the_guess_is_the_next_layers_own_routing_of_this_layers_input(checkpoint_dir):
    """The guess for layer N+1 is layer N+1's own routing function (its norm, gate, bias and
    groups) applied to the residual that entered layer N's MoE (DeepSeek: sigmoid group top-k
    with a correction bias)."""
    model_dir = checkpoint_dir("deepseek_v3")
    # Not every expert fits: a layer held whole routes on the device and is not guessed.
    budget = _all_but_one_budget(model_dir)
    engine = Engine(
        model_dir, EngineConfig(mode="prefetch", expert_cache_bytes=budget, **READ_EVERY_GUESS)
    )
    lookahead = engine.lookahead
    checked = []
    guess_after = lookahead.guess_after

    def checking_guess_after(layer):
        h = lookahead._inputs.get(layer)
        guess = guess_after(layer)
        if guess is not None:
            following, indices = guess.layer, guess.indices
            block = engine.loaded.blocks[following]
            site = next(s for s in engine.loaded.sites if s.layer == following)
            norm = site.decoder_layer.post_attention_layernorm
            x = mx.fast.rms_norm(h, norm.weight, norm.eps).reshape(-1, h.shape[-1])
            expected, _ = route(
                block.gate_logits(x), block.routing_spec, engine.k, block.expert_bias()
            )
            checked.append(set(np.array(indices).ravel()) == set(np.array(expected).ravel()))
            assert guess.indices.shape[-1] == engine.k  # K wide
        return guess

    lookahead.guess_after = checking_guess_after
    try:
        engine.generate(PROMPT, GREEDY)
    finally:
        engine.close()
    assert checked and all(checked)


def test_prerouter_guesses_only_the_layers_that_route_themselves(checkpoint_dir, tmp_path):
    """In prerouter mode the consumer layers route by a prediction: the lookahead guesses only
    the layers that still route by their own router (the first MoE layer)."""
    model_dir = tmp_path / "profiled"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 4)
    budget = _one_layer_budget(model_dir)  # the first layer cannot be held whole
    engine = Engine(model_dir, EngineConfig(mode="prerouter", k=4, expert_cache_bytes=budget))
    try:
        consumers = set(engine.routing.heads.consumers)
        result = engine.generate(PROMPT, GREEDY)
        assert not engine.store.pool.held_layers
    finally:
        engine.close()
    guessed = {n for n, row in result.summary["routed_by_layer"].items() if row["guessed_of"]}
    assert guessed and not guessed & consumers


def test_without_lookahead_prefetch_reads_nothing_ahead(checkpoint_dir):
    result, _ = _run(checkpoint_dir("qwen3_moe"), "prefetch", GREEDY, lookahead=False)
    assert sum(s.lookahead_issued for s in result.steps) == 0
    assert "lookahead_recall" not in result.summary


def test_a_guess_never_evicts_what_the_step_uses_and_wrong_ones_go_when_the_layer_routes():
    """A read ahead takes a slot only from an expert not in use and not pinned; once its layer
    routes, the reads ahead it does not use are dropped (their bytes and slots free at once)."""
    pool = _pool(300, "lru")
    pool.begin_step()
    _admit(pool, (0, 0))
    _admit(pool, (0, 1))
    _admit(pool, (1, 0))
    pool.use((0, 0))  # layer 0 computes with it this step
    pool.pin((1, 0), pool.step)  # guessed for this step's layer 1
    assert pool.read_ahead((1, 5), pool.step, lambda into: _done_read(), "lookahead")
    assert (0, 0) in pool and (1, 0) in pool and (0, 1) not in pool
    assert not pool.read_ahead((1, 6), pool.step, lambda into: _done_read(), "lookahead")

    assert pool.drop_unused_reads_ahead(1, {(1, 0)}) == 1
    assert not pool.is_read_ahead((1, 5)) and pool.reserved_bytes == 0
    assert (1, 5) in pool  # it had landed: kept as a cached expert, inside the budget
    assert pool.resident_bytes <= pool.budget_bytes

    # One still being read when its layer routes is dropped, not kept.
    pending = Future()
    assert pool.read_ahead((2, 1), pool.step, lambda into: pending, "lookahead")
    assert pool.drop_unused_reads_ahead(2, set()) == 1
    assert (2, 1) not in pool and not pool.is_read_ahead((2, 1))


def test_small_experts_are_not_read_ahead_in_prefetch(checkpoint_dir, tmp_path):
    """Below `prefetch_min_expert_bytes` prefetch reads nothing ahead (the guesses are still
    scored), heads or not, and its tokens stay on-demand's."""
    model_dir = tmp_path / "profiled"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 4)
    engine = Engine(model_dir, EngineConfig(mode="prefetch", k=4, expert_cache_bytes=60_000))
    try:
        assert engine.routing.heads is None  # a profile's heads would only read ahead
        result = engine.generate(PROMPT, GREEDY)
    finally:
        engine.close()
    decode = [s for s in result.steps if s.phase == "decode"]
    assert sum(s.lookahead_issued + s.prefetch_issued for s in decode) == 0
    assert result.summary["lookahead_recall"] is not None
    on_demand, _ = _run(model_dir, "on-demand", GREEDY, k=4, expert_cache_bytes=60_000)
    assert result.tokens == on_demand.tokens


def test_modes_are_labelled_exact_or_approximate():
    assert mode_label("prefetch") == "prefetch (exact)"
    assert mode_label("on-demand") == "on-demand (exact)"
    assert mode_label("prerouter", 4) == "prerouter K=4 (approximate)"


def test_the_head_read_gate_waits_for_a_measure_then_keeps_the_better_guesser():
    gate = HeadReadGate()
    routed = {0, 1, 2, 3}
    for _ in range(MIN_SCORED // 4 - 1):
        gate.score(5, heads={0, 7, 8, 9}, guess={0, 1, 2, 9}, routed=routed)
    assert gate.reads(5)  # not yet measured over MIN_SCORED predicted experts
    gate.score(5, heads={0, 7, 8, 9}, guess={0, 1, 2, 9}, routed=routed)
    assert not gate.reads(5)  # heads 1 in 4 right, the lookahead 3 in 4
    assert gate.reads(6)  # another layer: nothing measured
    for _ in range(3 * MIN_SCORED):
        gate.score(5, heads={0, 1, 2, 3}, guess=None, routed=routed)
    assert gate.reads(5)  # now as good as the lookahead
    gate.reset()
    assert gate.heads == {} and gate.lookahead == {}


def test_prefetch_reads_no_prediction_of_heads_the_lookahead_beats(checkpoint_dir, tmp_path):
    """Prefetch with heads that guess worse than the lookahead (random ones): once measured,
    their predictions are not read ahead (the experts already cached are still kept), the
    tokens stay on-demand's; prerouter, routed by the predictions, reads every one."""
    model_dir = tmp_path / "profiled"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 4)
    gen = GenerationConfig(max_tokens=40, temperature=0.0, ignore_eos=True)
    budget = _all_but_one_budget(model_dir)  # held layers would read nothing ahead
    engine = Engine(
        model_dir,
        EngineConfig(mode="prefetch", k=4, expert_cache_bytes=budget, **READ_EVERY_GUESS),
    )
    try:
        result = engine.generate(PROMPT, gen)
        gate = engine.store.ledger.gate
        gated = [layer for layer in gate.heads if not gate.reads(layer)]
        for layer in gated:
            assert gate.heads[layer].rate < gate.lookahead[layer].rate
    finally:
        engine.close()
    decode = [s for s in result.steps if s.phase == "decode"]
    assert gated and sum(s.heads_not_read for s in decode) > 0
    assert max(s.heads_not_read for s in decode) <= 4 * len(gated)  # each prediction once
    # Read until measured: MIN_SCORED predicted experts, 4 a step at K=4, the prompt's last
    # token's step among them. A step's predictions are staged once it has scored its own, so
    # the step that completes the measure already stages by it.
    assert sum(s.heads_not_read for s in decode[: MIN_SCORED // 4 - 2]) == 0
    assert decode[MIN_SCORED // 4 - 2].heads_not_read > 0
    assert result.summary["median_heads_not_read"] > 0
    on_demand, _ = _run(model_dir, "on-demand", gen, k=4)
    assert result.tokens == on_demand.tokens

    prerouter, _ = _run(model_dir, "prerouter", gen, k=4)
    assert sum(s.heads_not_read for s in prerouter.steps) == 0

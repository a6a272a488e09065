"""The memory plan: computed before the weights are read, kept by the run, refused when it does not
fit, and above the kernel's peak of a real run."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from cli_runner import run_cli
from test_peak_rss import run_measured

from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime import memory_plan
from engine.runtime.generation import Engine
from engine.runtime.metrics import process_rss_bytes

MIB = 2**20
PROMPT = [(i * 37 + 5) % 1000 + 3 for i in range(60)]


def _plan(model_dir, **config):
    with Engine(model_dir, EngineConfig(**config)) as engine:
        return engine.memory_plan, engine.config, engine.store


def _limit(monkeypatch, limit_bytes: int) -> None:
    monkeypatch.setattr(memory_plan, "memory_limit", lambda: (limit_bytes, "test limit"))


def test_the_plan_counts_the_cache_the_banks_take_and_whole_layers_beside_it(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    plan, config, store = _plan(model, k=4, expert_cache_bytes=1 << 30, whole_layer_prefill=True)
    assert plan.expert_cache_bytes == store.pool.planned_bytes(4) > 0
    assert plan.resident_bytes > 0 and plan.kv_cache_bytes > 0 and plan.runtime_bytes > 0
    assert plan.whole_layer_prefill and config.whole_layer_prefill
    assert plan.total_bytes == sum(n for _, n in plan.terms())
    layer = max(
        store.resident_expert_nbytes(n) * store.index.layers[n].num_experts
        for n in store.index.layers
    )
    through_cache, _, _ = _plan(model, k=4, expert_cache_bytes=1 << 30, whole_layer_prefill=False)
    assert plan.prefill_bytes - through_cache.prefill_bytes == 2 * layer


def test_whole_layers_larger_than_the_expert_cache_go_through_it(checkpoint_dir):
    """By default --expert-cache bounds prefill's expert bytes too: two layers larger than the
    cache are read through it, a bankful at a time."""
    model = checkpoint_dir("qwen3_moe")
    with Engine(model, EngineConfig(k=4)) as engine:
        one = engine.store.resident_expert_nbytes(min(engine.store.index.layers))
    plan, config, store = _plan(model, k=4, expert_cache_bytes=6 * one)
    assert not plan.whole_layer_prefill and config.whole_layer_prefill is False
    assert not store.whole_layer_prefill


def test_a_plan_over_the_limit_drops_whole_layers_before_it_refuses(checkpoint_dir, monkeypatch):
    model = checkpoint_dir("qwen3_moe")
    whole, _, _ = _plan(model, k=4, whole_layer_prefill=True)
    _limit(monkeypatch, whole.total_bytes - 1)
    plan, config, _ = _plan(model, k=4, whole_layer_prefill=True)
    assert not plan.whole_layer_prefill and not config.whole_layer_prefill
    assert plan.fits and plan.total_bytes < whole.total_bytes
    _limit(monkeypatch, whole.runtime_bytes // 2)  # not even the runtime fits
    with pytest.raises(Edge0Error, match="memory plan needs .* available .*test limit"):
        _plan(model, k=4)


def test_the_refusal_names_how_much_to_take_off_the_expert_cache(checkpoint_dir, monkeypatch):
    model = checkpoint_dir("qwen3_moe")
    config = {"k": 4, "expert_cache_bytes": 1 << 30, "whole_layer_prefill": False}
    plan, _, _ = _plan(model, **config)
    over = plan.expert_cache_bytes // 2
    rest = plan.total_bytes - plan.runtime_bytes - over  # the runtime is measured at each load
    monkeypatch.setattr(
        memory_plan, "memory_limit", lambda: (process_rss_bytes() + rest, "test limit")
    )
    with pytest.raises(Edge0Error, match=r"lower --expert-cache by [0-9.]+ [KM]iB \(to "):
        _plan(model, **config)


def test_generate_over_the_plan_is_one_line_and_exit_2(checkpoint_dir, monkeypatch):
    model = checkpoint_dir("qwen3_moe")
    _limit(monkeypatch, 50 * MIB)
    out = run_cli("generate", str(model), "--prompt", "hi", "--max-tokens", "2")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "memory plan needs" in lines[0] and "test limit" in lines[0]
    assert "Traceback" not in out.stderr


def test_expert_cache_auto_takes_what_the_plan_leaves(checkpoint_dir, monkeypatch):
    model = checkpoint_dir("qwen3_moe")
    everything, _, _ = _plan(model, k=4, expert_cache_bytes=1 << 30)
    others = everything.total_bytes - everything.expert_cache_bytes
    limit = others + everything.expert_cache_bytes // 2  # room for about half the experts
    _limit(monkeypatch, limit)
    plan, config, store = _plan(model, k=4, expert_cache_auto=True)
    assert 0 < plan.expert_cache_bytes < everything.expert_cache_bytes
    assert plan.fits and plan.total_bytes <= limit
    assert config.expert_cache_bytes == store.pool.budget_bytes
    assert not config.expert_cache_auto


def test_info_memory_prints_every_term_and_the_verdict(checkpoint_dir):
    out = run_cli("info", str(checkpoint_dir("qwen3_moe")), "--memory", "--k", "4")
    assert out.returncode == 0, out.stderr
    for term in ("runtime", "resident weights", "expert cache (K=4)", "prefill", "KV cache"):
        assert term in out.stdout
    assert "total" in out.stdout and "available" in out.stdout and "fits" in out.stdout


def test_info_memory_shows_a_plan_that_does_not_fit(checkpoint_dir, monkeypatch):
    _limit(monkeypatch, 50 * MIB)
    out = run_cli("info", str(checkpoint_dir("qwen3_moe")), "--memory")
    assert out.returncode == 2
    assert "does NOT fit" in out.stdout


def test_a_run_peaks_within_its_plan(checkpoint_dir):
    """`edge0 generate` in its own process: the kernel's peak of the process is within the plan
    (+10%), and the peak it reports is the kernel's (within 10%)."""
    model = checkpoint_dir("qwen3_moe")
    prompt = " ".join(f"word{i}" for i in range(300))
    run = run_measured(
        *_cli(), "generate", str(model), "--json", "--max-tokens", "8", "--prompt", prompt
    )
    assert run["status"] == 0, run["stderr"]
    report = json.loads(run["stdout"])
    plan = report["memory_plan"]
    assert run["max_rss_bytes"] <= 1.1 * plan["total_bytes"]
    assert (
        abs(report["summary"]["peak_rss_bytes"] - run["max_rss_bytes"])
        <= 0.1 * run["max_rss_bytes"]
    )


def _cli() -> list[str]:
    return [sys.executable, "-m", "edge0_tui.cli"]


def test_generation_keeps_its_tokens_whatever_the_plan_chose(checkpoint_dir):
    """The plan changes where prefill's experts live, never what is computed."""
    model = checkpoint_dir("qwen3_moe")
    greedy = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for whole in (True, False):
        config = EngineConfig(k=4, prefill_chunk=32, exact_kernels=True, whole_layer_prefill=whole)
        with Engine(model, config) as engine:
            tokens.append(engine.generate(PROMPT, greedy).tokens)
    assert tokens[0] == tokens[1]


def test_a_wider_k_that_does_not_fit_the_plan_is_refused_and_the_k_stays(
    checkpoint_dir, monkeypatch
):
    """A K switch grows the banks to one routed set of the new K: the plan at that K is checked
    first, and a K that does not fit is refused with the K that stays."""
    model = checkpoint_dir("qwen3_moe")
    with Engine(model, EngineConfig(k=4)) as engine:
        one = engine.store.resident_expert_nbytes(min(engine.store.index.layers))
    config = EngineConfig(k=4, expert_cache_bytes=4 * one)  # one routed set of 4: no more
    with Engine(model, config) as engine:
        at_4 = engine.memory_plan
        at_8 = engine.loaded.plan_at(8)
        assert at_8.expert_cache_bytes > at_4.expert_cache_bytes
        limit = (at_4.total_bytes + at_8.total_bytes) // 2
        real = engine.loaded.plan_at
        engine.loaded.plan_at = lambda k: dataclasses.replace(
            real(k), limit_bytes=limit, limit_source="test limit"
        )
        with pytest.raises(Edge0Error, match="K=8: the memory plan needs .* K=4 stays"):
            engine.request_k(8)
        assert engine.pending[0] == 4
        engine.request_k(2)  # a narrower K fits


def test_the_expert_cache_shown_is_the_one_in_effect(checkpoint_dir):
    """A budget larger than every expert (as `auto` gives on a small model) is shown as what the
    cache can hold, in `info()` (`edge0 info`, `/v1/models`, the app), not as asked."""
    from engine.runtime.generation import Engine

    config = EngineConfig(mode="on-demand", expert_cache_bytes=16 << 30)
    with Engine(checkpoint_dir("qwen3_moe"), config) as engine:
        shown = engine.info()["expert_cache_bytes"]
        every_expert = engine.store.pool.planned_bytes(engine.k)
        assert shown == engine.memory_plan.expert_cache_bytes == every_expert < 16 << 30

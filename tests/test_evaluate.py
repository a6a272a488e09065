"""`edge0 eval`: its maths on constructed cases, and the command on a tiny synthetic model."""

from __future__ import annotations

import json
import math
import pydoc_data.topics
import shutil

import mlx.core as mx
import numpy as np
import pytest
from adapters import write_random_profile
from cli_runner import run_cli

from edge0_tui.cli import main
from engine.config import EngineConfig
from engine.measure.evaluate import (
    distinct_ngram_ratio,
    engine_logits,
    merge_lora,
    nll_sum,
    perplexity,
    requantize,
    retention,
    weight_retention,
)
from engine.runtime.generation import Engine
from engine.runtime.layer_major import layer_major
from engine.runtime.metrics import process_rss_bytes
from engine.train.student import LoRAInit, load_student


def test_distinct_4_of_known_sequences():
    # "abcabcabc": 6 four-grams (abca, bcab, cabc, abca, bcab, cabc), 3 distinct.
    assert distinct_ngram_ratio(["abcabcabc"]) == 0.5
    assert distinct_ngram_ratio(["abcdefgh"]) == 1.0
    assert distinct_ngram_ratio(["aaaaaaa"]) == 0.25  # 4 four-grams, 1 distinct
    # Token lists; the ratio is averaged over sequences; too-short ones do not count.
    assert distinct_ngram_ratio([[1, 2, 3, 4, 5], [7, 7, 7, 7, 7], [1, 2]]) == 0.75
    assert distinct_ngram_ratio(["abcab"], n=2) == 0.75


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    vocab = 1024
    tokens = mx.array(np.random.default_rng(0).integers(0, vocab, size=(3, 17)))
    nll, count = nll_sum(mx.zeros((3, 17, vocab)), tokens)
    assert count == 3 * 16
    assert perplexity(nll, count) == pytest.approx(vocab, rel=1e-5)
    # A model that puts all its mass on the right token has perplexity 1.
    sure = mx.where(
        mx.arange(vocab) == mx.concatenate([tokens[:, 1:], tokens[:, :1]], 1)[..., None], 50.0, 0.0
    )
    assert perplexity(*nll_sum(sure, tokens)) == pytest.approx(1.0, abs=1e-6)


def _grid(rng, rows=8, groups=4):
    """A weight whose every group of 64 lies on its own 4-bit grid (step 1/16, codes 0 and 15
    present): `requantize` gives it back exactly. Returns (codes, weight)."""
    codes = rng.integers(0, 16, size=(rows, groups, 64))
    codes[..., 0], codes[..., 1] = 0, 15
    return codes, (codes - 15) / 16


def test_retention_is_one_when_the_delta_survives_and_zero_below_resolution():
    rng = np.random.default_rng(0)
    codes, base = _grid(rng)
    flat = lambda w: mx.array(w.reshape(8, 256).astype(np.float32))  # noqa: E731
    assert mx.array_equal(requantize(flat(base)), flat(base))

    # Whole 4-bit steps on the inner codes (the group's min and max stay): on the grid, kept exactly.
    shift = rng.choice([-1, 1], size=codes.shape) * ((codes > 0) & (codes < 15))
    moved = (
        np.clip(codes + shift, 1, 14) * ((codes > 0) & (codes < 15))
        + codes * ((codes == 0) | (codes == 15))
        - 15
    ) / 16
    u = flat(moved)
    assert retention(u, requantize(u), flat(base)) == pytest.approx(1.0, abs=1e-6)

    # A delta of 1% of a step on the inner values: requantizing rounds it all away.
    tiny = rng.normal(size=codes.shape) / 16 * 0.01 * ((codes > 0) & (codes < 15))
    u = flat(base + tiny)
    assert retention(u, requantize(u), flat(base)) == pytest.approx(0.0, abs=1e-6)
    # Something in between for a delta of about a step everywhere.
    u = flat(base + rng.normal(size=codes.shape) / 16)
    assert 0.0 < retention(u, requantize(u), flat(base)) < 1.0


@pytest.fixture(scope="module")
def profiled(checkpoint_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("eval") / "qwen3_next"
    shutil.copytree(checkpoint_dir("qwen3_next"), model_dir)
    write_random_profile(model_dir, 2)
    # A LoRA on every target kind (the random profile's covers attention only).
    student = load_student(model_dir, k=2, lora=LoRAInit(r=4))
    for module in student.lora_modules().values():
        module.lora_b = mx.random.normal(module.lora_b.shape) * 0.01
    student.save_lora(model_dir / "lora_k2.safetensors")
    return model_dir


def test_weight_retention_follows_the_size_of_the_delta(profiled):
    student = load_student(profiled, k=2, lora=profiled / "lora_k2.safetensors")
    engine = Engine(profiled, EngineConfig(mode="on-demand"))
    try:
        kinds = {}
        for scale in (30.0, 0.001):  # a delta of many 4-bit steps; one far below a step
            for module in student.lora_modules().values():
                module.scale = scale
            kinds[scale] = weight_retention(student, merge_lora(student, engine))
    finally:
        engine.close()
    assert set(kinds[30.0]) == {"attention", "linear attention", "shared expert"}
    for kind, r in kinds[30.0].items():
        # Requantizing a delta-dominated weight leaves 4-bit noise of about a tenth of it, mostly
        # orthogonal to the delta.
        assert r["retention"] > 0.8 and r["projected"] > 0.95, (kind, r)
        assert r["delta_rms"] > 2 * r["step_mean"]
    for kind, r in kinds[0.001].items():
        assert r["delta_rms"] < 0.01 * r["step_mean"]
        # Rounded away; what merging still changes is the base's own requantization.
        assert r["retention"] < 0.05 and abs(r["projected"]) < 0.05, (kind, r)


def test_cli_eval_reports_everything(profiled, tmp_path, capsys):
    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(pydoc_data.topics.topics.values())[-20_000:])
    args = ["eval", str(profiled), "--text", str(text), "--k", "2", "--max-tokens", "256"]
    assert main([*args, "--samples", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "prerouter" and report["k"] == 2 and report["lora_applied"]
    assert report["perplexity"]["windows"] == 2 and report["perplexity"]["value"] > 1
    assert report["perplexity"]["path"].startswith("student path")
    recall = report["recall"]
    assert set(recall["per_layer"]) == {"1", "2", "3"} and 0 <= recall["mean"] <= 1
    assert recall["chance"] == 2 / 16
    assert 0 < report["distinct_4"] <= 1
    weights = report["retention"]["weights"]
    assert set(weights) == {"attention", "linear attention", "shared expert"}
    assert all(math.isfinite(r["retention"]) for r in weights.values())
    assert math.isfinite(report["retention"]["logits"])
    # The whole evaluation's peaks: the kernel's high-water mark holds at least what is resident.
    memory = report["memory"]
    assert memory["peak_mlx_bytes"] > 0 and memory["peak_rss_scope"] == "process"
    assert memory["peak_rss_bytes"] >= process_rss_bytes()

    # Human-readable, on-demand mode (perplexity through the engine), without the LoRA.
    assert main([*args, "--samples", "1", "--mode", "on-demand", "--no-lora"]) == 0
    printed = capsys.readouterr().out
    assert "mode on-demand, K=2" in printed and "LoRA none" in printed
    assert "recall@2" in printed and "distinct-4" in printed and "retention" not in printed
    assert "peak memory: MLX " in printed and ", process RSS " in printed


def test_cli_eval_of_a_plain_checkpoint_resident_equals_on_demand(checkpoint_dir, tmp_path, capsys):
    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(pydoc_data.topics.topics.values())[-20_000:])
    args = ["eval", str(checkpoint_dir("bailing_moe")), "--text", str(text), "--samples", "1"]
    args += ["--max-tokens", "256"]
    reports = {}
    for mode in ("resident", "on-demand"):
        assert main([*args, "--mode", mode, "--json"]) == 0
        reports[mode] = json.loads(capsys.readouterr().out)
    assert reports["resident"]["perplexity"]["value"] == pytest.approx(
        reports["on-demand"]["perplexity"]["value"], rel=1e-5
    )
    assert main(args) == 0  # no heads: on-demand, no recall, no LoRA to merge
    printed = capsys.readouterr().out
    assert "mode on-demand, K=4, heads none, LoRA none" in printed
    assert "recall" not in printed and "retention" not in printed


def test_cli_eval_takes_an_expert_cache_and_sizes_its_own_by_default(checkpoint_dir, tmp_path):
    """Every command that loads a model takes --expert-cache (auto by default, so eval runs
    where the model streams); a cache below one routed set is refused in one line."""
    model = checkpoint_dir("qwen3_moe")
    text = tmp_path / "held.txt"
    text.write_text("\n\n".join(pydoc_data.topics.topics.values())[-20_000:])
    base = ("eval", str(model), "--text", str(text), "--mode", "on-demand", "--max-tokens", "256",
            "--samples", "1")  # fmt: skip
    small = run_cli(*base, "--expert-cache", "200K", "--json")
    assert small.returncode == 0, small.stderr
    assert math.isfinite(json.loads(small.stdout)["perplexity"]["value"])
    tiny = run_cli(*base, "--expert-cache", "1K")
    assert tiny.returncode == 2 and "an expert cache of 1.00 KiB cannot hold" in tiny.stderr
    assert "--expert-cache" in run_cli("eval", "--help").stdout


# -- layer-major passes ------------------------------------------------------------------------------


def _windows(engine: Engine, count: int, length: int = 24) -> mx.array:
    rng = np.random.default_rng(3)
    vocab = min(engine.vocab_size, 500)
    return mx.array(rng.integers(1, vocab, size=(count, length)), dtype=mx.int32)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "gpt_oss"])
def test_a_layer_major_pass_gives_each_windows_logits_and_reads_each_layer_once(
    checkpoint_dir, family
):
    """Layer-major (every window through a layer, then the next) gives each window the logits its
    own forward gives, while each MoE layer is read once for the pass (whole: it runs every
    window); a forward per window, with a cache of two layers' experts, reads the model again
    for (nearly) every window. qwen3_next
    asks its layers which attention they run (`is_linear`); gpt_oss gives sliding and
    full-attention layers different masks: both go through the taps."""
    model = checkpoint_dir(family)
    probe = Engine(model, EngineConfig(mode="on-demand"))
    layers = probe.loaded.index.layers
    probe.close()
    experts_bytes = sum(layer.nbytes for layer in layers.values())
    one_layer = max(layer.nbytes for layer in layers.values())
    config = EngineConfig(
        mode="on-demand", exact_kernels=True, expert_cache_bytes=2 * one_layer,
        whole_layer_prefill=True,
    )  # fmt: skip
    engine = Engine(model, config)
    try:
        windows = _windows(engine, 5)
        token_major, read = [], 0
        for w in windows:
            token_major.append(np.array(engine_logits(engine, w[None])))
            read += engine.store.counters.bytes_read
        out: dict[int, np.ndarray] = {}
        batches = [w[None] for w in windows]
        score = lambda b, logits: out.setdefault(b, np.array(logits))  # noqa: E731
        layer_major(engine.model, batches, engine.model, score, engine.store)
        counters = engine.store.counters
    finally:
        engine.close()
    assert sorted(out) == list(range(len(windows)))
    for b, expected in enumerate(token_major):
        np.testing.assert_array_equal(out[b], expected)
    assert counters.whole_layer_reads == len(layers) and counters.bytes_read == experts_bytes
    assert read > 3 * experts_bytes  # token-major: the model again for (nearly) every window


def test_the_student_path_layer_major_equals_its_forwards(profiled):
    """The student's predictions go from owner to consumer within a batch's forward: switched
    per batch in a layer-major pass, each batch's logits and routing record are its forward's."""
    student = load_student(profiled, k=2, streamed=True)
    windows = mx.array(np.random.default_rng(5).integers(1, 200, size=(6, 20)), dtype=mx.int32)
    batches = [windows[0:2], windows[2:4], windows[4:6]]
    forwards = []
    for batch in batches:
        record: dict = {}
        logits = student(batch, gate_prefix=1, record=record)
        forwards.append((np.array(logits), {n: np.array(r[0]) for n, r in record.items()}))
    records: list[dict] = [{} for _ in batches]
    passed: dict[int, np.ndarray] = {}
    student.layer_major(batches, records, lambda b, logits: passed.setdefault(b, np.array(logits)))
    assert student.loaded.store.counters.whole_layer_reads == len(student.loaded.sites)
    for b, (logits, routed) in enumerate(forwards):
        np.testing.assert_array_equal(passed[b], logits)
        assert routed.keys() == records[b].keys()
        for layer, indices in routed.items():
            np.testing.assert_array_equal(np.array(records[b][layer][0]), indices)

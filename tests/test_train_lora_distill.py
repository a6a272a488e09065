"""Phases 2 and 3 on tiny synthetic models: the student path is the served model, SFT and on-policy
distillation lower their losses, and training resumes where it stopped."""

from __future__ import annotations

import contextlib
import io
import os
import pydoc_data.topics
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from adapters import profile_k, record_executed, write_random_profile
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from edge0_tui.cli import main
from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime.generation import Engine
from engine.train.distill import (
    TrainDistillConfig,
    rollout_engine,
    serve_lora,
    topk_reverse_kl,
    train_distill,
)
from engine.train.lora import TrainLoRAConfig, forward_kl, train_lora
from engine.train.run import RunLock
from engine.train.student import LoRAInit, load_student, lora_kind
from engine.train.synth import write_synthetic_teacher
from engine.train.teacher import load_teacher

TEXT = "\n\n".join(pydoc_data.topics.topics.values())[:40_000]
KINDS = {
    "qwen3_moe": {"attention"},
    "qwen3_next": {"attention", "linear attention", "shared expert"},
    "qwen3_5_moe": {"attention", "linear attention", "shared expert"},
    "bailing_moe": {"attention", "shared expert"},
    "mixtral": {"attention"},
    "glm4_moe": {"attention", "shared expert"},
    "deepseek_v3": {"attention", "shared expert"},
    "gpt_oss": {"attention"},
    "llama4": {"attention", "shared expert"},
    "minimax": {"attention"},
    "qwen2_moe": {"attention", "shared expert"},
    "olmoe": {"attention"},
    "ernie4_5_moe": {"attention", "shared expert"},
}


@pytest.fixture(scope="module")
def profiled(checkpoint_dir, tmp_path_factory):
    """`profiled(family)`: a copy of the tiny checkpoint with random K=2 heads and LoRA files."""
    root = tmp_path_factory.mktemp("profiled")

    def make(family: str):
        model_dir = root / family
        if not model_dir.exists():
            shutil.copytree(checkpoint_dir(family), model_dir)
            write_random_profile(model_dir, profile_k(family, 2))
        return model_dir

    return make


# -- the student path ----------------------------------------------------------------------------


def test_student_with_the_true_router_is_the_resident_model(checkpoint_dir, family):
    model_dir = checkpoint_dir(family)
    student = load_student(model_dir, heads=False, lora=LoRAInit())  # B = 0: the base
    tokens = mx.array(np.random.default_rng(0).integers(0, 1000, size=(2, 48)))
    engine = Engine(model_dir, EngineConfig(mode="resident"))
    try:
        served = np.array(engine.model(tokens))
    finally:
        engine.close()
    ours = np.array(student(tokens))
    diff = np.abs(ours - served).max()
    print(
        f"\n{family}: max |student - resident| = {diff:.3g} (logits up to {np.abs(served).max():.2f})"
    )
    # On the MLX CPU backend a 4-bit matmul dequantizes to float32 and runs the same GEMM: the
    # dequantized float32 experts give bit-identical logits (measured 0.0 for all four families).
    # A GPU backend in bf16 accumulates differently; 1e-4 of the logit scale is float32's margin.
    assert diff <= 1e-4 * max(1.0, np.abs(served).max())

    # Only the LoRA trains, and only on attention / linear-attention / shared-expert projections.
    trainable = [name for name, _ in tree_flatten(student.model.trainable_parameters())]
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    assert {lora_kind(p) for p in student.lora_modules()} == KINDS[family]
    routed = (".switch_mlp.", ".experts.", "mlp.gate.", "mlp.router.", "feed_forward.router.")
    assert not any(marker in p + "." for p in student.lora_modules() for marker in routed)


def _decode_recording(engine: Engine, prompt: list[int]):
    """Greedy tokens, and per decoded position the routing of every MoE layer and the logits."""
    logits = []
    forwards = record_executed(engine)
    reply = engine.stream(prompt, GenerationConfig(max_tokens=16), keep_logits=True)
    for token in reply:
        logits.append(np.array(token.logits[0]))
    result = reply.result
    routed = [forwards[s] for s in sorted(forwards)][: len(result.tokens)]
    return result.tokens, routed, np.stack(logits)


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "bailing_moe", "gpt_oss", "deepseek_v3"]
)
def test_student_routes_as_the_engine_decodes(profiled, family):
    """Prerouter mode: for the same tokens, the student routes every MoE layer at every decoded
    position exactly as the engine executed it, and its logits are the engine's."""
    model_dir = profiled(family)
    k = profile_k(family, 2)
    student = load_student(model_dir, k=k, lora=model_dir / f"lora_k{k}.safetensors")
    assert student.consumers
    engine = Engine(model_dir, EngineConfig(mode="prerouter", k=k))
    try:
        for prompt in ([7], [5, 9, 13, 17]):  # a one-token prompt, and one that prefills
            tokens, routed, logits = _decode_recording(engine, prompt)
            # Decoded position i (the forward that produced token i) is sequence position P-1+i;
            # the engine prefilled the positions before it with the gate.
            first = len(prompt) - 1
            record = {}
            ours = student(mx.array([prompt + tokens[:-1]]), max(first, 1), record=record)
            for i, step in enumerate(routed):
                for layer, experts in step.items():
                    executed = np.array(record[layer][0][0, first + i])
                    assert sorted(executed.tolist()) == experts, (
                        f"layer {layer}, decoded position {i}, prompt {prompt}"
                    )
            np.testing.assert_allclose(np.array(ours[0, first:]), logits, atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


def test_student_batches_rows_with_their_own_gate_prefix(profiled):
    student = load_student(profiled("bailing_moe"), k=2, lora=LoRAInit())
    tokens = mx.array(np.random.default_rng(1).integers(0, 1000, size=(2, 12)))
    both = student(tokens, mx.array([1, 5]))
    for row, prefix in enumerate((1, 5)):
        alone = student(tokens[row : row + 1], prefix)
        np.testing.assert_allclose(np.array(both[row]), np.array(alone[0]), atol=1e-5)
    with pytest.raises(Edge0Error, match="at least 1"):
        student(tokens, 0)


# -- phase 3's loss -------------------------------------------------------------------------------


def test_topk_reverse_kl_with_a_tail_bucket():
    rng = np.random.default_rng(0)
    student, teacher = rng.normal(size=(2, 3, 10)), rng.normal(size=(2, 3, 10)) * 2
    kl = np.array(topk_reverse_kl(mx.array(student), mx.array(teacher), 4))

    def log_softmax(x):
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ls, lt = log_softmax(student), log_softmax(teacher)
    top = np.argsort(-lt, axis=-1)[..., :4]
    for i in np.ndindex(2, 3):
        rest = np.setdiff1d(np.arange(10), top[i])
        ps = np.append(np.exp(ls[i][top[i]]), np.exp(ls[i][rest]).sum())  # 4 tokens + the bucket
        pt = np.append(np.exp(lt[i][top[i]]), np.exp(lt[i][rest]).sum())
        assert kl[i] == pytest.approx((ps * np.log(ps / pt)).sum(), rel=1e-4)
    assert np.all(kl >= 0)
    same = topk_reverse_kl(mx.array(teacher), mx.array(teacher), 4)
    assert np.abs(np.array(same)).max() < 1e-6
    # With k = V - 1 the bucket is one token: the full reverse KL.
    full = (np.exp(ls) * (ls - lt)).sum(-1)
    np.testing.assert_allclose(
        np.array(topk_reverse_kl(mx.array(student), mx.array(teacher), 9)), full, rtol=1e-4
    )


def test_forward_kl_is_cross_entropy_against_the_teacher_less_its_entropy():
    rng = np.random.default_rng(1)
    student, teacher = rng.normal(size=(2, 3, 10)), rng.normal(size=(2, 3, 10)) * 2
    kl = np.array(forward_kl(mx.array(teacher), mx.array(student)))
    ls = student - np.log(np.exp(student).sum(-1, keepdims=True))
    lt = teacher - np.log(np.exp(teacher).sum(-1, keepdims=True))
    np.testing.assert_allclose(kl, (np.exp(lt) * (lt - ls)).sum(-1), rtol=1e-4)
    assert np.all(kl > 0)
    assert np.abs(np.array(forward_kl(mx.array(teacher), mx.array(teacher)))).max() < 1e-6


# -- phases 2 and 3 on a tiny model --------------------------------------------------------------


def test_synthetic_teacher_is_what_the_checkpoint_quantized(checkpoint_dir, tmp_path):
    teacher_dir = write_synthetic_teacher(tmp_path / "teacher", "qwen3_moe", "tiny")
    student = load_student(checkpoint_dir("qwen3_moe"), heads=False)
    teacher = load_teacher(teacher_dir, student)
    config = dict(student.loaded.config)
    with contextlib.redirect_stdout(io.StringIO()):
        quantized, _ = quantize_model(teacher, config, group_size=64, bits=4)
    ours = dict(tree_flatten(quantized.parameters()))
    checkpoint = mx.load(str(checkpoint_dir("qwen3_moe") / "model.safetensors"))
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.2.mlp.switch_mlp.up_proj.weight",
    ):
        assert mx.array_equal(ours[name], checkpoint[name])


def plant_attention_delta(teacher_dir: Path, rank: int = 2, size: float = 1.0) -> None:
    """Add a random rank-`rank` delta, `size` times the weight's norm, to every attention output
    projection of the teacher: a gap between base and teacher that a LoRA can close. (The random
    synthetic model's own quantization gap is mostly noise no LoRA can fit in a few steps.)"""
    path = teacher_dir / "model.safetensors"
    weights = mx.load(str(path))
    rng = np.random.default_rng(7)
    for name, w in weights.items():
        if name.endswith("self_attn.o_proj.weight"):
            out_dim, in_dim = w.shape
            delta = rng.normal(size=(out_dim, rank)) @ rng.normal(size=(rank, in_dim))
            delta *= size * np.linalg.norm(np.array(w.astype(mx.float32))) / np.linalg.norm(delta)
            weights[name] = (w.astype(mx.float32) + mx.array(delta, mx.float32)).astype(w.dtype)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


@pytest.fixture(scope="module")
def phase2(profiled, tmp_path_factory):
    """Phase 2 on the tiny qwen3_moe model (random K=2 heads) with its float teacher, whose
    attention outputs carry a planted low-rank delta."""
    root = tmp_path_factory.mktemp("phase2")
    model_dir = profiled("qwen3_moe")
    teacher = write_synthetic_teacher(root / "teacher", "qwen3_moe", "tiny")
    plant_attention_delta(teacher)
    config = TrainLoRAConfig(
        k=2,
        rows=28,
        prompt_tokens=8,
        gen_tokens=24,
        gen_batch=14,
        holdout_rows=4,
        max_corpus_tokens=4000,
        r=8,
        steps=12,
        batch=4,
        lr=1e-3,
        checkpoint_every=6,
        log_every=3,
    )
    lines = []
    out, history = train_lora(
        model_dir, teacher, TEXT, config, out_dir=root / "run", log=lines.append
    )
    print("\n" + "\n".join(lines))
    (root / "log.txt").write_text("\n".join(lines))
    return model_dir, teacher, config, out, history, root


def test_writing_the_teacher_rows_says_how_far_it_is_and_what_is_left(phase2):
    """28 rows sampled 14 at a time: after the first 14, what the other 14 will take."""
    lines = (phase2[-1] / "log.txt").read_text().splitlines()
    first = [line for line in lines if line.startswith("the first teacher rows: 14 rows in")]
    assert len(first) == 1 and "the 14 rows left take about" in first[0], lines
    assert any(line.startswith("teacher rows: 28 of 28 rows (100%") for line in lines), lines


def test_a_second_run_into_the_same_folder_is_refused_naming_the_first(profiled, tmp_path):
    """The first run holds the folder's lock (here this process); the second is refused before
    any row is written, and the folder is free again once the first has ended."""
    config = TrainLoRAConfig(k=2, rows=8, holdout_rows=2, prompt_tokens=4, gen_tokens=4, steps=1)
    with RunLock(tmp_path / "run", "the first run"):
        with pytest.raises(Edge0Error, match=rf"in use by another run \(pid {os.getpid()}, "):
            train_lora(
                profiled("qwen3_moe"),
                None,
                TEXT,
                config,
                out=tmp_path / "lora.safetensors",
                out_dir=tmp_path / "run",
                rows_path=tmp_path / "rows.npz",
                log=lambda _: None,
            )
    assert not (tmp_path / "rows.npz").exists() and not (tmp_path / "lora.safetensors").exists()
    with RunLock(tmp_path / "run"):
        pass


def test_a_lock_that_is_not_a_file_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / RunLock.NAME)  # an open for reading and writing would wait forever
    with pytest.raises(Edge0Error, match=r"lock: not a regular file"):
        with RunLock(tmp_path):
            pass


HOLD_THE_LOCK = """
import sys
from engine.train.run import RunLock
with RunLock(sys.argv[1], "a run in a child"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_the_lock_is_the_process_s_and_goes_with_it(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert child.stdout.readline() == "held\n"
        with pytest.raises(Edge0Error, match=rf"pid {child.pid}, started .*a run in a child"):
            RunLock(tmp_path).__enter__()
    finally:
        child.kill()  # killed, not ended: the OS releases its lock all the same
        child.wait(timeout=60)
    with RunLock(tmp_path):
        pass


def test_sft_lowers_its_loss_and_serves(phase2):
    """The KL to the teacher over the training rows falls; the engine serves the written LoRA."""
    model_dir, teacher_dir, config, out, _, _ = phase2
    rows = np.load(model_dir / "train" / "teacher_rows.npz")
    tokens = np.concatenate([rows["prompts"], rows["continuations"]], axis=1)
    train = mx.array(tokens[config.holdout_rows :, :-1])
    p = config.prompt_tokens

    base = load_student(model_dir, config.k, heads=True)
    teacher_logits = load_teacher(teacher_dir, base)(train)[:, p - 1 :]

    def kl(student) -> float:
        logits = student(train, gate_prefix=p - 1)[:, p - 1 :]
        return forward_kl(teacher_logits, logits).mean().item()

    before = kl(base)
    after = kl(load_student(model_dir, config.k, heads=True, lora=out))
    assert after < 0.95 * before, (before, after)
    assert out == model_dir / "lora_k2.safetensors"
    engine = Engine(model_dir, EngineConfig(mode="prerouter", k=2))
    try:
        assert engine.lora is not None and engine.lora.adapter.r == 8
        assert any(mx.abs(b).max().item() > 0 for _, b in engine.lora.adapter.weights.values())
        summary = engine.generate([3, 4, 5], GenerationConfig(max_tokens=8)).summary
        assert summary["dropped"] == 0
    finally:
        engine.close()


def test_sft_on_kept_top_k_teacher_targets_lowers_its_loss(phase2):
    """teacher_top_k: the teacher's top-k tokens per position computed once, kept beside the
    rows (the same cached rows) and trained on; a second run reuses them."""
    model_dir, teacher, config, _, _, root = phase2
    top_k = TrainLoRAConfig(**{**config.__dict__, "teacher_top_k": 64})
    lines: list[str] = []
    _, own = train_lora(
        model_dir,
        teacher,
        TEXT,
        top_k,
        out=root / "top-k.safetensors",
        out_dir=root / "top-k",
        log=lines.append,
    )
    assert any("teacher targets: the top 64 tokens of 28 x 24 positions" in line for line in lines)
    assert (model_dir / "train" / "teacher_rows.targets" / "teacher_ids.npy").is_file()
    heldout = [e["heldout"] for e in own if "heldout" in e]
    assert heldout[-1] < 0.95 * heldout[0], heldout
    lines.clear()
    train_lora(
        model_dir,
        teacher,
        TEXT,
        TrainLoRAConfig(**{**top_k.__dict__, "steps": 1}),
        out=root / "top-k-again.safetensors",
        out_dir=root / "top-k-again",
        log=lines.append,
    )
    assert not any("teacher targets:" in line for line in lines)  # kept: not made again


def test_sft_on_the_sampled_tokens_lowers_its_loss(phase2):
    """targets="tokens": plain cross-entropy on the teacher's samples (the same cached rows)."""
    model_dir, teacher, config, _, history, root = phase2
    tokens = TrainLoRAConfig(**{**config.__dict__, "targets": "tokens"})
    _, own = train_lora(
        model_dir,
        teacher,
        TEXT,
        tokens,
        out=root / "tokens.safetensors",
        out_dir=root / "tokens",
        log=lambda _: None,
    )
    losses = [e["loss"] for e in own if "loss" in e]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
    # A cross-entropy, not a KL: it includes the teacher's own entropy, so it is far above.
    assert own[0]["heldout"] > history[0]["heldout"] + 1.0


def test_sft_resumes_where_it_stopped(phase2):
    """Half the steps, then a rerun to the end: the same LoRA as one uninterrupted run. The rerun
    may save and log at other intervals (`--checkpoint-every`): that changes no step."""
    model_dir, teacher, config, out, _, root = phase2
    config_half = TrainLoRAConfig(**{**config.__dict__, "steps": 6})
    # The rows are cached in MODEL/train, shared with the first run: not sampled again.
    rows = model_dir / "train" / "teacher_rows.npz"
    written = rows.stat().st_mtime_ns
    halfway = root / "halfway.safetensors"
    train_lora(
        model_dir,
        teacher,
        TEXT,
        config_half,
        out=halfway,
        out_dir=root / "resumed",
        log=lambda _: None,
    )
    lines = []
    resumed, _ = train_lora(
        model_dir,
        teacher,
        TEXT,
        TrainLoRAConfig(**{**config.__dict__, "checkpoint_every": 5, "log_every": 3}),
        out=root / "resumed.safetensors",
        out_dir=root / "resumed",
        log=lines.append,
    )
    assert any("resuming" in line for line in lines)
    assert rows.stat().st_mtime_ns == written
    straight, again = mx.load(str(out)), mx.load(str(resumed))
    assert straight.keys() == again.keys()
    assert all(mx.array_equal(straight[n], again[n]) for n in straight)


def test_distill_lowers_the_heldout_reverse_kl(phase2):
    model_dir, teacher, _, _, _, root = phase2
    config = TrainDistillConfig(
        k=2,
        steps=12,
        prompts_per_step=4,
        prompt_tokens=8,
        gen_tokens=12,
        heldout_prompts=3,
        kl_top_k=64,
        max_corpus_tokens=4000,
        lr=1e-4,
        checkpoint_every=4,
        log_every=2,
    )
    lines = []
    out, history = train_distill(
        model_dir,
        teacher,
        TEXT,
        config,
        out=root / "distilled.safetensors",
        out_dir=root / "distill",
        log=lines.append,
    )
    print("\n" + "\n".join(lines))
    heldout = [e["heldout"] for e in history if "heldout" in e]
    assert len(heldout) == 4 and max(heldout[1:]) < heldout[0], heldout
    assert all(e["loss"] >= 0 for e in history if "loss" in e)
    assert out.exists()


def test_rollouts_follow_the_lora_as_it_trains(phase2):
    """After `serve_lora` the rollout engine samples what a fresh engine with that LoRA samples,
    also for a prompt it has just run (no KV cache of the old LoRA is reused)."""
    model_dir, _, config, out, _, root = phase2
    student = load_student(model_dir, config.k, heads=True, lora=out)
    for module in student.lora_modules().values():
        module.lora_b = module.lora_b * 3.0  # another LoRA
    served = root / "served" / "model"
    shutil.copytree(model_dir, served, ignore=shutil.ignore_patterns("train", "lora_k*"))
    student.save_lora(served / "lora_k2.safetensors")
    prompt, greedy = [3, 4, 5, 6, 7, 8], GenerationConfig(max_tokens=12)
    engine = rollout_engine(model_dir, TrainDistillConfig(k=config.k))
    fresh = Engine(served, EngineConfig(mode="prerouter", k=config.k))
    try:
        before = engine.generate(prompt, greedy).tokens
        serve_lora(engine, student)
        after, expected = (
            engine.generate(prompt, greedy).tokens,
            fresh.generate(prompt, greedy).tokens,
        )
        assert after == expected and after != before
    finally:
        engine.close()
        fresh.close()


def test_cli_wires_the_training_phases(monkeypatch, tmp_path):
    import engine.train.distill
    import engine.train.lora

    calls = []
    monkeypatch.setattr(engine.train.lora, "train_lora", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(
        engine.train.distill, "train_distill", lambda *a, **kw: calls.append((a, kw))
    )
    text = tmp_path / "text.txt"
    text.write_text("some text")
    model = str(tmp_path / "M")  # a folder: MODEL is resolved before the command runs
    (tmp_path / "M").mkdir()
    common = ["--k", "4", "--teacher", "T", "--text", str(text), "--steps", "7"]
    assert main(["train", "lora", model, *common, "--generate", "64", "--lr", "1e-3"]) == 0
    assert main(["train", "distill", model, *common, "--out-dir", "D", "--batch", "5"]) == 0
    assert main(["train", "lora", model, *common, "--continuation-tokens", "24"]) == 0
    assert main(["train", "distill", model, *common, "--continuation-tokens", "8"]) == 0
    assert main(["train", "lora", model, *common, "--checkpoint-every", "5"]) == 0
    (lora_args, lora_kw), (distill_args, distill_kw), (short_lora, _), (short_distill, _) = calls[
        :4
    ]
    assert short_lora[3].gen_tokens == 24 and short_distill[3].gen_tokens == 8
    assert calls[4][0][3].checkpoint_every == 5
    # Without the option each phase keeps its config's default (the help names them).
    assert lora_args[3].gen_tokens == engine.train.lora.TrainLoRAConfig.gen_tokens
    assert distill_args[3].gen_tokens == engine.train.distill.TrainDistillConfig.gen_tokens
    for phase, config in (("lora", lora_args[3]), ("distill", distill_args[3])):
        help_text = " ".join(_help(["train", phase]).split())
        assert f"default {config.gen_tokens}." in help_text
        assert f"every N steps; default {config.checkpoint_every}." in help_text
    assert lora_args[3].k == 4 and lora_args[3].rows == 64 and lora_args[3].steps == 7
    assert lora_args[3].lr == 1e-3 and lora_kw["rows_path"] is None
    assert distill_args[3].prompts_per_step == 5
    assert str(lora_args[1]) == "T" and lora_args[2] == "some text"
    assert distill_args[3].steps == 7 and str(distill_kw["out_dir"]) == "D"
    assert main(["train", "lora", model, *common[:4], "--text", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as bad:  # argparse's own errors exit
        main(["train", "lora", model, *common, "--continuation-tokens", "0"])
    assert bad.value.code == 2


def _help(argv: list[str]) -> str:
    """The --help text of an `edge0` subcommand."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def test_the_teacher_rows_key_names_the_weights_not_the_adapters_beside_them(
    tmp_path, checkpoint_dir
):
    """Training K=4 writes lora_k4.safetensors beside the checkpoint that teaches itself: the rows
    it generated (shared by every K) must still be its rows, and a changed shard must not."""
    from engine.train.lora import _teacher_digest

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe", "tiny"), model_dir)
    before = _teacher_digest(model_dir, itself=True)
    write_random_profile(model_dir, 2)
    (model_dir / "lora_k4.safetensors").write_bytes(b"\0" * 64)
    assert _teacher_digest(model_dir, itself=True) == before
    assert _teacher_digest(model_dir, itself=False) != before
    shard = sorted(model_dir.glob("model*.safetensors"))[0]
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)  # another size: other weights
    assert _teacher_digest(model_dir, itself=True) != before


def test_sft_on_the_texts_own_continuations_lowers_its_loss(phase2):
    """continuations="text": the rows are the corpus's own windows (nothing sampled, no rows
    cache written), the teacher's distribution on them the target; its KL falls as well."""
    from engine.train.data import corpus_tokens
    from engine.train.lora import text_rows

    model_dir, teacher, config, _, _, root = phase2
    text = TrainLoRAConfig(**{**config.__dict__, "continuations": "text"})
    student = load_student(model_dir, config.k, heads=True)
    corpus = corpus_tokens(student.tokenizer, TEXT, config.max_corpus_tokens)
    prompts, continuations = text_rows(corpus, text)
    assert prompts.shape == (text.rows, text.prompt_tokens)
    assert continuations.shape == (text.rows, text.gen_tokens)
    joined = corpus.tobytes()
    for row in np.concatenate([prompts, continuations], axis=1).astype(corpus.dtype):
        assert row.tobytes() in joined  # a window of the text, as it is
    lines: list[str] = []
    out, history = train_lora(
        model_dir,
        teacher,
        TEXT,
        text,
        out=root / "text" / "lora_k2.safetensors",
        out_dir=root / "text" / "run",
        rows_path=root / "text" / "unused_rows.npz",
        log=lines.append,
    )
    assert any("rows of the text itself" in line for line in lines), lines
    assert not (root / "text" / "unused_rows.npz").exists()
    held = [e["heldout"] for e in history if "heldout" in e]
    assert held[-1] < 0.95 * held[0], held


# -- a step the memory plan holds ---------------------------------------------------------------


def _plan_in(monkeypatch, limit: int) -> None:
    """Plans made against `limit`, with a runtime term that does not move between loads."""
    import engine.runtime.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "process_rss_bytes", lambda: 64 << 20)
    monkeypatch.setattr(memory_plan, "memory_limit", lambda: (limit, "a test limit"))


def test_the_default_batch_is_the_most_rows_the_plan_holds(profiled, monkeypatch):
    """Where 8 rows a step do not fit the plan, the streamed student takes the most that do
    (3 here, by a limit half a row above them) and says so; a step of 8 asked for is refused,
    naming every knob that would make it fit."""
    from engine.runtime.loader import load, read_config
    from engine.runtime.memory_plan import PlanRefused
    from engine.train.lora import fitted
    from engine.train.streamed_student import streaming_config
    from engine.train.student import Step, step_room

    model_dir = profiled("qwen3_moe")
    model_config = read_config(model_dir)
    asked = Step(8, 31, fit_rows=True, fit_top_k=True, prompt=8, top_k_option=True)
    # What the plan holds beside a step, found from a refusal at a limit nothing fits.
    _plan_in(monkeypatch, 1 << 20)
    auto = EngineConfig(expert_cache_auto=True)  # the CLI's --expert-cache auto
    config = streaming_config(auto)
    with pytest.raises(PlanRefused) as refused:
        load(model_dir, replace(config, context_tokens=asked.length))
    others = (1 << 20) - step_room(refused.value, True)
    held = [replace(asked, rows=n).held(model_config, 2) for n in (3, 4)]
    _plan_in(monkeypatch, others + held[0] + (held[1] - held[0]) // 2)

    student = load_student(model_dir, 2, True, LoRAInit(), auto, 0, True, step=asked)
    assert student.planned_step == replace(asked, rows=3) and student.loaded.memory_plan.fits
    lines: list[str] = []
    chosen = fitted(
        TrainLoRAConfig(k=2, prompt_tokens=8, gen_tokens=24), asked, student, lines.append
    )
    assert chosen.batch == 3 and chosen.teacher_top_k == 0
    assert lines[0].startswith("batch 3: the most rows a step (of 8) that the memory plan holds")

    fixed = replace(asked, fit_rows=False, fit_top_k=False)
    cache = EngineConfig(expert_cache_bytes=int(student.loaded.memory_plan.expert_cache_bytes))
    with pytest.raises(Edge0Error) as refusal:
        load_student(model_dir, 2, True, LoRAInit(), cache, 0, True, step=fixed)
    message = str(refusal.value)
    assert message.startswith(f"{model_dir}: the memory plan needs ")
    for knob in ("--batch 3;", "--continuation-tokens ", "--teacher-top-k 64 at --batch "):
        assert knob in message, message
    assert "more memory" in message and "\n" not in message


def test_where_no_rows_fit_the_teacher_s_top_tokens_are_kept():
    """The step's fit, on figures alone: the most rows with the teacher's whole distribution;
    where not even one row fits with it, its top 64 tokens kept on disk at the most rows."""
    from engine.train.student import Step, fitting_step

    model_config = {
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "vocab_size": 50_000,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    asked = Step(8, 100, fit_rows=True, fit_top_k=True)
    held = {n: replace(asked, rows=n).held(model_config, 2) for n in range(1, 9)}
    assert fitting_step(asked, held[5], model_config, 2) == replace(asked, rows=5)
    assert fitting_step(asked, held[5] - 1, model_config, 2) == replace(asked, rows=4)
    kept = fitting_step(asked, held[1] - 1, model_config, 2)
    assert kept is not None and kept.kept_top_k == 64 and kept.rows >= 1
    assert fitting_step(replace(asked, fit_top_k=False), held[1] - 1, model_config, 2) is None
    assert fitting_step(replace(asked, fit_rows=False), held[5], model_config, 2) is None


def test_a_run_keeps_the_checkpoint_with_the_lowest_heldout_loss(tmp_path):
    """Issue 48 item 6: training that overshoots what the held-out text wants ends on the weights
    of its best checkpoint, and says so; the best is remembered across a resume."""
    import mlx.nn as nn

    from engine.train.run import TrainingRun

    @dataclass
    class Config:
        lr: float = 0.03
        weight_decay: float = 0.0
        grad_clip: float = 10.0
        log_every: int = 1
        checkpoint_every: int = 1
        steps: int = 4

    class Trainee:
        fingerprint = "f" * 16

        def __init__(self) -> None:
            self.model = nn.Linear(1, 1, bias=False)
            self.model.weight = mx.zeros((1, 1))

        def value_and_grad(self, loss_fn):
            return nn.value_and_grad(self.model, loss_fn)

    def weight(trainee) -> float:
        return trainee.model.weight.item()

    def train(trainee, config, lines, weights):
        # Training pulls the weight to 1; the held-out text wants 0.3: passed on the way.
        run = TrainingRun(
            tmp_path / "run", trainee, config, lambda: ((trainee.model.weight - 1) ** 2).sum(),
            lambda: abs(weight(trainee) - 0.3), lines.append, keep_best=True,
        )  # fmt: skip
        for step in range(run.done + 1, config.steps + 1):
            run.step(step, tokens=1)
            weights[step] = weight(trainee)
        run.finish()

    weights: dict[int, float] = {}
    first, lines = Trainee(), []
    train(first, Config(), lines, weights)
    best = min(weights, key=lambda s: abs(weights[s] - 0.3))
    assert 1 < best < 4 and weight(first) == weights[best], weights
    assert any(f"keeping step {best}'s weights" in line for line in lines), lines
    # Every step line but the last says what the steps left will take.
    steps = [line for line in lines if line.startswith("step ")]
    assert ["left)" in line for line in steps] == [True, True, True, False], steps
    # Resumed for 4 more steps (from the checkpoint of step 4, not the weights taken back):
    # the best is still step `best`'s.
    resumed, more = Trainee(), []
    train(resumed, Config(steps=8), more, weights)
    assert weight(resumed) == pytest.approx(weights[best]), weights
    assert any(f"keeping step {best}'s weights" in line for line in more), more

"""Bring your own model, the rest of it: phases 2 and 3 without a float teacher (the checkpoint
teaches as itself), profiles in an adapter folder outside the checkpoint for every command that
reads them (train lora, eval, bench), and a student too big for the machine refused up front."""

from __future__ import annotations

import json
import pydoc_data.topics
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from adapters import write_random_profile
from mlx.utils import tree_flatten

import engine.train.student
from edge0_tui.cli import main
from engine.config import EngineConfig
from engine.errors import Edge0Error
from engine.measure.bench import BenchConfig, run_bench
from engine.runtime.generation import Engine
from engine.train.lora import TrainLoRAConfig, forward_kl, train_lora
from engine.train.student import dequantized_bytes, load_student
from engine.train.teacher import CheckpointTeacher, load_teacher

TEXT = "\n\n".join(pydoc_data.topics.topics.values())[:40_000]


@pytest.fixture
def outside(checkpoint_dir, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(model, adapters): a tiny checkpoint with no profile of its own, and a folder beside it
    holding a random K=2 profile made for it (as `edge0 train heads --adapters DIR` leaves)."""
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    monkeypatch.setenv("EDGE0_DATA_DIR", str(tmp_path / "data"))
    write_random_profile(model_dir, 2, lora_scale=0.5)
    folder = tmp_path / "adapters"
    folder.mkdir()
    for name in ("prerouter_k2.safetensors", "lora_k2.safetensors"):
        shutil.move(model_dir / name, folder / name)
    return model_dir, folder


def test_the_checkpoint_as_teacher_is_the_4bit_model_with_its_own_routers(outside):
    """Without a float model, the teacher is the served checkpoint itself: every layer routed by
    its own router at the native K, no LoRA, no predictions; the student is left as it was."""
    model_dir, folder = outside
    config = EngineConfig(adapter_dirs=(folder,))
    student = load_student(model_dir, 2, True, folder / "lora_k2.safetensors", config)
    tokens = mx.array(np.random.default_rng(0).integers(0, 1000, size=(2, 24)))
    before = np.array(student(tokens, gate_prefix=4))
    teacher = load_teacher(None, student)
    assert isinstance(teacher, CheckpointTeacher)
    taught = np.array(teacher(tokens))
    with Engine(model_dir, EngineConfig(mode="resident")) as resident:
        served = np.array(resident.model(tokens))
    scale = max(1.0, np.abs(served).max())
    assert np.abs(taught - served).max() <= 1e-4 * scale  # the student's float twin of int4
    # The student (K=2, predictions, a LoRA of scale 0.5) is another function, and unchanged.
    assert np.abs(before - served).max() > 1e-2 * scale
    assert np.array_equal(np.array(student(tokens, gate_prefix=4)), before)


def test_train_lora_without_a_float_teacher_writes_beside_the_heads(outside):
    """`edge0 train lora MODEL --k 2 --adapters DIR` with no --teacher: rows are the checkpoint's
    own continuations, the KL to it falls, and the LoRA, rows and state go to DIR (the model
    folder may be read-only, like the Hugging Face cache)."""
    model_dir, folder = outside
    config = TrainLoRAConfig(
        k=2,
        rows=20,
        prompt_tokens=8,
        gen_tokens=16,
        gen_batch=10,
        holdout_rows=4,
        max_corpus_tokens=4000,
        r=8,
        steps=10,
        batch=4,
        lr=1e-3,
        checkpoint_every=5,
        log_every=5,
    )
    (folder / "lora_k2.safetensors").unlink()  # phase 2 starts from no LoRA
    model_dir.chmod(0o555)
    try:
        out, history = train_lora(
            model_dir,
            None,
            TEXT,
            config,
            log=lambda _: None,
            engine_config=EngineConfig(adapter_dirs=(folder,)),
        )
    finally:
        model_dir.chmod(0o755)
    assert out == folder / "lora_k2.safetensors"
    assert (folder / "train" / "teacher_rows.npz").exists()
    assert (folder / "train" / "lora_k2").is_dir()
    assert all(np.isfinite(e["loss"]) for e in history if "loss" in e)

    # The KL to the checkpoint over the training rows falls: the LoRA learns the int4 model.
    rows = np.load(folder / "train" / "teacher_rows.npz")
    tokens = np.concatenate([rows["prompts"], rows["continuations"]], axis=1)
    train = mx.array(tokens[config.holdout_rows :, :-1])
    p = config.prompt_tokens
    engine_config = EngineConfig(adapter_dirs=(folder,))

    def kl(lora) -> float:
        student = load_student(model_dir, 2, True, lora, engine_config)
        teacher = student.base_logits(train)[:, p - 1 :]
        return forward_kl(teacher, student(train, gate_prefix=p - 1)[:, p - 1 :]).mean().item()

    before, after = kl(None), kl(out)
    assert after < 0.95 * before, (before, after)


def test_dequantized_size_is_what_the_student_holds(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3_moe")
    student = load_student(model_dir, heads=False)
    held = sum(a.nbytes for _, a in tree_flatten(student.model.parameters()))
    estimate = dequantized_bytes(model_dir, 4)
    assert 0.95 * held <= estimate <= 1.05 * held, (estimate, held)


def test_a_student_too_big_for_memory_is_streamed_or_refused_up_front(outside, monkeypatch, capsys):
    model_dir, folder = outside
    need = dequantized_bytes(model_dir, 4)
    monkeypatch.setattr(engine.train.student, "available_memory_bytes", lambda: need // 2)
    config = EngineConfig(adapter_dirs=(folder,))
    # Where the dequantized base does not fit, the student streams its experts.
    assert load_student(model_dir, 2, True, None, config).streamed
    # An in-memory student asked for is refused before anything is read.
    loads = []
    monkeypatch.setattr(engine.train.student, "load", lambda *a: loads.append(a))
    with pytest.raises(Edge0Error, match="training the LoRA needs about .* is available"):
        load_student(model_dir, 2, True, None, config, streamed=False)
    assert not loads
    text = model_dir.parent / "text.txt"
    text.write_text(TEXT)
    args = ["train", "lora", str(model_dir), "--k", "2", "--text", str(text)]
    assert main([*args, "--adapters", str(folder), "--student", "memory"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(model_dir) in err and "phase 1" in err


def test_eval_and_bench_find_profiles_in_an_adapter_folder(outside, tmp_path, capsys):
    model_dir, folder = outside
    text = tmp_path / "heldout.txt"
    text.write_text(TEXT[-8000:])
    args = ["eval", str(model_dir), "--text", str(text), "--max-tokens", "128", "--samples", "1"]
    assert main([*args, "--adapters", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "prerouter" and report["k"] == 2
    assert report["heads"] == "prerouter_k2.safetensors" and report["lora_applied"]
    assert main([*args, "--json"]) == 0  # without it: no heads, on-demand
    assert json.loads(capsys.readouterr().out)["mode"] == "on-demand"

    config = BenchConfig(
        model=model_dir, arms=["prerouter"], k=2, rounds=1, tokens=4, adapter_dirs=(folder,)
    )
    report = run_bench(config, progress=lambda _: None)
    (run,) = report["runs"]
    assert run["ok"], run["error"]
    assert run["summary"]["k"] == 2 and run["summary"]["median_predicted"] > 0


def test_memory_available_to_training_is_the_cgroup_room_beside_its_working_set(tmp_path):
    """What the student check compares with: MemAvailable, lowered to the tightest cgroup limit
    less the cgroup's working set. Page cache the cgroup can drop does not count as used (a
    3 GiB group filled with a checkpoint's pages still has room)."""
    from engine.runtime.linux_memory import available_memory_bytes

    gib = 1 << 30
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 10485760 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job\n")
    assert available_memory_bytes(proc, root) == 10 * gib  # no cgroup limit: MemAvailable
    (root / "job").mkdir(parents=True)
    (root / "memory.max").write_text(f"{3 * gib}\n")  # the limit on an ancestor
    (root / "memory.current").write_text(f"{3 * gib}\n")
    (root / "memory.stat").write_text(f"anon {gib}\ninactive_file {2 * gib}\n")
    (root / "job" / "memory.max").write_text("max\n")
    assert available_memory_bytes(proc, root) == 2 * gib

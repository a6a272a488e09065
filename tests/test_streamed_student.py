"""The streamed student (engine/train/streamed_student.py): phases 2 and 3 with the routed experts
packed and read through a small expert cache give the in-memory (dequantized) student's losses
and LoRA gradients, for families with and without shared experts, linear attention and
pre-scaled expert inputs, routed by the heads' predictions."""

from __future__ import annotations

import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from adapters import profile_k, write_random_profile
from mlx.utils import tree_flatten

from engine.config import EngineConfig
from engine.train.data import masked_mean
from engine.train.lora import TrainLoRAConfig, forward_kl, train_lora
from engine.train.streamed_student import LayerwiseGrad, TrainableExperts
from engine.train.student import LoRAInit, load_student
from engine.train.synth import FAMILIES

# float32 on the CPU; the 4-bit kernels and the dequantized matmuls sum in other orders.
RELATIVE_TOLERANCE = 1e-4
# Small enough that no layer's experts fit at once: the forward and the backward go through the
# cache in several bankfuls (checked below).
EXPERT_CACHE_BYTES = 40_000


def _loss_and_lora_grads(student, tokens: mx.array, gate_prefix: int, layerwise: bool = False):
    """Phase 2's loss (KL to the checkpoint's own routing at native K) and its LoRA gradients:
    the student's own way (autograd in memory, a layer at a time streamed), or a layer at a time
    whatever the student (`layerwise`)."""
    teacher = student.base_logits(tokens)

    def loss(batch, target):
        logits = student(batch, gate_prefix)
        return masked_mean(forward_kl(target, logits), mx.ones(batch.shape))

    value_and_grad = LayerwiseGrad(student, loss) if layerwise else student.value_and_grad(loss)
    value, grads = value_and_grad(tokens, teacher)
    mx.eval(value, grads)
    return value.item(), {name: np.array(g) for name, g in tree_flatten(grads)}


def _student(model_dir, k, streamed: bool):
    student = load_student(
        model_dir,
        k,
        heads=True,
        lora=LoRAInit(seed=1),
        engine_config=EngineConfig(expert_cache_bytes=EXPERT_CACHE_BYTES),
        streamed=streamed,
    )
    # B starts at zero (the base); a non-zero B gives A a gradient too.
    for index, module in enumerate(student.lora_modules().values()):
        module.lora_b = 0.02 * mx.random.normal(module.lora_b.shape, key=mx.random.key(index))
    return student


# Every family on the 4-bit kernels; the dense products (the same code for every family) on three.
CASES = [(family, "4-bit") for family in FAMILIES] + [
    (family, "dense") for family in ("qwen3_moe", "gpt_oss", "deepseek_v3")
]


@pytest.mark.parametrize(("family", "kernels"), CASES)
def test_streamed_student_has_the_in_memory_losses_and_gradients(
    checkpoint_dir, tmp_path, family, kernels
):
    model_dir = tmp_path / family
    shutil.copytree(checkpoint_dir(family), model_dir)
    k = profile_k(family, 2)
    write_random_profile(model_dir, k)
    tokens = mx.array(np.random.default_rng(0).integers(0, 500, size=(2, 24)))

    in_memory = _student(model_dir, k, streamed=False)
    assert not in_memory.streamed
    expected_loss, expected = _loss_and_lora_grads(in_memory, tokens, gate_prefix=8)
    # The layer-at-a-time gradient on the same (in-memory) student: autograd's.
    _check_equal(
        _loss_and_lora_grads(in_memory, tokens, 8, layerwise=True), expected_loss, expected
    )
    del in_memory

    streamed = _student(model_dir, k, streamed=True)
    if kernels == "dense":  # as on a CPU with a fast BLAS (this process may have none)
        for site in streamed.loaded.sites:
            getattr(site.parent, site.attribute).switch._dense_rows = 1
    store = streamed.loaded.store
    assert streamed.streamed
    layer = streamed.loaded.sites[0].layer
    assert store.pool.capacity(layer) < store.index.layers[layer].num_experts  # bankfuls
    _check_equal(_loss_and_lora_grads(streamed, tokens, gate_prefix=8), expected_loss, expected)


def _check_equal(got, expected_loss: float, expected: dict) -> None:
    loss, grads = got
    assert loss > 0
    assert loss == pytest.approx(expected_loss, rel=RELATIVE_TOLERANCE)
    assert grads.keys() == expected.keys() and len(grads) > 0
    for name, grad in expected.items():
        scale = np.abs(grad).max()
        assert scale > 0, f"{name}: no gradient"
        assert np.abs(grads[name] - grad).max() <= RELATIVE_TOLERANCE * scale, name


def test_streamed_backward_reads_each_layers_experts_again_once(checkpoint_dir, tmp_path):
    # The backward keeps none of the forward's experts' weights: with a cache smaller than a
    # layer, it asks the cache for every expert the forward executed, once per layer, a bankful
    # at a time. It keeps their output: the layer computed again does not run them again.
    model_dir = tmp_path / "qwen3_moe"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)
    student = _student(model_dir, 2, streamed=True)
    store = student.loaded.store
    tokens = mx.array(np.random.default_rng(1).integers(0, 500, size=(2, 24)))
    executed: dict = {}
    fetched: dict[int, list[int]] = {}
    fetch = store.fetch

    def counting_fetch(layer: int, experts: list[int]):
        fetched.setdefault(layer, []).extend(experts)
        return fetch(layer, experts)

    logits = student(tokens, 8, record=executed)
    mx.eval(logits)

    store.fetch = counting_fetch
    # The layers' backward, a layer at a time (the forward's checkpoints taken first).
    _, grads = student.value_and_grad(lambda batch: student(batch, 8).sum())(tokens)
    mx.eval(grads)
    # Each layer's experts were asked for twice: by the checkpointing forward and by the layer's
    # backward (its input gradient), not by its recomputation (the forward's output kept).
    assert executed.keys() == fetched.keys()
    for layer, (inds, _, _) in executed.items():
        routed = np.unique(np.array(inds)).tolist()
        assert sorted(fetched[layer]) == sorted(routed * 2), layer
    assert all(
        m.kept.output is None for m in student.model.modules() if isinstance(m, TrainableExperts)
    )  # all taken: none left to be mistaken for a later forward's


KILLED_RUN = """
import sys, time
from pathlib import Path
from engine.config import EngineConfig
from engine.train.lora import TrainLoRAConfig, train_lora

def log(line):
    print(line, flush=True)
    if line.startswith("step 2/"):  # the step-2 checkpoint is written: wait to be killed
        time.sleep(120)

model, out, out_dir, rows, text = sys.argv[1:6]
config = TrainLoRAConfig(**eval(sys.argv[6]))
train_lora(model, None, Path(text).read_text(), config, out=Path(out), out_dir=Path(out_dir),
           log=log, rows_path=Path(rows), engine_config=EngineConfig(expert_cache_bytes=40_000),
           streamed=True)
"""


def test_a_killed_streamed_run_resumes_to_the_lora_of_one_that_never_stopped(
    checkpoint_dir, tmp_path
):
    model_dir = tmp_path / "qwen3_moe"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} and line {i}." for i in range(3000)))
    settings = dict(
        k=2,
        rows=24,
        holdout_rows=4,
        prompt_tokens=8,
        gen_tokens=16,
        gen_batch=8,
        steps=6,
        batch=4,
        r=4,
        checkpoint_every=2,
        log_every=1,
    )
    rows = tmp_path / "rows.npz"
    script = [
        sys.executable,
        "-c",
        KILLED_RUN,
        str(model_dir),
        str(tmp_path / "killed.safetensors"),
    ]
    script += [str(tmp_path / "run"), str(rows), str(text), repr(settings)]
    child = subprocess.Popen(script, stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if line.startswith("step 2/"):
                child.kill()  # SIGKILL, mid-run, after the step-2 checkpoint
                break
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -9
    assert not (tmp_path / "killed.safetensors").exists()

    config = TrainLoRAConfig(**settings)
    kwargs = dict(
        log=lambda _: None,
        rows_path=rows,
        engine_config=EngineConfig(expert_cache_bytes=40_000),
        streamed=True,
    )
    lines: list[str] = []
    resumed, _ = train_lora(
        model_dir,
        None,
        text.read_text(),
        config,
        out=tmp_path / "resumed.safetensors",
        out_dir=tmp_path / "run",
        **{**kwargs, "log": lines.append},
    )
    assert any("resuming" in line and "at step 2" in line for line in lines)
    straight, _ = train_lora(
        model_dir,
        None,
        text.read_text(),
        config,
        out=tmp_path / "straight.safetensors",
        out_dir=tmp_path / "straight",
        **kwargs,
    )
    one, other = mx.load(str(straight)), mx.load(str(resumed))
    assert one.keys() == other.keys()
    assert all(mx.array_equal(one[name], other[name]) for name in one)


def test_phase_3_on_the_streamed_student_takes_the_in_memory_steps(checkpoint_dir, tmp_path):
    from engine.train.distill import TrainDistillConfig, train_distill

    model_dir = tmp_path / "qwen3_moe"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)
    text = " ".join(f"word{i % 97} and line {i}." for i in range(3000))
    config = TrainDistillConfig(
        k=2, steps=3, prompts_per_step=4, prompt_tokens=8, gen_tokens=12, heldout_prompts=2,
        lr=1e-3, log_every=1,
    )  # fmt: skip
    histories = {}
    for streamed in (False, True):
        lines: list[str] = []
        out = tmp_path / f"distill-{streamed}.safetensors"
        _, histories[streamed] = train_distill(
            model_dir, None, text, config, out=out, out_dir=tmp_path / f"run-{streamed}",
            log=lines.append, engine_config=EngineConfig(expert_cache_bytes=40_000),
            streamed=streamed,
        )  # fmt: skip
        assert any(line.startswith("student: streamed" if streamed else "student: in memory")
                   for line in lines)  # fmt: skip
    # The same rollouts (the engine samples them, seeded by the step) and the same losses.
    memory, streamed = histories[False], histories[True]
    assert [e["step"] for e in memory] == [e["step"] for e in streamed]
    for a, b in zip(memory, streamed, strict=True):
        for key in ("loss", "heldout"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a, b)


def test_the_plan_holds_a_training_step_and_the_expert_cache_leaves_room_for_it(
    checkpoint_dir, tmp_path
):
    """The streamed student plans a step's layer inputs and logits beside the engine (with a
    context of one row), so an automatic expert cache is smaller by what they take: a 395 MiB
    wall in a 355 MiB cgroup was killed when they came on top of a cache sized without them."""
    from dataclasses import replace

    from engine.runtime.loader import read_config
    from engine.runtime.memory_plan import expert_cache_auto
    from engine.train.student import step_bytes

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, profile_k("qwen3_moe"))
    config = EngineConfig(expert_cache_auto=True)
    plain = load_student(model_dir, profile_k("qwen3_moe"), True, LoRAInit(), config, 0, True)
    planned = load_student(
        model_dir, profile_k("qwen3_moe"), True, LoRAInit(), config, 0, True, step=(8, 127)
    )
    held = sum(step_bytes(read_config(model_dir), 8, 127, profile_k("qwen3_moe")).values())
    before, after = plain.loaded.memory_plan, planned.loaded.memory_plan
    assert after.held_bytes == held > 0 and before.held_bytes == 0
    assert after.context_tokens == 127 and ("training step", held) in after.terms()
    # `--expert-cache auto` takes what the plan leaves (less the page cache's share): the step's
    # bytes are not left. (The tiny model's cache is all its experts either way.)
    limited = replace(after, limit_bytes=after.total_bytes + (64 << 20))
    unheld = replace(limited, held_bytes=0)
    assert expert_cache_auto(unheld) - expert_cache_auto(limited) == pytest.approx(
        0.75 * held, abs=1
    )
    assert "training step" not in planned.describe(8, 127)  # counted once, by its parts
    assert "logits" in planned.describe(8, 127)


def test_a_layers_backward_stays_within_the_plans_term(checkpoint_dir, tmp_path):
    """A layer's backward (its experts read again, one expert's input gradient at a time) holds
    no more MLX memory over what lies between layers than the plan's "layer backward" term, on
    experts wide enough for their work to dominate. Inside the layer's `mx.vjp` MLX keeps an
    evaluation's intermediates: computed there, one expert's gradient took 3x its weights."""
    from engine.runtime.loader import read_config
    from engine.train.student import step_bytes
    from engine.train.wall import pad_experts

    model_dir = tmp_path / "wide"
    pad_experts(checkpoint_dir("qwen3_moe"), model_dir, 8192)
    k = profile_k("qwen3_moe")
    write_random_profile(model_dir, k)
    rows, length = 2, 24
    student = load_student(
        model_dir, k, True, LoRAInit(seed=1), EngineConfig(), 0, True, step=(rows, length)
    )
    term = step_bytes(read_config(model_dir), rows, length, k)["layer backward"]
    tokens = mx.array(np.random.default_rng(0).integers(0, 500, size=(rows, length)))
    teacher = student.base_logits(tokens)
    mx.eval(teacher)
    excess = []
    original = LayerwiseGrad._layer_backward

    def measured(self, *args):
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        result = original(self, *args)
        mx.eval(result)
        excess.append(mx.get_peak_memory() - before)
        return result

    def loss(batch, target):
        return masked_mean(forward_kl(target, student(batch, 8)), mx.ones(batch.shape))

    LayerwiseGrad._layer_backward = measured
    try:
        value, grads = student.value_and_grad(loss)(tokens, teacher)
        mx.eval(value, grads)
    finally:
        LayerwiseGrad._layer_backward = original
    assert len(excess) == read_config(model_dir)["num_hidden_layers"]
    # The layer's forward again (a prefill of the step's tokens) and its backward's own work.
    bound = student.loaded.memory_plan.prefill_bytes + term
    assert 0 < max(excess) <= bound, (max(excess) / 2**20, bound / 2**20)

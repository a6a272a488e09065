"""The dense prefill path against today's kernels (`EngineConfig.exact_kernels`).

With a fast BLAS, a prefill chunk's routed experts with `DENSE_MIN_ROWS` or more rows are
dequantized and multiplied in fp32; the rest keep the 4-bit `gather_qmm`; the model's other 4-bit
projections (attention, shared experts, routers) do the same from `DENSE_MIN_ROWS` rows. The stated bound: on every
test model and family, resident and on-demand, the largest difference of a position's logits from
the exact path is at most 1e-4 of that position's largest logit (measured: ~1e-6), and the greedy
token at every position is the same. Decode (one token) never takes the dense path.

The test process preloads no BLAS, so the path is switched on here whatever BLAS MLX has: the
arithmetic is the same, only slower with the reference BLAS.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import engine.experts.switch_glu as switch_glu
import engine.runtime.loader as loader
from engine.config import EngineConfig, GenerationConfig
from engine.measure.evaluate import engine_logits
from engine.runtime.blas import dense_prefill_rows, prefill_kernels
from engine.runtime.generation import Engine

BOUND = 1e-4
LONG = [(i * 37 + 5) % 1000 + 3 for i in range(64)]  # most experts get 4+ rows, some fewer: mixed
# 5 tokens x K=4 in the chunk: fewer rows than the threshold for the average expert, so the chunk
# keeps the 4-bit kernels (`switch_glu.goes_dense`); the other projections still go dense.
SHORT = [11, 400, 97, 12, 5, 801]


@pytest.fixture
def dense_calls(monkeypatch):
    """The dense path on (unless exact), and a count of the experts that took it."""
    monkeypatch.setattr(
        loader,
        "dense_prefill_rows",
        lambda config: None if config.exact_kernels else switch_glu.DENSE_MIN_ROWS,
    )
    # The test models' experts are tiny: their cost-based row threshold would send few of them
    # dense (mxfp4's none, at 6 tokens). The arithmetic is what is tested here: the measured
    # minimum for every expert (the threshold itself: test_mxfp4_goes_dense_later_than_affine).
    monkeypatch.setattr(switch_glu, "_rows_worth_dequantizing", lambda specs: 0)
    calls = []
    original = switch_glu.dense_expert_glu

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(switch_glu, "dense_expert_glu", counted)
    return calls


def _logits(model_dir, tokens, **config) -> np.ndarray:
    with Engine(model_dir, EngineConfig(**config)) as engine:
        return np.array(engine_logits(engine, mx.array([tokens]))[0].astype(mx.float32))


# The dense path differs by expert format, not by family: the Qwen and Bailing layouts, affine with
# biases in the product (gpt-oss: mxfp4 experts with output biases), a group router (DeepSeek).
DENSE_FAMILIES = ("qwen3_moe", "qwen3_next", "bailing_moe", "gpt_oss", "deepseek_v3")


@pytest.mark.parametrize("mode", ["resident", "on-demand"])
@pytest.mark.parametrize("prompt", [LONG, SHORT], ids=["long", "short"])
@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_prefill_logits_within_the_bound(checkpoint_dir, family, mode, prompt, dense_calls):
    model = checkpoint_dir(family)
    exact = _logits(model, prompt, mode=mode, exact_kernels=True)
    assert dense_calls == []
    fast = _logits(model, prompt, mode=mode)
    if prompt is LONG:
        assert dense_calls, "no expert took the dense path"
    else:
        assert dense_calls == [], "a chunk with few rows an expert took the dense path"
    scale = np.abs(exact).max(axis=-1)
    relative = np.abs(fast - exact).max(axis=-1) / scale
    assert relative.max() <= BOUND, relative.max()
    assert (fast.argmax(-1) == exact.argmax(-1)).all()


def test_resident_and_on_demand_share_the_dense_path(checkpoint_dir, dense_calls):
    """The bench's A/B stays fair: resident prefill goes the same way as the streamed modes', so
    greedy output is token-identical between them on the fast path too."""
    model = checkpoint_dir("qwen3_moe")
    greedy = GenerationConfig(max_tokens=16, temperature=0.0)
    tokens = {}
    for mode in ("resident", "on-demand"):
        with Engine(model, EngineConfig(mode=mode, prefill_chunk=32)) as engine:
            if mode == "resident":
                site = engine.loaded.sites[0]
                switch = getattr(site.parent, site.attribute)
                assert isinstance(switch, switch_glu.DensePrefillSwitchGLU)
            tokens[mode] = engine.generate(LONG, greedy).tokens
    assert tokens["resident"] == tokens["on-demand"]
    assert dense_calls


def _dense_linears(engine) -> int:
    return sum(
        isinstance(m, switch_glu.DensePrefillQuantizedLinear)
        for _, m in engine.loaded.model.named_modules()
    )


def test_decode_and_exact_keep_the_4bit_kernels(checkpoint_dir, dense_calls, monkeypatch):
    model = checkpoint_dir("qwen3_moe")
    with Engine(model, EngineConfig(mode="on-demand")) as engine:
        assert _dense_linears(engine) > 0
        products = []
        with monkeypatch.context() as patch:
            patch.setattr(mx, "matmul", lambda *a, **k: products.append(1))
            engine_logits(engine, mx.array([[7]]))  # one token: decode's path, 4-bit everywhere
    assert dense_calls == [] and products == []
    with Engine(model, EngineConfig(mode="resident", exact_kernels=True)) as engine:
        assert _dense_linears(engine) == 0
        site = engine.loaded.sites[0]
        assert not isinstance(
            getattr(site.parent, site.attribute), switch_glu.DensePrefillSwitchGLU
        )
        engine_logits(engine, mx.array([LONG]))
    assert dense_calls == []


def test_a_model_dequantized_after_loading_runs_its_float_path(checkpoint_dir, dense_calls):
    """The training student loads resident and then dequantizes every layer (mlx-lm's
    `dequantize_model`): the swapped-in modules must then run the float weights as they are."""
    from mlx_lm.utils import dequantize_model

    model = checkpoint_dir("qwen3_moe")
    exact = _logits(model, LONG, mode="resident", exact_kernels=True)
    with Engine(model, EngineConfig(mode="resident")) as engine:
        dequantize_model(engine.loaded.model)
        fast = np.array(engine_logits(engine, mx.array([LONG]))[0].astype(mx.float32))
    assert dense_calls == []
    assert (np.abs(fast - exact).max(axis=-1) / np.abs(exact).max(axis=-1)).max() <= BOUND


def test_the_dense_copies_are_bounded(checkpoint_dir):
    """The fp32 copies wait for evaluation in groups of at most DENSE_EVAL_BYTES: on-demand's peak
    MLX memory over a prefill grows by at most twice that over the exact path's (left to the
    layer's one evaluation, it was every routed expert's copy at once). Each arm is an `edge0
    generate` process of its own (MLX's peak is per process; the command preloads the fast BLAS)."""
    model = checkpoint_dir("qwen3_moe", "small")
    with Engine(model, EngineConfig(mode="on-demand")) as engine:
        layer = engine.store.index.layers[engine.loaded.sites[0].layer]
        packed = sum(t.expert_nbytes for t in layer.tensors if t.part == "weight")
    fp32_expert = packed * 8  # 4-bit: 8 weights of 4 bytes per packed 4 bytes
    text = " ".join(f"word{i}" for i in range(40))
    peaks = {}
    for exact in ([], ["--exact"]):
        command = [sys.executable, "-m", "edge0_tui.cli", "generate", str(model), "--raw"]
        command += ["--prompt", text, "--max-tokens", "2", "--expert-cache", "6M", "--json"]
        done = subprocess.run([*command, *exact], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        peaks[bool(exact)] = json.loads(done.stdout)["summary"]["peak_mlx_bytes"]
    # A group reaches DENSE_EVAL_BYTES plus one expert before it is evaluated, and MLX's peak moves
    # by a few MiB between processes: twice the group is the line (every expert of a layer at once,
    # as before the groups, was well over it).
    bound = 2 * switch_glu.DENSE_EVAL_BYTES
    assert peaks[False] <= peaks[True] + bound, (peaks, fp32_expert)


def test_the_decision_follows_the_blas(monkeypatch):
    """Dense only where it is faster: the CPU with a fast BLAS, and never under the exact setting."""
    import engine.runtime.blas as blas

    fast = blas.BlasInfo("OpenBLAS", True, "/x/libopenblas.so.0", 1)
    slow = blas.BlasInfo("reference BLAS", False, "/x/libblas.so.3", 1)
    monkeypatch.setattr(blas, "blas_in_use", lambda: fast)
    assert dense_prefill_rows(EngineConfig()) == switch_glu.DENSE_MIN_ROWS
    assert dense_prefill_rows(EngineConfig(exact_kernels=True)) is None
    assert "dense fp32" in prefill_kernels(EngineConfig())
    assert "exact" in prefill_kernels(EngineConfig(exact_kernels=True))
    monkeypatch.setattr(blas, "blas_in_use", lambda: slow)
    assert dense_prefill_rows(EngineConfig()) is None
    assert "no fast BLAS" in prefill_kernels(EngineConfig())


def test_the_microbench_measures_every_path(checkpoint_dir):
    """`python -m engine.measure.microbench products|prefill` (figures in docs/benchmarks.md):
    the cases it prints exist for every row count, and a prompt is cut to the tokens asked."""
    from engine.measure import microbench_prefill, microbench_products

    times = microbench_products.product_times(64, 128, [1, 4], repeats=1, square=64)
    for t in (1, 4):
        for path in ("4-bit", "dequant+fp32", "fp32"):
            assert times[f"[T,64]x[64,128] T={t} {path}"] >= 0
    with Engine(checkpoint_dir("qwen3_moe"), EngineConfig()) as engine:
        for chat in (False, True):
            prompt = microbench_prefill._prompt_of(engine, 40, chat)
            assert 30 <= len(prompt) <= 40


def test_mxfp4_goes_dense_later_than_affine():
    """The row threshold follows each format's measured costs: an mxfp4 expert (cheap kernel,
    dear dequantize on the CPU) needs ~20 rows, an affine one of the same shape a handful."""
    thresholds = {}
    for mode, group in (("affine", 64), ("mxfp4", 32)):
        w = mx.zeros((1, 768, 2048))
        packed, scales, *biases = mx.quantize(w, group_size=group, bits=4, mode=mode)
        weights = packed.shape[-2] * packed.shape[-1] * 8  # eight 4-bit weights a word
        specs = [
            switch_glu.ProjectionSpec(p, group, 4, mode, bool(biases), False, weights)
            for p in switch_glu.PROJECTIONS
        ]
        thresholds[mode] = switch_glu._rows_worth_dequantizing(specs)
    assert thresholds["affine"] <= 4 < 16 <= thresholds["mxfp4"] <= 24, thresholds

"""Micro-benchmarks behind engine design choices; each prints figures, none asserts a speed.

    python -m engine.measure.microbench compute   [--hidden 512] [--moe-int 256] [--k 8] [--rounds 7]
    python -m engine.measure.microbench eviction MODEL [--tokens 200] [--budgets 0.1,0.25,0.5]
    python -m engine.measure.microbench products  [--hidden 256] [--moe-int 6144] [--tokens 1,4,16,64,256]
    python -m engine.measure.microbench prefill MODEL [--prompt-tokens 256] [--chat] [--modes ...]
                                            [--expert-cache SIZE] [--page-cache SIZE]
    python -m engine.measure.microbench formats   [--shapes gpt-oss-120b,wall] [--hidden H --moe-int W]
                                            [--rows 16,64] [--repeats 5] [--copies N] [--dtype bfloat16]

`compute`: one decode token through k routed experts, computed as k per-expert `quantized_matmul`s
(what the engine does) or as one `gather_qmm` per projection over a slot bank (the alternative),
plus the cost of writing missed experts into their slots. Arms alternate order every round; medians.

`products`: the matrix products of one routed expert's projection (and a square fp32 GEMM) at decode
(1 row) and prefill (many rows) shapes, for each path: the 4-bit kernel, dequantize + fp32 GEMM
(the dense prefill path), fp32 GEMM alone; under MLX's bundled BLAS and under the fast BLAS
(`runtime.blas`). The BLAS is fixed per process, so each is measured in a child process of its own,
the two alternating over rounds; medians. Where dequantize + GEMM beats the 4-bit kernel is the
crossover `experts.switch_glu.DENSE_MIN_ROWS` stands for.

`prefill`: one prompt of about N tokens then a few decode tokens (EOS ignored) through the Engine,
per mode, under "today" (MLX's bundled BLAS, `exact_kernels`) and "fast" (the fast BLAS, the dense
prefill path); each run a process of its own, arms rotated every round; medians of TTFT, prefill
and decode tok/s. `--chat` wraps the prompt in the chat template (a chat turn's TTFT).

`formats`: one routed expert stored as mxfp4 (gpt-oss's experts: group 32, uint8 power-of-two
scales, no biases) against affine 4-bit (mlx-lm's: group 64, scales and biases in `--dtype`), each
computed in its own format as `experts.switch_glu` does: decode (1 row: one `quantized_matmul` per
projection), prefill (N rows routed to the expert: `gather_qmm`, and dequantize + fp32 GEMM), the
dequantize alone, and the bytes one expert occupies on disk. Both formats quantize the same weights
and multiply the same inputs; each output is checked against an fp32 product with the same
quantized weights dequantized exactly (fails loudly past the tolerance). Calls cycle over `--copies`
distinct experts (default: 64 MiB of them, twice the L3 here) so that an expert is not timed hot
in the cache. Formats alternate order every repeat; medians [min-max]. Run in a child process with
the fast BLAS preloaded (the dense path's GEMM), as the engine runs.

`eviction`: records the routing trace of real generations on MODEL, then replays it through the
expert pool under each eviction policy and budget, printing hit rates (no I/O: policy only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np

from ..config import EngineConfig, GenerationConfig, parse_size
from ..experts.eviction import LFUAgingPolicy, make_policy
from .bench import rotation

GROUP_SIZE, BITS = 64, 4


def _quantized_expert(hidden: int, moe_int: int) -> dict[str, mx.array]:
    out = {}
    for name, shape in (
        ("gate", (moe_int, hidden)),
        ("up", (moe_int, hidden)),
        ("down", (hidden, moe_int)),
    ):
        w, s, b = mx.quantize(mx.random.normal(shape) * 0.02, GROUP_SIZE, BITS)
        out |= {f"{name}.w": w, f"{name}.s": s, f"{name}.b": b}
    return out


def _qmm(x, e, name):
    return mx.quantized_matmul(
        x,
        e[f"{name}.w"],
        e[f"{name}.s"],
        e[f"{name}.b"],
        transpose=True,
        group_size=GROUP_SIZE,
        bits=BITS,
    )


def _gqmm(x, bank, name, idx):
    return mx.gather_qmm(
        x,
        bank[f"{name}.w"],
        bank[f"{name}.s"],
        bank[f"{name}.b"],
        rhs_indices=idx,
        transpose=True,
        group_size=GROUP_SIZE,
        bits=BITS,
    )


def bench_compute(hidden: int, moe_int: int, k: int, slots: int, rounds: int) -> None:
    mx.random.seed(0)
    experts = [_quantized_expert(hidden, moe_int) for _ in range(slots)]
    bank = {key: mx.stack([e[key] for e in experts]) for key in experts[0]}
    x = mx.random.normal((1, 1, hidden))
    mx.eval(experts, bank, x)
    chosen = list(range(k))
    idx = mx.array(np.array(chosen, dtype=np.uint32).reshape(1, 1, k))

    def per_expert():
        outs = []
        for e in chosen:
            a = experts[e]
            h = nn_silu(_qmm(x, a, "gate")) * _qmm(x, a, "up")
            outs.append(_qmm(h, a, "down"))
        mx.eval(mx.stack(outs, axis=-2))

    def slot_bank():
        xe = mx.expand_dims(x, (-2, -3))
        h = nn_silu(_gqmm(xe, bank, "gate", idx)) * _gqmm(xe, bank, "up", idx)
        mx.eval(_gqmm(h, bank, "down", idx))

    def slot_write_two_misses():
        for s in range(2):
            for key in bank:
                bank[key][s] = experts[(s + 3) % slots][key]
        mx.eval(bank)

    arms = {
        "per-expert qmm": per_expert,
        "slot-bank gather_qmm": slot_bank,
        "2 slot writes": slot_write_two_misses,
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        order = rotation(list(arms), r)
        for name in order:
            for _ in range(3):
                arms[name]()
            start = time.perf_counter()
            for _ in range(10):
                arms[name]()
            times[name].append((time.perf_counter() - start) / 10 * 1e3)
    print(f"decode MoE, hidden {hidden}, moe_int {moe_int}, k {k}, {slots} slots, {rounds} rounds")
    for name, values in times.items():
        print(
            f"  {name:24s} median {statistics.median(values):7.3f} ms  (min {min(values):.3f}, max {max(values):.3f})"
        )


def nn_silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a kingdom by the sea,",
    "The memory wall is the gap between",
)


def record_trace(model_dir: str, tokens: int) -> tuple[list[tuple[int, int, list[int]]], int]:
    from ..runtime.generation import Engine  # the engine is only needed for this sub-command

    engine = Engine(model_dir, EngineConfig(mode="on-demand", expert_cache_bytes=1 << 40))
    engine.store.trace = []
    try:
        for i, prompt in enumerate(PROMPTS):
            gen = GenerationConfig(
                tokens // len(PROMPTS), temperature=0.8, top_p=0.95, seed=i, ignore_eos=True
            )
            engine.generate(engine.encode(prompt, chat=True), gen)
        experts = next(iter(engine.loaded.index.layers.values())).num_experts
        return engine.store.trace, experts * len(engine.loaded.index.layers)
    finally:
        engine.close()


def replay(trace, budget_experts: int, policy: str, half_life: float | None = None) -> float:
    """Hit rate of the decode-step fetches of `trace` in a cache of `budget_experts`, evicting by
    `policy` as the expert pool asks it: never one of the layer's own routed experts."""
    chooser = make_policy(policy) if half_life is None else LFUAgingPolicy(half_life)
    resident: set[tuple[int, int]] = set()
    hits = total = step = 0
    last_step = None
    for trace_step, layer, experts in trace:
        if trace_step != last_step:
            step += 1
            last_step = trace_step
        keys = [(layer, e) for e in experts]
        for key in keys:
            total += 1
            if key in resident:
                hits += 1
            else:
                while len(resident) >= budget_experts:
                    victim = chooser.victim(excluded=keys)
                    if victim is None:
                        break
                    resident.remove(victim)
                    chooser.remove(victim)
                resident.add(key)
            chooser.touch(key, step)
    return hits / total if total else 0.0


def bench_eviction(model_dir: str, tokens: int, budgets: list[float]) -> None:
    trace, total_experts = record_trace(model_dir, tokens)
    print(f"{len(trace)} layer fetches over {total_experts} experts in all")
    arms = [("lru", None), ("lfu-aging", 4.0), ("lfu-aging", 8.0), ("lfu-aging", 32.0)]
    header = "budget   " + "  ".join(f"{p}{'' if h is None else f' h={h:g}':>8}" for p, h in arms)
    print(header)
    for fraction in budgets:
        budget = max(1, int(fraction * total_experts))
        rates = [replay(trace, budget, p, h) for p, h in arms]
        print(f"{fraction:6.0%}   " + "  ".join(f"{r:>14.1%}" for r in rates))


# -- products: GEMM and 4-bit at decode and prefill shapes, per BLAS ---------------------------------


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _projection_times(shape: tuple[int, int], tokens: list[int], repeats: int) -> dict:
    """One expert projection [out, in]: dequantize, and per row count T the three paths."""
    q, s, b = mx.quantize(mx.random.normal(shape) * 0.02, GROUP_SIZE, BITS)
    dense = mx.dequantize(q, s, b, GROUP_SIZE, BITS)
    mx.eval(q, s, b, dense)
    name = f"[T,{shape[1]}]x[{shape[1]},{shape[0]}]"

    def dequantize() -> mx.array:
        return mx.dequantize(q, s, b, GROUP_SIZE, BITS)

    out = {f"{name} dequantize": _timed(lambda: mx.eval(dequantize()), repeats)}
    for t in tokens:
        x = mx.random.normal((t, shape[1]))
        mx.eval(x)
        paths = {
            "4-bit": lambda x=x: mx.quantized_matmul(
                x, q, s, b, transpose=True, group_size=GROUP_SIZE, bits=BITS
            ),
            "dequant+fp32": lambda x=x: mx.matmul(x, dequantize().T),
            "fp32": lambda x=x: mx.matmul(x, dense.T),
        }
        for path, fn in paths.items():
            out[f"{name} T={t} {path}"] = _timed(lambda fn=fn: mx.eval(fn()), repeats)
    return out


def product_times(
    hidden: int, moe_int: int, tokens: list[int], repeats: int = 5, square: int = 2048
) -> dict:
    """{case: ms} in this process: medians of `repeats` calls after a warm-up."""
    mx.random.seed(0)
    out = {}
    for shape in ((moe_int, hidden), (hidden, moe_int)):
        out |= _projection_times(shape, tokens, repeats)
    a, b = mx.random.normal((square, square)), mx.random.normal((square, square))
    mx.eval(a, b)
    n = square
    out[f"[{n},{n}]x[{n},{n}] fp32"] = _timed(lambda: mx.eval(a @ b), max(1, repeats // 2))
    return out


def bench_products(hidden: int, moe_int: int, tokens: list[int], rounds: int) -> None:
    from ..runtime.blas import GUARD, preload_environment

    arms = {"bundled": dict(os.environ, **{GUARD: "off"})}
    arms["bundled"].pop("LD_PRELOAD", None)
    fast = preload_environment({k: v for k, v in os.environ.items() if k != GUARD})
    if fast is not None:
        arms["fast"] = fast
    command = [sys.executable, "-m", "engine.measure.microbench", "products", "--child"]
    command += ["--hidden", str(hidden), "--moe-int", str(moe_int)]
    command += ["--tokens", ",".join(map(str, tokens))]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    blas: dict[str, str] = {}
    for r in range(rounds):
        for arm in rotation(list(arms), r):
            done = subprocess.run(command, env=arms[arm], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{arm}: {done.stderr.strip().splitlines()[-1:]}")
            result = json.loads(done.stdout)
            blas[arm] = result["blas"]
            runs[arm].append(result["ms"])
    medians = {
        arm: {case: statistics.median(r[case] for r in rs) for case in rs[0]}
        for arm, rs in runs.items()
    }
    print(f"matrix products, fp32 activations, 4-bit g{GROUP_SIZE}; {rounds} rounds, medians (ms)")
    for arm, text in blas.items():
        print(f"  {arm}: {text}")
    names = list(arms)
    print(f"  {'case':44s}" + "".join(f"{n:>12s}" for n in names))
    for case in medians[names[0]]:
        print(f"  {case:44s}" + "".join(f"{medians[n][case]:12.2f}" for n in names))
    if "fast" in medians:
        for shape in {c.split(" T=")[0] for c in medians["fast"] if " T=" in c}:
            m = medians["fast"]
            wins = [
                t for t in tokens if m[f"{shape} T={t} dequant+fp32"] < m[f"{shape} T={t} 4-bit"]
            ]
            print(f"  {shape}: dequant+fp32 beats 4-bit from T={min(wins) if wins else '-'}")


# -- formats: one routed expert as mxfp4 against affine 4-bit, each computed in its own format -------

# How each format stores a routed expert: gpt-oss ships its experts as mxfp4 (a uint8 power-of-two
# scale per 32 weights, no biases); mlx-lm's `convert -q` writes affine 4-bit (a scale and a bias
# per 64 weights, in the model's float dtype).
EXPERT_FORMATS = {
    "mxfp4": {"mode": "mxfp4", "group_size": 32, "bits": 4},
    "affine": {"mode": "affine", "group_size": 64, "bits": 4},
}
# (hidden, expert width) of one routed expert.
EXPERT_SHAPES = {"gpt-oss-120b": (2880, 2880), "wall": (2048, 768)}
# An output within this share of the largest reference output is a match: fp32 sums of the same
# products in another order. A dense path whose dequantized copy is rounded (affine scales in a
# 16-bit float) gets twice that float's epsilon instead.
EXACT_RTOL = 1e-4
COLD_BYTES = 64 << 20  # cycle over this many bytes of distinct experts: twice the L3 here


def _expert_weights(hidden: int, moe_int: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    return {
        name: (mx.random.normal(shape) * 0.02).astype(dtype)
        for name, shape in (
            ("gate", (moe_int, hidden)),
            ("up", (moe_int, hidden)),
            ("down", (hidden, moe_int)),
        )
    }


def quantize_expert(weights: dict[str, mx.array], fmt: str) -> dict[str, tuple]:
    """{projection: (packed, scales, biases or None)} of `weights` in format `fmt`."""
    out = {}
    for name, w in weights.items():
        parts = mx.quantize(w, **EXPERT_FORMATS[fmt])
        out[name] = (parts[0], parts[1], parts[2] if len(parts) > 2 else None)
    return out


def reference_weights(expert: dict[str, tuple], fmt: str) -> dict[str, mx.array]:
    """The expert's quantized weights dequantized exactly to fp32 (affine: the scales and biases
    widened first, as the 4-bit kernels do; `dtype=float32` alone still computes in their dtype)."""
    spec = EXPERT_FORMATS[fmt]
    out = {}
    for name, (w, s, b) in expert.items():
        if spec["mode"] == "affine":
            s, b = s.astype(mx.float32), b.astype(mx.float32)
        out[name] = mx.dequantize(w, s, b, **spec, dtype=mx.float32)
    return out


def _dequantize_like_engine(part: tuple, fmt: str) -> mx.array:
    """`switch_glu._dense_project`'s copy: dequantized to the default dtype, then fp32."""
    w, s, b = part
    return mx.dequantize(w, s, b, **EXPERT_FORMATS[fmt]).astype(mx.float32)


def _expert_glu(project, x: mx.array) -> mx.array:
    """SwitchGLU's expert: down(silu(gate(x)) * up(x))."""
    return project(nn_silu(project(x, "gate")) * project(x, "up"), "down")


def _format_cases(expert: dict[str, tuple], fmt: str, inputs: dict) -> dict:
    """{case: fn() -> array} for one expert in format `fmt`."""
    spec = EXPERT_FORMATS[fmt]

    def qmm(x, name):
        w, s, b = expert[name]
        return mx.quantized_matmul(x, w, s, b, transpose=True, **spec)

    bank = {
        name: tuple(None if a is None else mx.expand_dims(a, 0) for a in part)
        for name, part in expert.items()
    }

    def gather(x, name):  # as `mixed_glu`'s small experts: [n, 1, in] rows, sorted slots
        w, s, b = bank[name]
        idx = mx.zeros((x.shape[0],), dtype=mx.uint32)
        return mx.gather_qmm(
            x, w, s, b, rhs_indices=idx, transpose=True, sorted_indices=True, **spec
        )

    def dense(x, name):
        return mx.matmul(x, _dequantize_like_engine(expert[name], fmt).T)

    cases = {"decode qmm": lambda: _expert_glu(qmm, inputs[1])}
    for n, x in inputs.items():
        if n == 1:
            continue
        cases[f"{n} rows gather_qmm"] = lambda x=x: _expert_glu(gather, x[:, None, :]).squeeze(1)
        cases[f"{n} rows dequant+fp32"] = lambda x=x: _expert_glu(dense, x)
    cases["dequantize"] = lambda: [_dequantize_like_engine(p, fmt) for p in expert.values()]
    cases["dequantize exact"] = lambda: list(reference_weights(expert, fmt).values())
    return cases


def _check_format(
    expert: dict[str, tuple], fmt: str, weights: dict[str, mx.array], inputs: dict
) -> dict:
    """Each case's output against fp32 products with the same quantized weights; raises past the
    tolerance. Also: is the dense path's copy exact, and the format's quantization error."""
    ref = reference_weights(expert, fmt)
    copies = {name: _dequantize_like_engine(p, fmt) for name, p in expert.items()}
    copy_exact = all(mx.array_equal(copies[n], ref[n]).item() for n in ref)
    copy_dtype = mx.dequantize(*expert["gate"], **EXPERT_FORMATS[fmt]).dtype
    dense_rtol = EXACT_RTOL if copy_exact else 2 * mx.finfo(copy_dtype).eps
    quant_sq = sum(mx.sum(mx.square(ref[n] - weights[n].astype(mx.float32))).item() for n in ref)
    weight_sq = sum(mx.sum(mx.square(weights[n].astype(mx.float32))).item() for n in ref)
    errors = {}
    for case, fn in _format_cases(expert, fmt, inputs).items():
        if case.startswith("dequantize"):
            continue
        rows = 1 if case == "decode qmm" else int(case.split()[0])
        want = _expert_glu(lambda x, name: mx.matmul(x, ref[name].T), inputs[rows])
        got = fn()
        worst = mx.max(mx.abs(got - want)).item()
        scale = mx.max(mx.abs(want)).item()
        rtol = dense_rtol if "dequant" in case else EXACT_RTOL
        if not (worst <= rtol * scale) or got.shape != want.shape:
            raise RuntimeError(
                f"{fmt} {case}: output {tuple(got.shape)} differs from the fp32 product of the same "
                f"quantized weights {tuple(want.shape)} by {worst:.3g} (largest output "
                f"{scale:.3g}, tolerance {rtol:.1e} of it)"
            )
        errors[case] = {"max_abs": worst, "rel": worst / scale, "rtol": rtol}
    return {
        "errors": errors,
        "dense_copy": {"dtype": str(copy_dtype).split(".")[-1], "exact": copy_exact},
        "quant_rel_rms": (quant_sq / weight_sq) ** 0.5,
    }


def format_times(
    hidden: int,
    moe_int: int,
    rows: list[int],
    repeats: int = 5,
    copies: int | None = None,
    dtype: mx.Dtype = mx.bfloat16,
    seed: int = 0,
) -> dict:
    """One routed expert [hidden -> moe_int -> hidden] in each of EXPERT_FORMATS: bytes, checks and
    {case: [ms per repeat]}; calls cycle over `copies` distinct experts (None: COLD_BYTES of them).
    Raises RuntimeError where an output does not match its fp32 reference."""
    mx.random.seed(seed)
    inputs = {n: mx.random.normal((n, hidden)) for n in sorted({1, *rows})}
    weights = _expert_weights(hidden, moe_int, dtype)
    experts = {fmt: [quantize_expert(weights, fmt)] for fmt in EXPERT_FORMATS}
    mx.eval(inputs, weights, experts)
    out: dict = {
        "hidden": hidden,
        "moe_int": moe_int,
        "weights": sum(w.size for w in weights.values()),
        "dtype": str(dtype).split(".")[-1],
        "repeats": repeats,
        "formats": {},
    }
    for fmt, copies_of in experts.items():
        parts = {"weight": 0, "scales": 0, "biases": 0}
        for packed, scales, biases in copies_of[0].values():
            parts["weight"] += packed.nbytes
            parts["scales"] += scales.nbytes
            parts["biases"] += 0 if biases is None else biases.nbytes
        check = _check_format(copies_of[0], fmt, weights, inputs)
        out["formats"][fmt] = {
            "spec": EXPERT_FORMATS[fmt] | {"scales": str(copies_of[0]["gate"][1].dtype)},
            "bytes": sum(parts.values()),
            "parts": parts,
            **check,
            "ms": {},
        }
    del weights
    largest = max(f["bytes"] for f in out["formats"].values())
    if copies is None:
        copies = max(1, -(-COLD_BYTES // largest))
    out["copies"] = copies
    for _ in range(copies - 1):  # more distinct experts, same format and shape
        more = _expert_weights(hidden, moe_int, dtype)
        for fmt in experts:
            experts[fmt].append(quantize_expert(more, fmt))
        mx.eval(experts)
    cases = {
        fmt: [_format_cases(e, fmt, inputs) for e in copies_of]
        for fmt, copies_of in experts.items()
    }
    names = list(cases["mxfp4"][0])
    calls = dict.fromkeys(EXPERT_FORMATS, 0)

    def run(fmt: str, case: str) -> float:
        fn = cases[fmt][calls[fmt] % copies][case]
        calls[fmt] += 1
        start = time.perf_counter()
        mx.eval(fn())
        return (time.perf_counter() - start) * 1e3

    for fmt in EXPERT_FORMATS:  # warm-up: every case of every copy once
        for _ in range(copies):
            for case in names:
                run(fmt, case)
    samples = {fmt: {case: [] for case in names} for fmt in EXPERT_FORMATS}
    for r in range(repeats):
        for fmt in rotation(list(EXPERT_FORMATS), r):
            for case in names:
                samples[fmt][case].append(run(fmt, case))
    for fmt in EXPERT_FORMATS:
        out["formats"][fmt]["ms"] = samples[fmt]
    return out


def _ms_cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def print_formats(label: str, result: dict) -> None:
    m, a = result["formats"]["mxfp4"], result["formats"]["affine"]
    n = result["weights"]
    print(
        f"\n{label}: hidden {result['hidden']}, expert width {result['moe_int']} "
        f"({n / 1e6:.2f} M weights in 3 projections), weights drawn in {result['dtype']}, "
        f"{result['copies']} distinct experts cycled, {result['repeats']} repeats"
    )
    print(
        f"| per expert | mxfp4 (g32, {m['spec']['scales'].split('.')[-1]} scales) "
        f"| affine 4-bit (g64, {a['spec']['scales'].split('.')[-1]} scales+biases) "
        "| mxfp4 / affine |"
    )
    print("|---|---|---|---|")

    def size(f):
        p = f["parts"]
        return (
            f"{f['bytes'] / 2**20:.2f} MiB ({f['bytes'] * 8 / n:.2f} bits/weight: "
            f"{p['weight'] / 2**20:.2f} + {(p['scales'] + p['biases']) / 2**20:.2f} scales"
            f"{'+biases' if p['biases'] else ''})"
        )

    print(f"| bytes on disk | {size(m)} | {size(a)} | {m['bytes'] / a['bytes']:.3f} |")
    for case in m["ms"]:
        what = {"decode qmm": "decode, 1 row: quantized_matmul x3"}.get(case, case)
        if case == "dequantize":
            what = "dequantize 3 projections as the dense path does (default dtype, then fp32)"
        elif case == "dequantize exact":
            what = "dequantize 3 projections straight to fp32 (affine: scales widened first)"
        ratio = statistics.median(m["ms"][case]) / statistics.median(a["ms"][case])
        print(
            f"| {what}, ms | {_ms_cell(m['ms'][case])} | {_ms_cell(a['ms'][case])} | {ratio:.2f} |"
        )
    rates = [f["bytes"] / statistics.median(f["ms"]["decode qmm"]) / 1e6 for f in (m, a)]
    print(
        f"| decode: expert bytes per compute second | {rates[0]:.2f} GB/s | {rates[1]:.2f} GB/s | |"
    )
    print(
        f"| quantization error (rms / weights' rms) | {m['quant_rel_rms']:.4f} "
        f"| {a['quant_rel_rms']:.4f} | |"
    )
    for case in m["errors"]:
        cells = [
            f"{f['errors'][case]['max_abs']:.1e} ({f['errors'][case]['rel']:.1e} of max, "
            f"tol {f['errors'][case]['rtol']:.0e})"
            for f in (m, a)
        ]
        print(f"| {case}: max abs err vs fp32 ref | {cells[0]} | {cells[1]} | |")
    copies = [
        f"{f['dense_copy']['dtype']}, {'exact' if f['dense_copy']['exact'] else 'rounded'}"
        for f in (m, a)
    ]
    print(f"| dense path's dequantized copy | {copies[0]} | {copies[1]} | |")


def bench_formats(args: argparse.Namespace) -> None:
    from ..runtime.blas import preload_environment

    shapes = (
        {f"hidden {args.hidden}, width {args.moe_int}": (args.hidden, args.moe_int)}
        if args.hidden
        else {name: EXPERT_SHAPES[name] for name in args.shapes.split(",")}
    )
    env = preload_environment() or dict(os.environ)
    for label, (hidden, moe_int) in shapes.items():
        spec = {
            "hidden": hidden,
            "moe_int": moe_int,
            "rows": [int(n) for n in args.rows.split(",")],
            "repeats": args.repeats,
            "copies": args.copies,
            "dtype": args.dtype,
        }
        command = [sys.executable, "-m", "engine.measure.microbench", "formats-child"]
        done = subprocess.run([*command, json.dumps(spec)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{label}: {done.stderr.strip()}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if label == next(iter(shapes)):
            print(
                "one routed expert in each format, float32 activations; "
                f"{result['blas']}; formats alternate order every repeat; medians [min-max]"
            )
        print_formats(label, result)


def formats_child(spec: dict) -> dict:
    from ..runtime.blas import blas_in_use

    result = format_times(
        spec["hidden"],
        spec["moe_int"],
        spec["rows"],
        spec["repeats"],
        spec["copies"],
        getattr(mx, spec["dtype"]),
    )
    return result | {"blas": blas_in_use().describe()}


# -- prefill: TTFT and prefill tok/s through the engine, today's path against the fast one ----------

PASSAGE = (
    "The memory wall is the gap between how fast a processor computes and how fast memory can feed "
    "it. A model whose experts live on disk waits for them unless they are read ahead, and a long "
    "prompt multiplies every routed expert by many tokens at once, which a matrix library does at "
    "its full speed when the weights are dense. "
)


def _prompt_of(engine, tokens: int, chat: bool) -> list[int]:
    """About `tokens` tokens of PASSAGE (repeated), raw or as one chat turn."""
    words = (PASSAGE * (1 + tokens // 40)).split()

    def encode(n: int) -> list[int]:
        text = " ".join(words[:n])
        if chat:
            return engine.encode_chat([{"role": "user", "content": text}])
        return engine.encode(text)

    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose encoding fits in `tokens`
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(encode(mid)) <= tokens else (lo, mid - 1)
    return encode(lo)


def prefill_child(spec: dict) -> dict:
    from ..runtime.blas import blas_in_use, prefill_kernels
    from ..runtime.generation import Engine

    config = EngineConfig(
        mode=spec["mode"],
        exact_kernels=spec["exact"],
        expert_cache_bytes=spec["expert_cache_bytes"],
        page_cache_bytes=spec["page_cache_bytes"] if spec["mode"] != "resident" else None,
    )
    with Engine(spec["model"], config) as engine:
        prompt = _prompt_of(engine, spec["prompt_tokens"], spec["chat"])
        gen = GenerationConfig(spec["decode_tokens"], temperature=0.0, ignore_eos=True)
        summary = engine.generate(prompt, gen).summary
        return {
            "blas": blas_in_use().describe(),
            "kernels": prefill_kernels(config),
            "prompt_tokens": len(prompt),
            "ttft_ms": summary["ttft_ms"],
            "prefill_tok_per_s": summary["prefill_tok_per_s"],
            "decode_tok_per_s": summary["decode_tok_per_s"],
        }


def bench_prefill(args: argparse.Namespace) -> None:
    from ..runtime.blas import GUARD, preload_environment

    today = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {GUARD: "off"}
    fast = preload_environment({k: v for k, v in os.environ.items() if k != GUARD})
    arms = {}
    for mode in args.modes.split(","):
        arms[f"{mode} today"] = (today, mode, True)
        if fast is not None:
            arms[f"{mode} fast"] = (fast, mode, False)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in rotation(list(arms), r):
            env, mode, exact = arms[arm]
            spec = {
                "model": args.model,
                "mode": mode,
                "exact": exact,
                "prompt_tokens": args.prompt_tokens,
                "decode_tokens": args.decode_tokens,
                "chat": args.chat,
                "expert_cache_bytes": parse_size(args.expert_cache),
                "page_cache_bytes": parse_size(args.page_cache) if args.page_cache else None,
            }
            command = [sys.executable, "-m", "engine.measure.microbench", "prefill-child"]
            done = subprocess.run(
                [*command, json.dumps(spec)], env=env, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise SystemExit(f"{arm}: {done.stderr.strip().splitlines()[-1:]}")
            runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
            last = runs[arm][-1]
            print(
                f"round {r + 1} {arm}: TTFT {last['ttft_ms']:.0f} ms, prefill "
                f"{last['prefill_tok_per_s']:.1f} tok/s, decode {last['decode_tok_per_s']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    first = next(iter(runs.values()))[0]
    what = "chat turn" if args.chat else "raw prompt"
    budgets = f"expert cache {args.expert_cache}, page cache {args.page_cache or 'off'}"
    print(
        f"{args.model}: {first['prompt_tokens']}-token {what} + {args.decode_tokens} decode tokens, "
        f"{budgets}, {args.rounds} rounds rotated, medians [min-max]"
    )
    for arm, rs in runs.items():
        print(f"  {arm}: {rs[0]['blas']}; prefill experts: {rs[0]['kernels']}")
    print("| arm | TTFT ms | prefill tok/s | vs today | decode tok/s | vs today |")
    print("|---|---|---|---|---|---|")
    for arm, rs in runs.items():
        base = runs[arm.rsplit(" ", 1)[0] + " today"]
        print(
            f"| {arm} | {_cell(rs, 'ttft_ms', '.0f')} | {_cell(rs, 'prefill_tok_per_s', '.1f')} "
            f"| {_med(rs, 'prefill_tok_per_s') / _med(base, 'prefill_tok_per_s'):.1f}x "
            f"| {_cell(rs, 'decode_tok_per_s', '.1f')} "
            f"| {_med(rs, 'decode_tok_per_s') / _med(base, 'decode_tok_per_s'):.2f}x |"
        )


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _cell(rows: list[dict], key: str, fmt: str) -> str:
    values = [r[key] for r in rows]
    return f"{_med(rows, key):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.measure.microbench")
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compute")
    c.add_argument("--hidden", type=int, default=512)
    c.add_argument("--moe-int", type=int, default=256)
    c.add_argument("--k", type=int, default=8)
    c.add_argument("--slots", type=int, default=16)
    c.add_argument("--rounds", type=int, default=7)
    p = sub.add_parser("products")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-int", type=int, default=6144)
    p.add_argument("--tokens", default="1,2,4,16,64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    f = sub.add_parser("prefill")
    f.add_argument("model")
    f.add_argument("--prompt-tokens", type=int, default=256)
    f.add_argument("--decode-tokens", type=int, default=16)
    f.add_argument("--modes", default="resident,on-demand")
    f.add_argument("--rounds", type=int, default=3)
    f.add_argument("--chat", action="store_true", help="the prompt as one chat turn")
    f.add_argument("--expert-cache", default="1G", help="streamed modes' expert budget")
    f.add_argument("--page-cache", default=None, help="streamed modes' page-cache budget")
    child = sub.add_parser("prefill-child")
    child.add_argument("spec")
    m = sub.add_parser("formats")
    m.add_argument(
        "--shapes", default=",".join(EXPERT_SHAPES), help="of " + ", ".join(EXPERT_SHAPES)
    )
    m.add_argument("--hidden", type=int, default=None, help="with --moe-int: this shape instead")
    m.add_argument("--moe-int", type=int, default=None)
    m.add_argument("--rows", default="16,64", help="prefill rows routed to the expert")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--copies", type=int, default=None, help="distinct experts (default: 64 MiB)")
    m.add_argument("--dtype", default="bfloat16", help="affine scales and biases, and the weights")
    mchild = sub.add_parser("formats-child")
    mchild.add_argument("spec")
    e = sub.add_parser("eviction")
    e.add_argument("model")
    e.add_argument("--tokens", type=int, default=200)
    e.add_argument("--budgets", default="0.1,0.25,0.5")
    args = parser.parse_args()
    if args.what == "compute":
        bench_compute(args.hidden, args.moe_int, args.k, args.slots, args.rounds)
    elif args.what == "products":
        tokens = [int(t) for t in args.tokens.split(",")]
        if args.child:
            from ..runtime.blas import blas_in_use

            ms = product_times(args.hidden, args.moe_int, tokens)
            print(json.dumps({"blas": blas_in_use().describe(), "ms": ms}))
        else:
            bench_products(args.hidden, args.moe_int, tokens, args.rounds)
    elif args.what == "prefill":
        bench_prefill(args)
    elif args.what == "prefill-child":
        print(json.dumps(prefill_child(json.loads(args.spec))))
    elif args.what == "formats":
        if (args.hidden is None) != (args.moe_int is None):
            parser.error("formats: --hidden and --moe-int go together")
        unknown = set(args.shapes.split(",")) - set(EXPERT_SHAPES)
        if unknown:
            parser.error(f"formats: unknown shape {', '.join(sorted(unknown))}")
        bench_formats(args)
    elif args.what == "formats-child":
        print(json.dumps(formats_child(json.loads(args.spec))))
    else:
        bench_eviction(args.model, args.tokens, [float(b) for b in args.budgets.split(",")])


if __name__ == "__main__":
    main()

"""`microbench formats`: one routed expert as mxfp4 against affine 4-bit.

`formats`: one routed expert stored as mxfp4 (gpt-oss's experts: group 32, uint8 power-of-two
scales, no biases) against affine 4-bit (mlx-lm's: group 64, scales and biases in `--dtype`), each
computed in its own format as `experts.switch_glu` does: decode (1 row: one `quantized_matmul` per
projection), prefill (N rows routed to the expert: `gather_qmm`, and dequantize + fp32 GEMM), the
dequantize alone, and the bytes one expert occupies on disk. Both formats quantize the same weights
and multiply the same inputs; each output is checked against an fp32 product with the same
quantized weights dequantized exactly (fails loudly past the tolerance). Calls cycle over `--copies`
distinct experts (by default more bytes than a CPU's last-level cache) so that an expert is not timed hot
in the cache. Formats alternate order every repeat; medians [min-max]. Run in a child process with
the fast BLAS preloaded (the dense path's GEMM), as the engine runs.
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

from .bench import rotation
from .microbench_compute import nn_silu

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

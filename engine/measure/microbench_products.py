"""`microbench products`: matrix products of one routed expert, per BLAS.

`products`: the matrix products of one routed expert's projection (and a square fp32 GEMM) at decode
(1 row) and prefill (many rows) shapes, for each path: the 4-bit kernel, dequantize + fp32 GEMM
(the dense prefill path), fp32 GEMM alone; under MLX's bundled BLAS and under the fast BLAS
(`runtime.blas`). The BLAS is fixed per process, so each is measured in a child process of its own,
the two alternating over rounds; medians. Where dequantize + GEMM beats the 4-bit kernel is the
crossover `experts.switch_glu.DENSE_MIN_ROWS` stands for.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import mlx.core as mx

from .bench import rotation
from .microbench_compute import BITS, GROUP_SIZE


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

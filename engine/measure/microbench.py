"""Micro-benchmarks behind engine design choices; each prints figures, none asserts a speed.

    python -m engine.measure.microbench compute   [--hidden 512] [--moe-int 256] [--k 8] [--rounds 7]
    python -m engine.measure.microbench eviction MODEL [--tokens 200] [--budgets 0.1,0.25,0.5]
    python -m engine.measure.microbench products  [--hidden 256] [--moe-int 6144] [--tokens 1,4,16,64,256]
    python -m engine.measure.microbench prefill MODEL [--prompt-tokens 256] [--chat] [--modes ...]
                                            [--expert-cache SIZE] [--page-cache SIZE]

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
from ..experts.pool import ExpertPool, LFUAgingPolicy, ResidentExpert
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
    """Hit rate of the decode-step fetches of `trace` under a pool holding `budget_experts`."""
    pool = ExpertPool(budget_bytes=budget_experts, policy=policy)
    if half_life is not None:
        pool.policy = LFUAgingPolicy(half_life)
    one = ResidentExpert({}, 1)
    hits = total = 0
    last_step = None
    for step, layer, experts in trace:
        if step != last_step:
            pool.step += 1
            last_step = step
        keys = [(layer, e) for e in experts]
        for key in keys:
            total += 1
            if pool.get(key) is not None:
                hits += 1
            else:
                pool.put(key, one, protected=keys)
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
    else:
        bench_eviction(args.model, args.tokens, [float(b) for b in args.budgets.split(",")])


if __name__ == "__main__":
    main()

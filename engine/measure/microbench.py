"""Micro-benchmarks behind two engine design choices; each prints figures, none asserts a speed.

    python -m engine.measure.microbench compute   [--hidden 512] [--moe-int 256] [--k 8] [--rounds 7]
    python -m engine.measure.microbench eviction MODEL [--tokens 200] [--budgets 0.1,0.25,0.5]

`compute`: one decode token through k routed experts, computed as k per-expert `quantized_matmul`s
(what the engine does) or as one `gather_qmm` per projection over a slot bank (the alternative),
plus the cost of writing missed experts into their slots. Arms alternate order every round; medians.

`eviction`: records the routing trace of real generations on MODEL, then replays it through the
expert pool under each eviction policy and budget, printing hit rates (no I/O: policy only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from ..config import EngineConfig, GenerationConfig
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.measure.microbench")
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compute")
    c.add_argument("--hidden", type=int, default=512)
    c.add_argument("--moe-int", type=int, default=256)
    c.add_argument("--k", type=int, default=8)
    c.add_argument("--slots", type=int, default=16)
    c.add_argument("--rounds", type=int, default=7)
    e = sub.add_parser("eviction")
    e.add_argument("model")
    e.add_argument("--tokens", type=int, default=200)
    e.add_argument("--budgets", default="0.1,0.25,0.5")
    args = parser.parse_args()
    if args.what == "compute":
        bench_compute(args.hidden, args.moe_int, args.k, args.slots, args.rounds)
    else:
        bench_eviction(args.model, args.tokens, [float(b) for b in args.budgets.split(",")])


if __name__ == "__main__":
    main()

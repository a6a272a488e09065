"""`microbench compute`: decode compute of routed experts.

`compute`: one decode token through k routed experts, computed as k per-expert `quantized_matmul`s
(what the engine does) or as one `gather_qmm` per projection over a slot bank (the alternative),
plus the cost of writing missed experts into their slots. Arms alternate order every round; medians.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

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

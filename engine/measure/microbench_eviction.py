"""`microbench eviction`: expert-pool eviction policies on a recorded routing trace.

`eviction`: records the routing trace of real generations on MODEL, then replays it through the
expert pool under each eviction policy and budget, printing hit rates (no I/O: policy only).

"""

from __future__ import annotations

from ..config import EngineConfig, GenerationConfig
from ..experts.eviction import LFUAgingPolicy, make_policy

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

"""`microbench prefill`: prefill through the Engine, today's path against the fast one.

`prefill`: one prompt of about N tokens then a few decode tokens (EOS ignored) through the Engine,
per mode, under "today" (MLX's bundled BLAS, `exact_kernels`) and "fast" (the fast BLAS, the dense
prefill path); each run a process of its own, arms rotated every round; medians of TTFT, prefill
and decode tok/s. `--chat` wraps the prompt in the chat template (a chat turn's TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from ..config import EngineConfig, GenerationConfig, parse_size
from .bench import rotation

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

"""`edge0 generate`: text from a prompt, with per-step metrics."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from edge0_tui.commands.common import print_stderr, print_warnings
from engine import Edge0Error, GenerationConfig, format_bytes

if TYPE_CHECKING:
    from engine import Tracer

NAME = "generate"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="generate text from a prompt, with per-step metrics")
    options.add_model(parser, help="checkpoint directory, Hugging Face repo id, or demo")
    parser.add_argument(
        "--prompt",
        type=options.utf8,
        required=True,
        help="the user's message, wrapped in the model's chat template when it has one (as "
        "mlx_lm.generate does; see --raw)",
    )
    template = parser.add_mutually_exclusive_group()
    template.add_argument(
        "--raw", action="store_true", help="encode the prompt as is, without the chat template"
    )
    # The default since the chat template became the default; kept so that scripts still run.
    template.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=64, help="at least 1")
    parser.add_argument("--temp", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    options.add_sampling(parser)
    parser.add_argument("--seed", type=int, default=None)
    add_draft(parser)
    options.add_mode(parser)
    options.add_expert_cache(
        parser,
        default=options.AUTO,
        auto=True,
        help="routed-expert budget, e.g. 400K, 512M, 2G, or auto (the default: what the memory "
        "plan leaves, less a share kept for the page cache)",
    )
    options.add_page_cache(parser)
    parser.add_argument("--eviction", choices=("lfu-aging", "lru"), default="lfu-aging")
    options.add_k(parser)
    parser.add_argument("--no-lora", action="store_true", help="prerouter mode without the LoRA")
    options.add_exact(parser)
    options.add_adapters(parser)
    options.add_context(parser)
    options.add_hosts(parser)
    parser.add_argument(
        "--shadow-router",
        action="store_true",
        help="also run the true routers to report the prediction's recall@K (costs compute)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="write a step timeline (Chrome/Perfetto trace JSON: compute, reads, blocked waits)",
    )


def add_draft(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        choices=("lookup",),
        default=None,
        help="speculative decoding: draft tokens and verify them in one forward, which reads "
        "their routed experts' union once (lookup: the tokens that followed the reply's last "
        "few tokens earlier in the prompt or reply: edits, quotes, repeated context). Greedy "
        "output equals the plain run's (exact); sampled output keeps its distribution. Not in "
        "prerouter mode, nor for models whose KV cache cannot drop tokens (linear attention)",
    )
    parser.add_argument(
        "--draft-max",
        type=int,
        default=8,
        help="the most tokens drafted for one forward (default 8; the length adapts to how "
        "many are kept)",
    )


def run(args: argparse.Namespace) -> int:
    from engine import NO_TRACE, Engine, Tracer

    config = options.engine_config(args)
    gen = GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        draft=args.draft,
        draft_max=args.draft_max,
        **options.sampling(args),
    )
    tracer = Tracer() if args.trace is not None else NO_TRACE
    with Engine(args.model, config, tracer=tracer) as engine:
        if not args.json and sys.stderr.isatty():  # (scripts: --json carries the whole plan)
            print_stderr(engine.memory_plan.line())
        print_warnings(engine.warnings)
        if note := engine.quality_note():
            print_warnings([note], "note")
        # Like mlx_lm.generate: the chat template when the tokenizer has one, unless --raw.
        chat = not args.raw and engine.tokenizer.has_chat_template
        prompt = engine.encode(args.prompt, chat=chat)
        printed, tokens = 0, []
        reply = engine.stream(prompt, gen)
        try:
            for token in reply:
                if args.json:
                    continue
                tokens.append(token.token)
                text = engine.reply_text(tokens)
                # A token may end inside a multi-byte character: hold it back until it completes.
                stable = len(text.rstrip("\ufffd"))
                sys.stdout.write(text[printed:stable])
                sys.stdout.flush()
                printed = stable
            result = reply.result
        except BaseException:
            if tracer.enabled:  # also the steps before a failure: they may show why
                write_trace(tracer, args.trace)
            raise
        engine_k = engine.k
        memory_plan = engine.memory_plan.as_dict()
    if args.json:
        print(
            json.dumps(
                {
                    "mode": args.mode,
                    "k": engine_k,
                    "prompt_tokens": result.prompt_tokens,
                    "tokens": result.tokens,
                    "text": result.text,
                    "stopped_by": result.stopped_by,
                    "steps": [s.as_dict() for s in result.steps],
                    "summary": result.summary,
                    "memory_plan": memory_plan,
                }
            )
        )
    else:
        print(result.text[printed:], flush=True)  # before the summary on stderr
        print(summary_line(result.summary), file=sys.stderr)
    if tracer.enabled:  # after the reply: its last line is not cut by the trace's lines
        write_trace(tracer, args.trace)
    if repaired := result.summary.get("nonfinite_repaired", 0):
        # The guard kept the reply going, but a reply that needed repair is not to be trusted.
        print_warnings(
            [
                f"{repaired} NaN or overflowing hidden values were repaired while generating this "
                "reply; the output may be garbage (numerically broken weights or adapters?)"
            ]
        )
    return 0


def write_trace(tracer: Tracer, path: Path) -> None:
    """Write --trace's file and say on stderr where MLX compute waited in a decode step."""
    events = tracer.events
    try:
        tracer.write(path, events)
    except OSError as e:
        raise Edge0Error(f"{path}: cannot write the trace ({e.strerror or e})") from None
    print_stderr(f"edge0: trace written to {path} (open it in https://ui.perfetto.dev)")
    from engine import compute_waits, largest_waits

    waits = compute_waits(events)
    if waits is not None and waits.steps:
        print(
            f"edge0: MLX compute waited {waits.waited_ms:.1f} of a {waits.step_ms:.1f} ms decode "
            f"step; the engine thread meanwhile (ms a step): {largest_waits(waits.by_engine_span)}",
            file=sys.stderr,
        )


def summary_line(s: dict) -> str:
    """The one line on stderr after a reply: prompt, decode, reads, memory, the prerouter."""
    prerouter = ""
    if s.get("median_predicted"):
        prerouter = (
            f" | prerouter: {s['median_predicted']:.0f} layers predicted, "
            f"{s['median_prefetch_issued']:.0f} reads ahead/step "
            f"({s['median_prefetch_in_time']:.0f} in time, {s['median_prefetch_late']:.0f} late), "
            f"dropped {s['dropped']}"
        )
        if "shadow_recall" in s:
            prerouter += f", recall {s['shadow_recall']:.2f}"
    if "prefetch_hit_rate" in s:
        prerouter = (
            f" | prefetch: {s['median_prefetch_issued']:.0f} reads ahead/step, "
            f"{s['prefetch_hit_rate']:.0%} of routed experts were read ahead"
        )
    if draft := s.get("draft"):
        prerouter += (
            f" | draft: {draft['accepted']} of {draft['drafted']} kept in {draft['steps']} "
            f"steps, {draft['experts_union']} experts routed ({draft['experts_summed']} one "
            "position at a time)"
        )
    return (
        f"[{s['prompt_tokens']} prompt tokens, TTFT {s['ttft_ms']:.0f} ms, "
        f"prefill {s['prefill_tok_per_s']:.1f} tok/s | decode {s['decode_tok_per_s']:.2f} tok/s, "
        f"blocked {s['median_blocked_ms']:.1f} ms/step, {s['median_loads']:.0f} loads/step, "
        f"{s['median_mib_read']:.1f} MiB/step, cold {s['median_cold_fraction']:.0%} | "
        f"peak MLX {format_bytes(s['peak_mlx_bytes'])}, RSS {format_bytes(s['peak_rss_bytes'])}"
        f"{_since_start(s)}{prerouter}{_ranks(s)}]"
    )


def _ranks(summary: dict) -> str:
    """With --hosts: each rank's expert reads and cache."""
    rows = summary.get("ranks")
    if not rows:
        return ""
    each = ", ".join(
        f"{r['expert_mib_read']:.1f} MiB read, {r['expert_cache_mib']:.1f} MiB cached" for r in rows
    )
    return f" | {len(rows)} ranks: {each}"


def _since_start(summary: dict) -> str:
    """Said after the RSS peak where it is the process's (the kernel's mark could not be reset as
    the request began, e.g. on macOS): it then includes the model's load."""
    return "" if summary.get("peak_rss_scope", "request") == "request" else " since start"

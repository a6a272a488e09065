"""`edge0 eval`: held-out perplexity, recall@K, distinct-4 and LoRA merge retention."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edge0_tui.commands import options
from edge0_tui.commands.common import print_stderr, read_text

NAME = "eval"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME, help="held-out perplexity, recall@K, distinct-4, LoRA merge retention"
    )
    options.add_model(parser)
    parser.add_argument("--text", type=Path, required=True, help="held-out UTF-8 text")
    options.add_k(parser, help=None)
    options.add_mode(parser, default=None, help="default: prerouter when heads exist")
    parser.add_argument("--no-lora", action="store_true")
    options.add_expert_cache(
        parser,
        default=options.AUTO,
        auto=True,
        metavar="SIZE|auto",
        help="routed-expert budget, e.g. 512M, or auto (the default: what the memory plan leaves)",
    )
    options.add_exact(parser)
    options.add_adapters(parser)
    parser.add_argument("--max-tokens", type=options.count(1), default=16_384)
    parser.add_argument(
        "--samples", type=options.count(1), default=8, help="continuations for distinct-4"
    )
    parser.add_argument(
        "--profiles",
        action="store_true",
        help="one table of every K profile (heads only, and with its LoRA) against the 4-bit "
        "model at its native K, kept for `edge0 info` and the app",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace) -> int:
    from engine.measure.evaluate import EvalConfig, evaluate, format_report

    config = EvalConfig(
        k=args.k,
        mode=args.mode,
        lora=not args.no_lora,
        max_tokens=args.max_tokens,
        samples=args.samples,
        **options.expert_cache_config(args.expert_cache),
        exact_kernels=args.exact,
        adapter_dirs=options.adapter_dirs(args.adapters),
        data_dir=options.data_dir(),
    )
    log = None if args.json else print_stderr
    from engine.train.data import CHARS_PER_TOKEN

    text = read_text(args.text, max_chars=CHARS_PER_TOKEN * args.max_tokens)  # what is encoded
    if args.profiles:
        from engine.measure.eval_profiles import evaluate_profiles, format_table

        table = evaluate_profiles(args.model, text, config, log=log)
        print(json.dumps(table) if args.json else format_table(table))
        return 0
    report = evaluate(args.model, text, config, log=log)
    print(json.dumps(report) if args.json else format_report(report))
    return 0

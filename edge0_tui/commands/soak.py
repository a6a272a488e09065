"""`edge0 soak`: a long conversation, in which memory, threads and open files must stay flat."""

from __future__ import annotations

import argparse
import json

from edge0_tui.commands import options
from edge0_tui.commands.common import print_stderr
from engine import format_bytes

NAME = "soak"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME, help="a long conversation: memory, threads and files stay flat"
    )
    options.add_model(parser)
    parser.add_argument("--turns", type=options.count(1), default=20)
    parser.add_argument("--steps", type=options.count(1), default=2000)
    options.add_mode(parser)
    options.add_expert_cache(parser, default=options.AUTO, auto=True)
    parser.add_argument(
        "--fresh", action="store_true", help="a new conversation every turn (no growing KV cache)"
    )
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from engine.measure.soak import soak

    config = options.engine_config(args)
    log = print_stderr if args.json else print
    report = soak(args.model, config, args.turns, args.steps, progress=log, fresh=args.fresh)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['decode_steps']} decode steps: MLX active drift {report['mlx_active_drift']:+.1%} "
            f"({report['mlx_active_without_kv_drift']:+.1%} without the growing KV cache), "
            f"RSS drift {report['rss_drift']:+.1%} (after warm-up -> end), threads "
            f"{report['thread_growth']:+d}, open files {report['open_file_growth']:+d}; peak "
            f"memory: MLX {format_bytes(report['peak_mlx_bytes'])}, process RSS "
            f"{format_bytes(report['peak_rss_bytes'])}"
        )
    return 0

"""`edge0 serve`: an OpenAI-compatible HTTP server, with the memory wall at /metrics."""

from __future__ import annotations

import argparse
import os

from edge0_tui.commands import options
from engine import Edge0Error, EngineConfig, parse_size

NAME = "serve"

# The API key when --api-key is not given (keeps it out of the process list).
API_KEY_ENV = "EDGE0_API_KEY"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME, help="an OpenAI-compatible HTTP server, with the memory wall at /metrics"
    )
    # Text, not a Path: a Hugging Face repo id or demo is a model too.
    parser.add_argument(
        "model", help="checkpoint directory, Hugging Face repo id, or demo (the model's id)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only)"
    )
    parser.add_argument("--port", type=options.port, default=8080, help="0 picks a free port")
    options.add_mode(parser)
    options.add_k(parser)
    options.add_expert_cache(
        parser,
        default=None,
        metavar="SIZE|auto",
        auto=True,
        help="routed-expert budget, e.g. 512M, 2G, or auto (the default: what the memory plan "
        "leaves; 4M for demo, as the chat)",
    )
    options.add_page_cache(
        parser, help=options.PAGE_CACHE_HELP + " (default: off; 4M for demo, as the chat)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on /v1 and /metrics (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--queue-limit",
        type=options.count(0),
        default=16,
        metavar="N",
        help="requests that may wait behind the one generating; more get 429 (default 16)",
    )
    options.add_exact(parser)
    options.add_adapters(parser)


def run(args: argparse.Namespace) -> int:
    """The model loads on the engine thread while the server already answers (503 until it is
    ready); SIGINT or SIGTERM stops it."""
    from platformdirs import user_cache_path

    from edge0_tui.model_source import check_model
    from edge0_tui.server import open_engine_for, serve_model

    check_model(args.model)  # a one-line error before anything listens
    if args.api_key is not None and not args.api_key.strip():
        raise Edge0Error("--api-key is empty")
    # The demo as the chat serves it: a 4 MB expert cache and page-cache budget show the wall.
    demo = args.model == "demo"
    expert_cache = args.expert_cache or (parse_size("4M") if demo else options.AUTO)
    page_cache = args.page_cache
    if page_cache is None:
        page_cache = parse_size("4M") if demo and args.mode != "resident" else "off"
    config = EngineConfig(
        mode=args.mode,
        **options.expert_cache_config(expert_cache),
        page_cache_bytes=options.page_cache_bytes(page_cache),
        k=args.k,
        exact_kernels=args.exact,
        adapter_dirs=tuple(args.adapters),  # Hub repos are fetched on the engine thread
        data_dir=options.data_dir(),
    )
    open_engine = open_engine_for(args.model, config, user_cache_path("edge0"))
    serve_model(
        args.model,
        open_engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        queue_limit=args.queue_limit,
    )
    return 0

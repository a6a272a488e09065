"""`edge0 serve`: an OpenAI-compatible HTTP server, with the memory wall at /metrics."""

from __future__ import annotations

import argparse
import os

from edge0_tui.commands import options
from engine import Edge0Error, EngineConfig

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
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback only); requests must name it, or a loopback "
        "name, in their Host header (any name on 0.0.0.0 or ::)",
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
        help="require `Authorization: Bearer KEY` on /v1 and /metrics; printable ASCII without "
        f"spaces around it, else refused at start (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--queue-limit",
        type=options.count(0),
        default=16,
        metavar="N",
        help="requests that may wait behind the one generating; more get 429 (default 16)",
    )
    parser.add_argument(
        "--max-batch",
        type=options.count(1),
        default=1,
        metavar="N",
        help="replies that decode together, one forward a step for all (continuous batching: "
        "a request joins at the next step and leaves when it ends; the memory plan counts N KV "
        "caches; a request that finds the batch full waits in the queue). Every mode; each "
        "reply's tokens are the ones it has alone. Drafted requests run alone "
        "(default 1: one at a time)",
    )
    parser.add_argument(
        "--cors",
        "--allow-origin",
        dest="allow_origin",
        action="append",
        default=[],
        type=origin,
        metavar="ORIGIN",
        help="let web pages at ORIGIN (e.g. http://localhost:3000) call the API, with CORS "
        "headers; * allows any; repeatable (off by default). Requests from other pages are "
        "refused (403)",
    )
    parser.add_argument(
        "--max-connections",
        type=options.count(1),
        metavar="N",
        help="open connections at a time (default 256, less when the open-file limit is lower); "
        "more are answered 503 and closed",
    )
    parser.add_argument(
        "--client-timeout",
        type=options.positive_float,
        metavar="SECONDS",
        help="the time a client has to send a request's headers, and then its body (default 30)",
    )
    parser.add_argument(
        "--strict-model-name",
        action="store_true",
        help="refuse (404) a request naming another model than MODEL or edge0; by default any "
        "name is answered by the one model served, and the log says which name was asked",
    )
    options.add_exact(parser)
    options.add_adapters(parser)
    options.add_context(parser)
    options.add_hosts(parser)


def origin(text: str) -> str:
    """--allow-origin: `*`, or scheme://host[:port] as a browser sends it in Origin."""
    value = text.strip().rstrip("/")
    if value == "*":
        return value
    scheme, sep, rest = value.partition("://")
    if scheme.lower() not in ("http", "https") or not sep or not rest or "/" in rest:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an origin: give scheme://host[:port], e.g. http://localhost:3000"
        )
    return value.lower()


def check_api_key(key: str | None) -> None:
    """Refuse a key no client could send (surrounding spaces are dropped from a header's value;
    HTTP headers carry ASCII), rather than serve with a key that never matches. Not stripped:
    the key is a secret, used exactly as given or not at all."""
    if key is None:
        return
    where = f"--api-key (or ${API_KEY_ENV})"
    if not key.strip():
        raise Edge0Error(f"{where} is empty")
    if key != key.strip():
        raise Edge0Error(
            f"{where} has spaces at its start or end, which an Authorization header cannot carry"
        )
    if not (key.isascii() and key.isprintable()):
        raise Edge0Error(
            f"{where} must be printable ASCII: an HTTP header carries no other characters "
            "reliably, so no client could send it"
        )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine `serve` runs (and, with --hosts, every rank): the demo as the chat serves it,
    its small budgets showing the wall."""
    from edge0_tui.model_start import default_budgets

    default_cache, default_page_cache = default_budgets(args.model == "demo", args.mode)
    expert_cache = args.expert_cache or default_cache
    page_cache = default_page_cache if args.page_cache is None else args.page_cache
    return options.engine_config(
        args,
        fetch_adapters=False,  # Hub repos are fetched on the engine thread
        **options.expert_cache_config(expert_cache),
        page_cache_bytes=options.page_cache_bytes(page_cache),
        max_batch=args.max_batch,
    )


def run(args: argparse.Namespace) -> int:
    """The model loads on the engine thread while the server already answers (503 until it is
    ready); SIGINT or SIGTERM stops it."""
    from platformdirs import user_cache_path

    from edge0_tui.model_source import check_model
    from edge0_tui.server import open_engine_for, serve_model

    check_api_key(args.api_key)
    check_model(args.model)  # a one-line error before anything listens
    config = engine_config(args)
    open_engine = open_engine_for(args.model, config, user_cache_path("edge0"))
    serve_model(
        args.model,
        open_engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        queue_limit=args.queue_limit,
        max_batch=args.max_batch,
        origins=tuple(args.allow_origin),
        # None: the server's defaults (limits.py; not imported here, where every command parses)
        max_connections=args.max_connections,
        client_timeout_s=args.client_timeout,
        strict_model_name=args.strict_model_name,
    )
    return 0

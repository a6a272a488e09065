"""`edge0 chat` (the default command): the terminal app.

With `--hosts`, the app is rank 0 (edge0_tui/ranks.py): it runs on this terminal, and the other
ranks follow its replies, writing their lines to a log each instead of over the app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from edge0_tui.model_start import ModelStart, model_start
from engine import LOCAL_HOST, Edge0Error

if TYPE_CHECKING:
    from edge0_tui.app import Edge0App
    from edge0_tui.ranks import Hosts
    from engine import EngineConfig

NAME = "chat"
RANK_LOG = "chat-rank-{rank}.log"  # where a rank other than 0 writes, in the data folder's logs/
# How long rank 0 waits, once the app has ended, for its engine thread to close the engine: that
# close is what tells the other ranks to end.
ENGINE_CLOSE_WAIT_S = 10.0

HOSTS_EPILOG = (
    "With --hosts (ranks on this machine), this terminal shows the app (rank 0); the other ranks "
    f"write their lines to DATA_DIR/logs/{RANK_LOG.format(rank='N')}. A K or mode switch reaches every "
    "rank at the same step; what loads the model again (resident mode, another model) is "
    "refused; quitting the app ends every rank, and a rank that ends stops the others."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        NAME,
        help="chat in the terminal app (the default command)",
        description="Chat with a model in the terminal app.",
        epilog=HOSTS_EPILOG,
    )
    # Text, not a Path: a Hugging Face repo id or demo is a model too.
    parser.add_argument(
        "model",
        nargs="?",
        default="demo",
        help="checkpoint directory, Hugging Face repo id, or demo (the default)",
    )
    options.add_expert_cache(
        parser,
        default=None,
        auto=True,
        help="routed-expert budget, e.g. 512M, 2G, or auto (the default: what the memory plan "
        "leaves; 4M for demo, to show the wall)",
    )
    options.add_page_cache(
        parser,
        default=argparse.SUPPRESS,  # absent: the per-model default below
        help=options.PAGE_CACHE_HELP + " (default: off; 4M for demo)",
    )
    options.add_mode(
        parser,
        default=None,
        help=f"default: the last one used, else {options.DEFAULT_MODE} (the demo: on-demand)",
    )
    options.add_k(parser, help="routing width (default: the last one used, else the model's)")
    options.add_exact(parser)
    options.add_adapters(parser)
    options.add_sampling(parser)  # for this run, over the kept settings
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where chats and trained adapters live (default: $EDGE0_DATA_DIR, else the user "
        "data dir)",
    )
    options.add_hosts(parser)


def run(args: argparse.Namespace) -> int:
    app = build_app(args)
    if getattr(args, "hosts", None) is None:
        app.run()
        return 0
    # Rank 0: the app's end closes the engine, which tells the other ranks to end (the launcher
    # stops one that does not). SIGTERM (the launcher's word that a rank ended) quits the app as
    # Ctrl+Q does, so the terminal is handed back whole.
    with _quits_on_sigterm(app, f"edge0: stopped: a rank ended (their logs: {rank_logs(args)})"):
        app.run()
    app.session.closed.wait(ENGINE_CLOSE_WAIT_S)
    return app.return_code or 0


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine every rank loads (`--hosts`): the app's, its adapters fetched here (the app
    fetches its own on its engine thread). The K and mode come with each of rank 0's replies."""
    return _start(args, fetch_adapters=True).engine_config


def rank_logs(args: argparse.Namespace) -> Path:
    """The folder where ranks other than 0 write their lines (`RANK_LOG`), on their host."""
    from platformdirs import user_data_path

    return (_data_dir(args) or user_data_path("edge0")) / "logs"  # (the app's data folder)


def before_ranks(args: argparse.Namespace, hosts: Hosts) -> None:
    """Before any rank starts: ranks on this machine only (mlx.launch, which reaches others,
    pipes every rank's terminal, and the app needs this one), the model checked as the app
    checks it (one line, not an error in each rank), and where the other ranks' lines go, said
    once."""
    from edge0_tui.model_source import check_model

    if not hosts.here:
        raise Edge0Error(
            f"--hosts {args.hosts}: chat runs its ranks on this machine only (a number, or "
            f"{LOCAL_HOST} hosts): mlx.launch, which reaches other machines, takes every rank's "
            "terminal, and the app needs this one; across machines, run `edge0 serve --hosts` "
            "and chat through it"
        )
    check_model(args.model)
    logs = rank_logs(args) / RANK_LOG.format(rank="N")
    print(f"edge0: the other ranks write to {logs}", file=sys.stderr)


@contextlib.contextmanager
def _quits_on_sigterm(app: Edge0App, message: str):
    """While inside: SIGTERM makes `app` exit (status 1) and say `message` once the terminal is
    back, as Ctrl+Q would, instead of killing the process with the terminal in the app's modes."""

    def quit_app(*_) -> None:
        try:
            loop = asyncio.get_running_loop()  # (a handler runs on the main thread: the app's)
        except RuntimeError:  # not running yet, or any more
            raise SystemExit(128 + signal.SIGTERM) from None
        loop.call_soon_threadsafe(partial(app.exit, return_code=1, message=message))

    before = signal.signal(signal.SIGTERM, quit_app)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _data_dir(args: argparse.Namespace) -> Path | None:
    """One folder for chats and trained adapters (None: the platform's)."""
    return args.data_dir or options.data_dir()


def _start(args: argparse.Namespace, fetch_adapters: bool) -> ModelStart:
    """The mode, K and caches: the command line's over the model's kept choices (model_start)."""
    from platformdirs import user_config_path

    from edge0_tui.preferences import PreferenceStore

    store = PreferenceStore(options.config_dir() or user_config_path("edge0"))
    base = options.engine_config(args, fetch_adapters=fetch_adapters, data_dir=_data_dir(args))
    return model_start(
        args.model,
        store,
        base,
        mode=args.mode,
        k=args.k,
        expert_cache=args.expert_cache,
        page_cache=getattr(args, "page_cache", None),
    )


def build_app(args: argparse.Namespace) -> Edge0App:
    """The app these options ask for, not yet running (tests drive it with Pilot)."""
    # Imported here so that the other commands never import Textual.
    from edge0_tui.app import Edge0App
    from edge0_tui.model_source import check_model

    # A model that cannot be opened is a one-line error here, not a notification in an app.
    check_model(args.model)

    # What the user chose for this model last time; the command line wins for this run.
    start = _start(args, fetch_adapters=False)
    data_dir = _data_dir(args)
    settings = dataclasses.replace(start.stored.generation, **options.sampling(args))
    app = Edge0App(
        model=args.model,
        engine_config=start.engine_config,
        data_dir=data_dir,
        settings=settings,
        preferences=start.preferences,
    )
    app.session.fallback = start.fallback
    return app

"""`edge0 chat` (the default command): the terminal app."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from edge0_tui.model_start import model_start

if TYPE_CHECKING:
    from edge0_tui.app import Edge0App

NAME = "chat"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="chat in the terminal app (the default command)")
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


def run(args: argparse.Namespace) -> int:
    build_app(args).run()
    return 0


def build_app(args: argparse.Namespace) -> Edge0App:
    """The app these options ask for, not yet running (tests drive it with Pilot)."""
    # Imported here so that the other commands never import Textual.
    from platformdirs import user_config_path

    from edge0_tui.app import Edge0App
    from edge0_tui.model_source import check_model
    from edge0_tui.preferences import PreferenceStore

    # A model that cannot be opened is a one-line error here, not a notification in an app.
    check_model(args.model)

    # What the user chose for this model last time; the command line wins for this run.
    store = PreferenceStore(options.config_dir() or user_config_path("edge0"))
    data_dir = args.data_dir or options.data_dir()  # one folder for chats and trained adapters
    # The mode, K and caches: the command line's over the model's kept choices (model_start).
    base = options.engine_config(args, fetch_adapters=False, data_dir=data_dir)
    start = model_start(
        args.model,
        store,
        base,
        mode=args.mode,
        k=args.k,
        expert_cache=args.expert_cache,
        page_cache=getattr(args, "page_cache", None),
    )
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

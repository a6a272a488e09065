"""`edge0 chat` (the default command): the terminal app."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from engine import EngineConfig, parse_size

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

    from edge0_tui.app import DEFAULT_SETTINGS, DEMO_SETTINGS, Edge0App
    from edge0_tui.model_source import DEMO, check_model
    from edge0_tui.preferences import KeptPreferences, PreferenceStore, model_key

    # A model that cannot be opened is a one-line error here, not a notification in an app.
    check_model(args.model)

    # What the user chose for this model last time; the command line wins for this run.
    store = PreferenceStore(options.config_dir() or user_config_path("edge0"))
    key = model_key(args.model)
    kept = KeptPreferences(
        store,
        key,
        store.load(key, DEMO_SETTINGS if key == DEMO else DEFAULT_SETTINGS),
        mode_from_command_line=args.mode is not None,
        k_from_command_line=args.k is not None,
    )
    stored = kept.current
    # The demo model's experts are small and its file fits any page cache: a 4 MB expert cache
    # and a 4 MB page-cache budget make the memory wall visible (cold reads every step).
    demo = key == DEMO  # `demo` or the bundled folder by its path
    # A kept mode is applied once the model is loaded. The demo starts on-demand: its experts are
    # small and its page cache tiny, so each step's misses (the wall it shows) are plain to see,
    # and reading ahead saves it little (docs/benchmarks.md, "Exact lookahead").
    mode = args.mode or ("on-demand" if demo else options.DEFAULT_MODE)
    expert_cache = (
        args.expert_cache
        or stored.expert_cache_bytes
        or (parse_size("4M") if demo else options.AUTO)
    )
    page_cache = getattr(args, "page_cache", stored.page_cache)
    if mode == "resident" and not hasattr(args, "page_cache"):
        page_cache = "off"  # every expert is read into memory at start: no page cache to budget
    if page_cache is None:  # neither given nor kept
        page_cache = parse_size("4M") if demo and mode != "resident" else "off"
    data_dir = args.data_dir or options.data_dir()  # one folder for chats and trained adapters
    config = EngineConfig(
        mode=mode,
        k=args.k,
        **options.expert_cache_config(expert_cache),
        page_cache_bytes=options.page_cache_bytes(page_cache),
        exact_kernels=args.exact,
        adapter_dirs=tuple(args.adapters),  # the session fetches Hub repos on its thread
        data_dir=data_dir,
    )
    settings = dataclasses.replace(stored.generation, **options.sampling(args))
    app = Edge0App(
        model=args.model,
        engine_config=config,
        data_dir=data_dir,
        settings=settings,
        preferences=kept,
    )
    if not args.expert_cache and stored.expert_cache_bytes:  # the kept budget, checked at load
        default = parse_size("4M") if demo else options.AUTO
        app.session.fallback = (
            dataclasses.replace(config, **options.expert_cache_config(default)),
            f"{store.path}: expert_cache_bytes={stored.expert_cache_bytes}",
        )
    return app

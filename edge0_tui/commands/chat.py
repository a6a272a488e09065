"""`edge0 chat` (the default command): the terminal app."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edge0_tui.commands import options
from engine import EngineConfig, parse_size

if TYPE_CHECKING:
    from edge0_tui.app import Edge0App
    from edge0_tui.preferences import KeptPreferences, ModelPreferences, PreferenceStore

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
    base = EngineConfig(
        exact_kernels=args.exact,
        adapter_dirs=tuple(args.adapters),  # the session fetches Hub repos on its thread
        data_dir=data_dir,
    )
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


@dataclass(frozen=True)
class ModelStart:
    """How the app opens a model: its kept choices, and the engine config they make."""

    preferences: KeptPreferences | None  # None: nothing is kept (an app without a store)
    stored: ModelPreferences  # the kept choices (sampling, system prompt), or the defaults
    engine_config: EngineConfig
    # The config to load with, and why, when the kept expert-cache budget breaks the load.
    fallback: tuple[EngineConfig, str] | None = None


def model_start(
    model: str,
    store: PreferenceStore | None,
    base: EngineConfig,
    mode: str | None = None,
    k: int | None = None,
    expert_cache: int | str | None = None,
    page_cache: int | str | None = None,
) -> ModelStart:
    """`model`'s kept choices (from `store`) over `base` (what holds for the whole run: exact
    kernels, the data folder, adapters); `mode`, `k`, `expert_cache`, `page_cache` are the
    command line's, None where not given. At start, and when the app opens another model."""
    from edge0_tui.app import DEFAULT_SETTINGS, DEMO_SETTINGS
    from edge0_tui.model_source import DEMO
    from edge0_tui.preferences import KeptPreferences, ModelPreferences, model_key

    key = model_key(model)
    demo = key == DEMO  # `demo` or the bundled folder by its path
    defaults = DEMO_SETTINGS if demo else DEFAULT_SETTINGS
    kept = None
    stored = ModelPreferences(generation=defaults)
    if store is not None:
        kept = KeptPreferences(
            store,
            key,
            store.load(key, defaults),
            mode_from_command_line=mode is not None,
            k_from_command_line=k is not None,
        )
        stored = kept.current
    # The demo model's experts are small and its file fits any page cache: a small expert cache
    # and page-cache budget make the memory wall visible (cold reads every step).
    # A kept mode is applied once the model is loaded. The demo starts on-demand: its experts are
    # small and its page cache tiny, so each step's misses (the wall it shows) are plain to see,
    # and reading ahead saves it little (docs/notebook/2026-12-exact-lookahead.md).
    mode = mode or ("on-demand" if demo else options.DEFAULT_MODE)
    default_cache = parse_size("4M") if demo else options.AUTO
    budget = expert_cache or stored.expert_cache_bytes or default_cache
    chosen_page_cache = stored.page_cache if page_cache is None else page_cache
    if mode == "resident" and page_cache is None:
        chosen_page_cache = "off"  # every expert is read into memory at start: nothing to budget
    if chosen_page_cache is None:  # neither given nor kept
        chosen_page_cache = parse_size("4M") if demo and mode != "resident" else "off"
    config = dataclasses.replace(
        base,
        mode=mode,
        k=k,
        **options.expert_cache_config(budget),
        page_cache_bytes=options.page_cache_bytes(chosen_page_cache),
    )
    fallback = None
    if not expert_cache and stored.expert_cache_bytes:  # the kept budget, checked at load
        fallback = (
            dataclasses.replace(config, **options.expert_cache_config(default_cache)),
            f"{store.path}: expert_cache_bytes={stored.expert_cache_bytes}",
        )
    return ModelStart(kept, stored, config, fallback)

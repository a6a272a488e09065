"""How a model is opened when nothing says otherwise: the sampling settings, the expert-cache and
page-cache budgets (the demo's small ones), and, for the app, the choices kept for the model.
`edge0 chat`, the app's model picker, `edge0 serve` and `edge0 bench` all decide them here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import EngineConfig, GenerationConfig, parse_size

from .model_source import DEMO
from .preferences import KeptPreferences, ModelPreferences, PreferenceStore, model_key

DEFAULT_SETTINGS = GenerationConfig(max_tokens=512, temperature=0.7, top_p=0.9)
# The demo samples from its own distribution, untrimmed: it learned to answer a speech with one
# speech, and with the usual settings its replies ended too soon to watch the wall or the stop
# key; untrimmed they run several times longer on its suggested prompts
# (tests/test_demo_first_screen.py; figures: docs/notebook/figures-from-code-comments.md). The
# model is unchanged.
DEMO_SETTINGS = GenerationConfig(max_tokens=512, temperature=1.0, top_p=1.0)

DEFAULT_MODE = "prefetch"  # where neither the command line nor the kept choices name one
AUTO = "auto"  # an expert cache of what the memory plan leaves


def expert_cache_config(value: int | str) -> dict:
    """EngineConfig's fields for an --expert-cache value: a byte budget, or "auto"."""
    if value == AUTO:
        return {"expert_cache_auto": True}
    return {"expert_cache_bytes": value, "expert_cache_auto": False}


def page_cache_bytes(value: int | str | None) -> int | None:
    """EngineConfig.page_cache_bytes from a --page-cache value: "off" (or none given) is None."""
    return None if value == "off" else value


# The demo model's experts are small and its file fits any page cache: a small expert cache and
# page-cache budget make the memory wall visible (cold reads every step).
DEMO_BUDGET = "4M"


def default_budgets(demo: bool, mode: str) -> tuple[int | str, int | str]:
    """(expert cache, page-cache budget) where the command line gives none: the demo's small
    ones, else the memory plan's cache (`auto`) and no page-cache budget. A resident run takes
    no page-cache budget: it reads every expert into memory at start."""
    if not demo:
        return AUTO, "off"
    return parse_size(DEMO_BUDGET), "off" if mode == "resident" else parse_size(DEMO_BUDGET)


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
    # A kept mode is applied once the model is loaded. The demo starts on-demand: its experts are
    # small and its page cache tiny, so each step's misses (the wall it shows) are plain to see,
    # and reading ahead saves it little (docs/notebook/2026-12-exact-lookahead.md).
    mode = mode or ("on-demand" if demo else DEFAULT_MODE)
    default_cache, default_page_cache = default_budgets(demo, mode)
    budget = expert_cache or stored.expert_cache_bytes or default_cache
    chosen_page_cache = stored.page_cache if page_cache is None else page_cache
    if mode == "resident" and page_cache is None:
        chosen_page_cache = "off"  # every expert is read into memory at start: nothing to budget
    if chosen_page_cache is None:  # neither given nor kept
        chosen_page_cache = default_page_cache
    config = dataclasses.replace(
        base,
        mode=mode,
        k=k,
        **expert_cache_config(budget),
        page_cache_bytes=page_cache_bytes(chosen_page_cache),
    )
    fallback = None
    if not expert_cache and stored.expert_cache_bytes:  # the kept budget, checked at load
        fallback = (
            dataclasses.replace(config, **expert_cache_config(default_cache)),
            f"{store.path}: expert_cache_bytes={stored.expert_cache_bytes}",
        )
    return ModelStart(kept, stored, config, fallback)

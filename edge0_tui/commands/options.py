"""Options that several commands share: argument types, the engine options (--mode, --k,
--expert-cache, --page-cache, --exact, --adapters), the sampler's (--min-p, the penalties), and
their values as the engine takes them."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# What an option's value means for the engine's config, for every command (decided there).
from edge0_tui.model_start import (  # noqa: F401
    AUTO,
    DEFAULT_MODE,
    expert_cache_config,
    page_cache_bytes,
)
from engine import (
    MAX_SEED,
    MODES,
    Edge0Error,
    EngineConfig,
    format_bytes,
    parse_duration,
    parse_size,
)

# edge0's user data folder (trained adapters, chats) when set; read here, at the top, only.
DATA_DIR_ENV = "EDGE0_DATA_DIR"
CONFIG_DIR_ENV = "EDGE0_CONFIG_DIR"

PAGE_CACHE_HELP = (
    "at most SIZE of the checkpoint's expert bytes stay in the OS page cache (the least recently "
    "read are dropped; on macOS expert reads bypass the cache): a memory wall on a machine whose "
    "RAM holds the checkpoint; off lets the OS decide"
)
ADAPTERS_HELP = (
    "an adapter folder or a Hugging Face repo id (owner/name: only its prerouter_*/lora_* files "
    "are downloaded), searched for K profiles before the model folder and the automatic folder; "
    "repeatable"
)
EXACT_HELP = (
    "today's kernels only (4-bit products everywhere; on-demand token-identical to resident); "
    "default: on the CPU with a fast BLAS, a prefill's routed experts with several tokens are "
    "dequantized and multiplied in fp32 (GEMM speed, logits within a tested bound)"
)
K_HELP = "routing width (default: the model's)"


# -- argument types ------------------------------------------------------------------------------


def size(text: str) -> int:
    """A byte size as `parse_size` reads it (400K, 512M, 2G)."""
    try:
        return parse_size(text)
    except Edge0Error as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size(text: str) -> int:
    """A byte size above 0 (a bandwidth: 0 bytes a second would never read)."""
    value = size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1 byte")
    return value


def sync_cost(text: str) -> float:
    """--sync-cost: a duration as `parse_duration` reads it (`2ms`, `500us`, `0`), at most a second
    (EngineConfig.sync_cost_s): seconds."""
    try:
        seconds = parse_duration(text)
    except Edge0Error as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds > 1.0:
        raise argparse.ArgumentTypeError(f"{text} is more than a second")
    return seconds


def page_cache(text: str) -> int | str:
    """--page-cache: a SIZE, or "off" (the OS decides what stays cached)."""
    if text.strip().lower() in ("off", "none"):
        return "off"
    return size(text)


def utf8(text: str) -> str:
    """Command-line text as given. Python hands over bytes that are not UTF-8 as surrogate escapes
    (U+DC80..U+DCFF), which the tokenizer cannot encode: refuse them here, naming the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) & 0xFF
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 (byte 0x{byte:02x} at character {e.start})"
        ) from None
    return text


def adapter_spec(text: str) -> str:
    """--adapters: a folder or a repo id, never empty (`Path("")` is the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name a folder or a repo id (. for this folder)")
    return utf8(text)


def folder(text: str) -> Path:
    """A folder argument, never empty (`Path("")` is the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name a folder (. for this folder)")
    return Path(text)


def count(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `least` (rounds, tokens, turns, samples)."""

    def at_least(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
        return value

    return at_least


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high` (a seed as MLX takes it, a port)."""

    def between(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be between {low} and {high}")
        return value

    return between


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a learning rate); nan, inf and 0 are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


seed = int_between(0, MAX_SEED)  # an unsigned 64-bit integer
port = int_between(0, 65535)  # 0: a free one


# -- shared options ------------------------------------------------------------------------------


MODEL_HELP = "checkpoint directory, Hugging Face repo id (owner/name), or demo"


def add_model(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """MODEL as every command names it: a checkpoint folder, a Hub repo id or demo. The command
    line (`edge0_tui.cli`) turns it into the checkpoint folder (`model_path`) before the command
    runs, so `args.model` is a Path there. Chat and serve take the name as text (the app and the
    server resolve it on their engine thread, with progress)."""
    parser.add_argument("model", type=utf8, help=help or MODEL_HELP)
    parser.set_defaults(resolve_model=True)


def model_path(spec: str) -> Path:
    """The checkpoint folder MODEL names, as chat and serve resolve it (`resolve_model`): demo,
    a local folder, or a Hub repo (downloaded once into the Hugging Face cache, progress on
    stderr; offline (HF_HUB_OFFLINE), the cached copy). Raises Edge0Error with chat's words."""
    from platformdirs import user_cache_path

    from edge0_tui.model_source import is_hub_id, resolve_model

    offline = False
    if is_hub_id(spec) and not Path(spec).expanduser().exists():
        from huggingface_hub import constants  # imported only for a repo id: it is slow

        offline = constants.HF_HUB_OFFLINE

    progress = StderrProgress()
    source = resolve_model(spec, user_cache_path("edge0"), progress, offline=offline)
    progress.end()
    return source.path


class StderrProgress:
    """A progress callback (`model_source.ProgressCallback`) that keeps one line on stderr when
    it is a terminal: what is happening, bytes done of the total, the rate since this stage
    began and the time left at that rate. Not a terminal: nothing (a log keeps no `\r`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.stage: tuple[str, float, float] | None = None  # (what, done at its start, when)

    def __call__(self, what: str, done: float, total: float | None) -> None:
        if not sys.stderr.isatty():
            return
        print(
            f"\r\x1b[2Kedge0: {self.text(what, done, total)}", end="", file=sys.stderr, flush=True
        )

    def text(self, what: str, done: float, total: float | None) -> str:
        """The line: `what`, and for a byte count `done / total, RATE/s, ETA left`."""
        now = self.clock()
        if self.stage is None or self.stage[0] != what:
            self.stage = (what, done, now)
        if not total:
            return what
        shown = f"{what} {format_bytes(done)} / {format_bytes(total)}"
        _, start_done, start = self.stage
        if now - start < RATE_AFTER_S or done <= start_done:
            return shown
        rate = (done - start_done) / (now - start)
        return f"{shown}, {format_bytes(rate)}/s, {format_eta(max(total - done, 0) / rate)} left"

    def end(self) -> None:
        if sys.stderr.isatty():
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)


# A rate is shown once a stage has run this long (the first chunks say little about it).
RATE_AFTER_S = 1.0


def format_eta(seconds: float) -> str:
    """A time left as a person reads it: `45 s`, `3 min 20 s`, `2 h 05 min`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


# Where the user has not chosen a mode: prefetch, exact (the true router routes) and reading ahead
# what the lookahead guesses, with no trained file needed.
MODES_HELP = (
    "exact: resident, on-demand, prefetch (reads ahead the lookahead's guesses, and a K "
    "profile's predictions where its heads guess as well as the lookahead); approximate: "
    "prerouter (routes by the heads' predictions)"
)


def add_mode(
    parser: argparse.ArgumentParser, default: str | None = DEFAULT_MODE, help: str | None = None
) -> None:
    default_text = f"default: {default}" if default else ""
    help = help or default_text
    parser.add_argument("--mode", choices=MODES, default=default, help=f"{help}. {MODES_HELP}")


def add_k(parser: argparse.ArgumentParser, help: str | None = K_HELP) -> None:
    parser.add_argument("--k", type=int, default=None, help=help)


def add_expert_cache(
    parser: argparse.ArgumentParser,
    default: str | None = "1G",
    help: str | None = None,
    metavar: str | None = None,
    auto: bool = False,
) -> None:
    """--expert-cache: the routed-expert budget. A default given as text goes through `size`
    (argparse converts a string default with the option's type). With `auto`, "auto" is a value
    too: what the memory plan leaves (`expert_cache_config`)."""
    kind = size_or_auto if auto else size
    parser.add_argument("--expert-cache", type=kind, default=default, metavar=metavar, help=help)


def size_or_auto(text: str) -> int | str:
    """--expert-cache: a SIZE, or "auto"."""
    return AUTO if text.strip().lower() == AUTO else size(text)


def add_page_cache(
    parser: argparse.ArgumentParser, default: object = None, help: str = PAGE_CACHE_HELP
) -> None:
    parser.add_argument(
        "--page-cache", type=page_cache, default=default, metavar="SIZE|off", help=help
    )


def add_exact(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exact", action="store_true", help=EXACT_HELP)


def add_context(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        type=count(16),
        metavar="TOKENS",
        help="the longest prompt and reply together a request may have; the memory plan counts "
        "KV caches for it, so a smaller one leaves room for a larger cache or batch (default: the "
        "model's, at most 8192)",
    )


def add_hosts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hosts",
        default=None,
        metavar="N|HOST,HOST|FILE.json",
        help="run as one rank per host, each reading, caching and computing its share of the "
        "routed experts (the same tokens as one process): a number of ranks on this machine, "
        "hosts reached over ssh by mlx.launch, or an mlx.launch hostfile; streamed modes only",
    )
    parser.set_defaults(runs_as_ranks=True)  # the whole command runs once per rank (cli.py)


def add_adapters(parser: argparse.ArgumentParser, help: str = ADAPTERS_HELP) -> None:
    parser.add_argument(
        "--adapters",
        action="append",
        default=[],
        metavar="DIR|REPO_ID",
        type=adapter_spec,
        help=help,
    )


# -- option values as the engine takes them ------------------------------------------------------


# The sampler's options beyond temperature, top-p and top-k, as GenerationConfig names them: the
# same fields as the server's requests, checked once there (their ranges are its).
SAMPLING_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("min_p", "P", "drop tokens less likely than P times the likeliest (0, the default: off)"),
    (
        "repetition_penalty",
        "X",
        "divide the logits of tokens among the last 20 (prompt and reply) by X, multiply if "
        "negative (1, the default: off)",
    ),
    (
        "presence_penalty",
        "X",
        "subtract X from the logits of tokens among the last 20, once (0, the default: off)",
    ),
    (
        "frequency_penalty",
        "X",
        "subtract X from the logits of tokens among the last 20, once per occurrence (0, the "
        "default: off)",
    ),
)


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """--min-p, --repetition-penalty, --presence-penalty, --frequency-penalty (absent: None)."""
    for field, metavar, help in SAMPLING_OPTIONS:
        flag = "--" + field.replace("_", "-")
        parser.add_argument(flag, type=float, default=None, metavar=metavar, help=help)


def sampling(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line, as GenerationConfig fields."""
    given = {field: getattr(args, field, None) for field, _, _ in SAMPLING_OPTIONS}
    return {field: value for field, value in given.items() if value is not None}


def config_dir() -> Path | None:
    """edge0's user config folder (kept settings) from EDGE0_CONFIG_DIR; None: the platform's."""
    value = os.environ.get(CONFIG_DIR_ENV)
    return Path(value).expanduser() if value else None


def data_dir() -> Path | None:
    """edge0's user data folder from EDGE0_DATA_DIR; None: the platform's."""
    value = os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def engine_config(
    args: argparse.Namespace, fetch_adapters: bool = True, **fields: object
) -> EngineConfig:
    """The engine's config from the engine options `args` has (--mode, --k, --expert-cache,
    --page-cache, --eviction, --exact, --adapters, --no-lora, --shadow-router, --context; one
    not given, or
    None, keeps EngineConfig's default), the data folder from the environment, then `fields`
    over them. `fetch_adapters`: Hub repos that --adapters names are downloaded now; False leaves
    them to the engine's thread (the app and the server, which show progress their own way)."""
    given = {name: value for name, value in vars(args).items() if value is not None}
    config: dict = {"data_dir": data_dir()}
    for option, field in (("mode", "mode"), ("k", "k"), ("eviction", "eviction")):
        if option in given:
            config[field] = given[option]
    if "expert_cache" in given:
        config.update(expert_cache_config(given["expert_cache"]))
    if "page_cache" in given:
        config["page_cache_bytes"] = page_cache_bytes(given["page_cache"])
    if "exact" in given:
        config["exact_kernels"] = given["exact"]
    if "adapters" in given:
        specs = given["adapters"]
        config["adapter_dirs"] = adapter_dirs(specs) if fetch_adapters else tuple(specs)
    if "no_lora" in given:
        config["lora"] = not given["no_lora"]
    if "shadow_router" in given:
        config["shadow_router"] = given["shadow_router"]
    if "hosts" in given:
        config["expert_parallel"] = True
    if "context" in given:
        config["context_tokens"] = given["context"]
    return EngineConfig(**{**config, **fields})


def adapter_dirs(specs: list[str]) -> tuple[Path, ...]:
    """The folders `--adapters` names, Hub repos downloaded first (progress on stderr)."""
    from edge0_tui.model_source import resolve_adapters

    progress = StderrProgress()
    dirs = tuple(resolve_adapters(spec, progress) for spec in specs)
    if specs:
        progress.end()
    return dirs

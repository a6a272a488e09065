"""Turning the MODEL argument of `edge0 chat` into a checkpoint directory.

MODEL is one of:
- `demo`: the bundled model in `assets/demo` (a small MoE trained on Shakespeare). Where the
  assets are not installed, a random-weight synthetic checkpoint is written once into the cache
  directory and stands in for it (replies are noise).
- a local directory holding an mlx-lm checkpoint;
- a Hugging Face repo id (`owner/name`), downloaded into the Hugging Face cache. Offline, a copy
  already in the cache is used; without one the error says so.

A local path is looked for first, and a missing one is said to be missing: text that starts like a
path (`.`, `/`, `~`) or whose first part exists here is never sent to the Hub, and an `owner/name`
that is not a local directory says so before the Hub is tried (a typo in a path reads as one).

Writing the synthetic checkpoint runs MLX, so `resolve_model` must run on the engine's thread.

`--adapters DIR|REPO_ID` is turned into an adapter folder the same way (`resolve_adapters`): a
local folder as it is, or, for an `owner/name` that is not a local path, the adapter files only
(`prerouter_*`, `lora_*` safetensors) of that Hub repo, downloaded into the Hugging Face cache.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine import Edge0Error

if TYPE_CHECKING:
    from .hub_download import DownloadPlan

DEMO = "demo"
BUNDLED_DEMO = Path(__file__).resolve().parent.parent / "assets" / "demo"
PANELS_NOTE = "The panels show the real memory wall."  # the app's; `edge0 serve` leaves it out
BUNDLED_NOTICE = (
    "demo: a 24 M-parameter MoE (6 layers x 32 experts, 4-bit) trained on a CPU on Shakespeare; "
    "expect Elizabethan-flavoured, not wise, replies. " + PANELS_NOTE
)
DEMO_FAMILY, DEMO_PRESET = "qwen3_moe", "small"
DEMO_NOTICE = (
    "demo: the bundled model is not installed here, so a random-weight stand-in is used. "
    "Replies are noise; the speed and memory panels are real."
)
# What edge0 needs from a Hub repo: the files mlx-lm's own loader downloads, and the K profiles'
# prerouter and LoRA adapters.
HUB_FILES = [
    "*.json",
    "model*.safetensors",
    "prerouter_*.safetensors",
    "lora_*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
# What an adapters repo is asked for: the K profiles' files, nothing else.
ADAPTER_FILES = ["prerouter_*.safetensors", "lora_*.safetensors"]
# One part of a Hub repo id, as huggingface_hub's validate_repo_id allows it: letters, digits, `_`,
# `-`, `.`, at most 96, not starting or ending with `-` or `.` (and no `--` or `..`, checked apart).
_HUB_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")

# (what is happening, units done, units in total or None when unknown)
ProgressCallback = Callable[[str, float, "float | None"], None]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    name: str  # what the status line calls the model
    notice: str | None = None  # shown once the model is loaded


def resolve_model(
    spec: str, cache_dir: Path, on_progress: ProgressCallback, offline: bool = False
) -> ModelSource:
    """The checkpoint directory MODEL names, writing or downloading it first when needed."""
    if spec == DEMO:
        if (BUNDLED_DEMO / "config.json").exists():
            return ModelSource(BUNDLED_DEMO, DEMO, BUNDLED_NOTICE)
        return ModelSource(demo_checkpoint(cache_dir, on_progress), DEMO, DEMO_NOTICE)
    local = local_path(spec)
    # (lexists: a broken link or a link loop is a path the user named, not a repo id)
    if local.exists() or os.path.lexists(local):
        return ModelSource(local, local.name)  # the engine says what is wrong with a bad checkpoint
    _check_repo_id(spec, local)
    on_progress(f"no local directory {spec}; trying the Hugging Face Hub", 0, None)
    try:
        return ModelSource(download_from_hub(spec, on_progress, offline=offline), spec)
    except Edge0Error as e:
        raise Edge0Error(f"no local directory {spec}; {e}") from None


def local_path(spec: str | Path) -> Path:
    """MODEL as a local path, `~` expanded. `~name` for a user this machine does not know stays as
    written (pathlib raises RuntimeError there), so that it reads as a folder that is missing."""
    try:
        return Path(spec).expanduser()
    except RuntimeError:
        return Path(spec)


def _check_repo_id(spec: str, local: Path) -> None:
    """MODEL is no existing folder: it must read as a Hub repo id, not as a path mistyped."""
    if _names_a_path(spec):
        raise Edge0Error(_missing_path(spec, local))
    if not is_hub_id(spec):
        raise Edge0Error(
            f"{spec!r}: no local directory of that name, and not a Hugging Face model id "
            "(owner/name: letters, digits, '-', '_', '.')"
        )


def is_bundled_demo(path: str | Path) -> bool:
    """True for the bundled demo's folder, however it is named (`assets/demo`, an absolute path,
    a link to it)."""
    local = local_path(path)
    return local.is_dir() and local.resolve() == BUNDLED_DEMO.resolve()


def check_model(spec: str, offline: bool = False) -> None:
    """Raise Edge0Error when MODEL cannot be opened, before the app starts: a local folder that
    holds no checkpoint, a path that does not exist, a name that is no repo id, or a Hub repo
    with no cached copy while offline (`offline` or HF_HUB_OFFLINE). Reads no weights and
    downloads nothing: the app downloads a repo it can reach, with progress."""
    if spec == DEMO:
        return
    local = local_path(spec)
    if local.exists():
        from engine import check_checkpoint

        check_checkpoint(local)  # the engine's own words: "config.json: missing (not an ...)"
        return
    _check_repo_id(spec, local)
    from huggingface_hub import constants

    if offline or constants.HF_HUB_OFFLINE:
        try:
            download_from_hub(spec, lambda *_: None, offline=True)
        except Edge0Error as e:
            raise Edge0Error(f"no local directory {spec}; {e}") from None


def needs_hub_plan(spec: str) -> bool:
    """True for MODEL naming a Hub repo that has no local folder and no complete cached copy,
    while the Hub may be asked: `edge0 info --memory` then plans it from its headers rather than
    downloading it."""
    if spec == DEMO or local_path(spec).exists() or _names_a_path(spec) or not is_hub_id(spec):
        return False
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False  # the cached copy or the offline error, as for every command
    try:
        download_from_hub(spec, lambda *_: None, offline=True)
    except Edge0Error:
        return True
    return False


def resolve_adapters(
    spec: str,
    on_progress: ProgressCallback,
    offline: bool = False,
    cache_dir: Path | None = None,
) -> Path:
    """The adapter folder `--adapters SPEC` names: a local folder (the engine checks what is in
    it), or the adapter files of a Hub repo, downloaded (offline: from the cache)."""
    local = local_path(spec)
    if local.exists() or _names_a_path(spec) or not is_hub_id(spec):
        return local  # a missing folder is reported by the engine, naming it
    return pull_adapters(spec, on_progress, offline=offline, cache_dir=cache_dir).folder


def pull_adapters(
    repo_id: str,
    on_progress: ProgressCallback,
    offline: bool = False,
    cache_dir: Path | None = None,
    revision: str | None = None,
) -> Pulled:
    """The adapter files of Hub repo `repo_id`, downloaded (offline: from the cache); errors
    say `--adapters`."""
    try:
        pulled = pull_from_hub(
            repo_id, on_progress, cache_dir, offline, patterns=ADAPTER_FILES, revision=revision
        )
    except Edge0Error as e:
        raise Edge0Error(f"--adapters {e}") from None
    if not any(any(pulled.folder.glob(pattern)) for pattern in ADAPTER_FILES):
        raise Edge0Error(
            f"--adapters {repo_id}: the Hugging Face repo has no adapter files "
            f"({' or '.join(ADAPTER_FILES)})"
        )
    return pulled


def is_hub_id(spec: str) -> bool:
    """`owner/name` as the Hugging Face Hub spells a model repo."""
    parts = spec.split("/")
    return (
        len(parts) == 2
        and all(_HUB_NAME.fullmatch(part) for part in parts)
        and "--" not in spec
        and ".." not in spec
    )


def _names_a_path(spec: str) -> bool:
    """True for text that can only mean a local path: it starts like one, or its first part
    exists here (`models/qwen` with a `models` directory is a path with a typo, not a repo)."""
    path = Path(spec)
    if spec.startswith((".", "~", os.sep)) or path.is_absolute() or path.drive:
        return True
    return len(path.parts) > 1 and Path(path.parts[0]).exists()


def _missing_path(spec: str, local: Path) -> str:
    """Which part of a local path is missing: the first one that does not exist."""
    missing = local
    for parent in local.parents:
        if parent.exists():
            break
        missing = parent
    return f"{spec}: no such local directory ({os.path.abspath(missing)} does not exist)"


def demo_checkpoint(cache_dir: Path, on_progress: ProgressCallback) -> Path:
    path = cache_dir / f"synthetic-{DEMO_FAMILY}-{DEMO_PRESET}"
    if not (path / "config.json").exists():
        from engine.train.synth import write_synthetic_checkpoint

        on_progress("writing the synthetic demo model (once)", 0, None)
        write_synthetic_checkpoint(path, DEMO_FAMILY, DEMO_PRESET)
    return path


def download_from_hub(
    repo_id: str,
    on_progress: ProgressCallback,
    cache_dir: Path | None = None,
    offline: bool = False,
    patterns: list[str] = HUB_FILES,
    revision: str | None = None,
) -> Path:
    """The repo's snapshot in the Hugging Face cache (the files matching `patterns`),
    downloading what is missing (`pull_from_hub`)."""
    return pull_from_hub(repo_id, on_progress, cache_dir, offline, patterns, revision).folder


@dataclass(frozen=True)
class Pulled:
    """A repo's snapshot folder, and what bringing it here took."""

    folder: Path
    plan: DownloadPlan | None  # None: the cached copy was used without asking the Hub
    received: int = 0  # file bytes transferred


def pull_from_hub(
    repo_id: str,
    on_progress: ProgressCallback,
    cache_dir: Path | None = None,
    offline: bool = False,
    patterns: list[str] = HUB_FILES,
    revision: str | None = None,
) -> Pulled:
    """The repo's snapshot in the Hugging Face cache, the files matching `patterns` downloaded
    first where missing (`edge0_tui.hub_download`: the free space checked before a byte is
    written, an interrupted file resumed where it stopped).

    Offline (or when the Hub cannot be reached), a complete cached copy is used as is.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    from .hub_download import fetch_missing, plan_download

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:  # a ValueError the app would otherwise report as a bug
        raise Edge0Error(f"{repo_id!r}: not a Hugging Face model id ({e})") from None

    def cached_copy(reason: str) -> Pulled:
        try:
            folder = snapshot_download(
                repo_id,
                cache_dir=cache_dir,
                allow_patterns=patterns,
                revision=revision,
                local_files_only=True,
            )
        except LocalEntryNotFoundError:
            raise Edge0Error(f"{repo_id}: {reason}, and no complete copy is cached") from None
        return Pulled(Path(folder), None)

    if offline:
        return cached_copy("offline")
    on_progress(f"looking up {repo_id} on the Hugging Face Hub", 0, None)
    try:
        with _hub_errors(repo_id, revision):
            plan = plan_download(repo_id, patterns, revision, cache_dir)
        # (its own errors, and the progress callback's, such as Ctrl+C, pass as they are)
        received = fetch_missing(plan, on_progress)
        with _hub_errors(repo_id, revision):
            # Every file is in the cache now: this links the snapshot folder and records which
            # commit the revision names (for offline use), fetching no file.
            folder = snapshot_download(
                repo_id,
                cache_dir=cache_dir,
                allow_patterns=patterns,
                revision=revision,
                tqdm_class=_silent_progress_bar(),
            )
    except _HubUnusable as e:
        return cached_copy(str(e))
    return Pulled(Path(folder), plan, received)


class _HubUnusable(Exception):
    """The Hub cannot be asked, or its answer cannot be used: a cached copy may serve."""


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's errors as edge0's: a repo or revision the Hub does not have is an
    Edge0Error; anything else the Hub did wrong is _HubUnusable, saying what."""
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except Edge0Error:
        raise
    except RepositoryNotFoundError:
        raise Edge0Error(
            f"{repo_id}: no such model on the Hugging Face Hub (or it is private: `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise Edge0Error(
            f"{repo_id}: no revision {revision!r} on the Hugging Face Hub (a branch, tag or commit)"
        ) from None
    except LocalEntryNotFoundError as e:  # snapshot_download's: the Hub could not be asked
        raise _HubUnusable(_hub_failure(e.__cause__)) from None
    except OSError as e:  # an HTTP error status (HfHubHTTPError is one), a disk filled up, ...
        raise _HubUnusable(_hub_failure(e)) from None
    except Exception as e:
        if _is_transport_error(e):
            raise _HubUnusable("cannot reach the Hugging Face Hub") from None
        # What huggingface_hub raises on an answer it cannot use: a JSON shape it does not
        # expect (TypeError, KeyError), a redirect loop (its HTTP client's errors), ...
        why = f"the Hugging Face Hub's answer cannot be used ({_one_line(e)})"
        raise _HubUnusable(why) from None


def _hub_failure(error: BaseException | None) -> str:
    """Why the Hub could not be used: the HTTP status it answered, else that it is unreachable."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status:
        return f"the Hugging Face Hub answered HTTP {status}"
    if isinstance(error, OSError) and not _is_transport_error(error):
        return f"download failed ({error.strerror or error})"
    return "cannot reach the Hugging Face Hub"


def _is_transport_error(error: BaseException | None) -> bool:
    """A connection refused, a timeout, a connection dropped (not a redirect loop, which is an
    answer that cannot be used)."""
    import httpx2

    return isinstance(error, httpx2.TransportError)


def _one_line(error: BaseException) -> str:
    """An exception as one short line: its type and its message's first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def _silent_progress_bar() -> type:
    """A tqdm class for `snapshot_download` that shows nothing: its bar counts the files it
    links, which stderr (or the app, which owns the terminal) has no use for."""
    from tqdm import tqdm

    class SilentProgressBar(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.pop("name", None)  # huggingface_hub's own keyword, not tqdm's
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentProgressBar

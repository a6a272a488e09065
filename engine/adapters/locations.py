"""Where a model's adapter files may live, and the order they are searched in.

Adapters need not sit inside the checkpoint (a Hugging Face download is a read-only cache):

1. `--adapters DIR` folders (`EngineConfig.adapter_dirs`), in the order given;
2. the model directory itself (adapters shipped with the checkpoint, e.g. `assets/demo`);
3. the automatic folder `DATA_DIR/adapters/<base fingerprint>` (`DATA_DIR` is
   `EngineConfig.data_dir`, by default the platform's user data folder), where training writes by
   default. Keyed by the fingerprint, so a folder only ever holds one base's adapters.

A K profile found in an earlier folder shadows the same K in a later one (see `profiles.py`).
A folder named with `--adapters` must exist and hold adapter files made for this base; the other
two are searched when they exist and their files are checked when loaded, as always.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_data_path

from ..errors import Edge0Error
from .metadata import check_adapter_metadata, flat_metadata, read_adapter_header

ADAPTER_GLOBS = ("prerouter_*.safetensors", "lora_*.safetensors")
# Where each folder of the search comes from, as `edge0 info` says it.
EXPLICIT, MODEL, AUTO = "--adapters", "model", "auto"


@dataclass(frozen=True)
class AdapterFolder:
    path: Path
    origin: str  # EXPLICIT, MODEL or AUTO


def default_data_dir() -> Path:
    """edge0's user data folder on this platform (e.g. ~/.local/share/edge0 on Linux)."""
    return user_data_path("edge0")


def auto_adapter_dir(fingerprint: str, data_dir: Path | None = None) -> Path:
    """The automatic adapter folder of the base with this fingerprint."""
    return Path(data_dir or default_data_dir()) / "adapters" / fingerprint


def adapter_files(folder: Path) -> list[Path]:
    """The adapter files (`prerouter_*`, `lora_*` safetensors) directly in `folder`, sorted."""
    return sorted(p for pattern in ADAPTER_GLOBS for p in folder.glob(pattern))


def search_folders(
    model_dir: Path,
    fingerprint: str,
    adapter_dirs: tuple[Path, ...] = (),
    data_dir: Path | None = None,
) -> list[AdapterFolder]:
    """The folders searched for this model's adapters, first to last (see the module doc).
    A folder named twice is searched once, at its first place."""
    folders = [AdapterFolder(Path(d).expanduser(), EXPLICIT) for d in adapter_dirs]
    for folder in folders:
        check_explicit_folder(folder.path, fingerprint)
    folders.append(AdapterFolder(Path(model_dir), MODEL))
    auto = auto_adapter_dir(fingerprint, data_dir)
    if auto.is_dir():
        folders.append(AdapterFolder(auto, AUTO))
    unique, seen = [], set()
    for folder in folders:
        key = folder.path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(folder)
    return unique


def check_explicit_folder(folder: Path, fingerprint: str) -> None:
    """A folder named with `--adapters`: it exists, holds adapter files, and every one of them was
    made for this base (checked up front from the headers, so a wrong folder fails at once)."""
    if not folder.is_dir():
        what = "not a folder" if folder.exists() else "no such folder"
        raise Edge0Error(f"--adapters {folder}: {what}")
    files = adapter_files(folder)
    if not files:
        raise Edge0Error(
            f"--adapters {folder}: no adapter files ({' or '.join(ADAPTER_GLOBS)}) in it"
        )
    for path in files:
        meta = flat_metadata(read_adapter_header(path)[1])
        kind = "prerouter" if path.name.startswith("prerouter_") else "lora"
        check_adapter_metadata(meta, kind, fingerprint, path)

"""K profiles: the routing widths a model has adapters for.

A profile is a pair of files in one adapter folder, `prerouter_k{K}.safetensors` and
`lora_k{K}.safetensors`. The reference implementation's `prerouter_<name>.safetensors` (with K in
its metadata) and `lora_<name>.safetensors` are read too. Switching K swaps these files, never the
base.

`k_profiles` says which widths a model can route with, and `chosen_k` which one a run starts
at: both before any weight is read, so that the memory plan is made at the K that will run.

`search_profiles` looks through every adapter folder of a model (`locations.py`: `--adapters`
folders, the model directory, the automatic folder). A K is taken whole from the first folder that
has it, heads and LoRA together (a LoRA is trained on the student path of particular heads, so the
two are never paired across folders); the same K in a later folder is shadowed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..config import HEAD_MODES, EngineConfig
from ..errors import Edge0Error
from .locations import MODEL, AdapterFolder, search_folders
from .metadata import flat_metadata, metadata_int, read_adapter_header


@dataclass(frozen=True)
class AdapterFiles:
    k: int
    prerouter: Path | None
    lora: Path | None
    origin: str = MODEL  # the folder it was found in: "--adapters", "model" or "auto"


@dataclass
class ProfileSearch:
    """Every adapter folder of a model and the K profiles found in them."""

    folders: list[AdapterFolder]
    profiles: dict[int, AdapterFiles]  # K -> the profile used (from the first folder that has K)
    shadowed: list[AdapterFiles] = field(default_factory=list)  # the same K in later folders
    warnings: list[str] = field(default_factory=list)  # adapter files ignored, and why


@dataclass(frozen=True)
class KProfile:
    """A routing width the engine can switch to."""

    k: int
    # True when quality at this K is the model's own (native K on the true router) or recovered by
    # trained adapters; False when the true router is merely narrowed or widened.
    recovered: bool
    prerouter: bool = False  # has prerouter heads (prerouter mode possible)
    lora: bool = False  # has a recovery LoRA


def k_profiles(
    native: int,
    experts: int,
    other_k: bool,
    routed: bool,
    adapters: dict[int, AdapterFiles],
) -> list[KProfile]:
    """The K values a model with `experts` routed experts a layer and `native` K can route with:
    2, 4, 8 and every K with adapter files, or only `native` where the family cannot route
    otherwise (`other_k` False). Heads and LoRA count only where the engine routes the family
    (`routed`). Without adapter files, the true router is narrowed or widened, and quality at
    K other than the native one is not recovered."""
    ks = {k for k in (2, 4, 8, *adapters) if 1 <= k <= experts} | {native}
    if not other_k:
        ks = {native}
    out = []
    for k in sorted(ks):
        files = adapters.get(k)
        has_heads = routed and files is not None and files.prerouter is not None
        has_lora = routed and files is not None and files.lora is not None
        out.append(KProfile(k, k == native or (has_heads and has_lora), has_heads, has_lora))
    return out


def chosen_k(
    requested: int | None, mode: str, native: int, profiles: list[KProfile], model_dir: Path
) -> int:
    """The K a run of `mode` starts at: `requested` if a profile has it (and heads, in a mode
    that routes by them); else the native K, or in those modes the K with heads closest to it.
    Raises Edge0Error naming what is missing."""
    with_heads = [p.k for p in profiles if p.prerouter]
    if requested is None:
        if mode not in HEAD_MODES:
            return native
        if not with_heads:
            raise Edge0Error(
                f"{model_dir}: {mode} mode needs prerouter_k<K>.safetensors files; "
                "train them with `edge0 train heads`"
            )
        return min(with_heads, key=lambda k: (abs(k - native), k))
    if requested not in {p.k for p in profiles}:
        choices = ", ".join(str(p.k) for p in profiles)
        raise Edge0Error(f"K={requested} is not available for this model (choose {choices})")
    if mode in HEAD_MODES and requested not in with_heads:
        heads = ", ".join(map(str, with_heads)) or "none"
        raise Edge0Error(f"no prerouter heads for K={requested} (heads exist for K: {heads})")
    return requested


def search_profiles(model_dir: Path, fingerprint: str, config: EngineConfig) -> ProfileSearch:
    """The K profiles of the model in `model_dir`, over its whole adapter search path."""
    folders = search_folders(Path(model_dir), fingerprint, config.adapter_dirs, config.data_dir)
    search = ProfileSearch(folders, {})
    for folder in folders:
        found = discover_profiles(folder.path, folder.origin, search.warnings)
        for k, files in sorted(found.items()):
            if k in search.profiles:
                search.shadowed.append(files)
            else:
                search.profiles[k] = files
    return search


# K in a file name: ASCII decimal without leading zeros, so one K has one name (`k0004` or an
# Arabic-Indic `k٤` read as K=4 was never paired with `lora_k4`).
_CANONICAL_K = re.compile(r"k(0|[1-9][0-9]*)", re.ASCII)
_ANY_K = re.compile(r"k\d+")  # what looks like a K to a reader: any digits, any script


def _k_of_name(path: Path, suffix: str, warnings: list[str]) -> tuple[bool, int | None]:
    """(whether to read the file, the K its name says): a K written otherwise than canonically
    is not read, with a warning naming the file."""
    if suffix.endswith(".tmp"):  # `x.tmp.safetensors`: a write that never finished, not a K
        warnings.append(f"{path}: ignored: a temporary file (a write that was interrupted)")
        return False, None
    match = _CANONICAL_K.fullmatch(suffix)
    if match:
        return True, int(match.group(1))
    if _ANY_K.fullmatch(suffix):
        warnings.append(
            f"{path}: ignored: K in an adapter file name is ASCII digits without leading zeros "
            "(prerouter_k4.safetensors, lora_k4.safetensors)"
        )
        return False, None
    return True, None


def discover_profiles(
    model_dir: Path, origin: str = MODEL, warnings: list[str] | None = None
) -> dict[int, AdapterFiles]:
    """The K profiles of one adapter folder (the model directory by default); the files ignored
    go to `warnings`, each naming the file and why."""
    warnings = [] if warnings is None else warnings
    profiles: dict[int, AdapterFiles] = {}
    for prerouter in sorted(model_dir.glob("prerouter_*.safetensors")):
        suffix = prerouter.name[len("prerouter_") : -len(".safetensors")]
        read, name_k = _k_of_name(prerouter, suffix, warnings)
        if not read:
            continue
        meta = flat_metadata(read_adapter_header(prerouter)[1])
        meta_k = metadata_int(meta, "K", prerouter)
        k = name_k if name_k is not None else meta_k
        if k is None:
            raise Edge0Error(f"{prerouter}: no K in the file name (prerouter_k4...) or metadata")
        if k < 1:
            raise Edge0Error(f"{prerouter}: K={k} is not a routing width (at least 1)")
        if meta_k is not None and meta_k != k:
            raise Edge0Error(
                f"{prerouter}: the file name says K={k} but its metadata says K={meta_k}"
            )
        if k in profiles:
            raise Edge0Error(
                f"{prerouter}: a second prerouter for K={k} ({profiles[k].prerouter.name})"
            )
        lora = model_dir / f"lora_{suffix}.safetensors"
        profiles[k] = AdapterFiles(k, prerouter, lora if lora.exists() else None, origin)
    paired = {files.lora for files in profiles.values()}
    for lora in sorted(model_dir.glob("lora_k*.safetensors")):
        if lora in paired:
            continue
        read, k = _k_of_name(lora, lora.name[len("lora_") : -len(".safetensors")], warnings)
        if read and k is not None and k not in profiles:
            if k < 1:
                raise Edge0Error(f"{lora}: K={k} is not a routing width (at least 1)")
            profiles[k] = AdapterFiles(k, None, lora, origin)
    return profiles


def profile_bytes(search: ProfileSearch, itemsize: int) -> int:
    """The most memory one K profile's files take once loaded: its heads (held once, see
    `PrerouterHeads.prepare_for_serving`) and its LoRA, every tensor in a compute dtype of
    `itemsize` bytes; from the files' headers. A file that cannot be read counts nothing (it is
    refused when its K is chosen)."""
    largest = 0
    for files in search.profiles.values():
        elements = 0
        for path in (files.prerouter, files.lora):
            if path is None:
                continue
            try:
                entries, _ = read_adapter_header(path)
            except Edge0Error:
                continue
            elements += sum(math.prod(entry.shape) for entry in entries.values())
        largest = max(largest, elements * itemsize)
    return largest

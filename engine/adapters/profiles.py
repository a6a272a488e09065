"""K profiles: the routing widths a model directory has adapters for.

A profile is a pair of files next to the checkpoint, `prerouter_k{K}.safetensors` and
`lora_k{K}.safetensors`. The reference implementation's `prerouter_<name>.safetensors` (with K in
its metadata) and `lora_<name>.safetensors` are read too. Switching K swaps these files, never the
base.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.index import read_safetensors
from ..errors import Edge0Error
from .metadata import flat_metadata, metadata_int


@dataclass(frozen=True)
class AdapterFiles:
    k: int
    prerouter: Path | None
    lora: Path | None


def discover_profiles(model_dir: Path) -> dict[int, AdapterFiles]:
    profiles: dict[int, AdapterFiles] = {}
    for prerouter in sorted(model_dir.glob("prerouter_*.safetensors")):
        suffix = prerouter.name[len("prerouter_") : -len(".safetensors")]
        match = re.fullmatch(r"k(\d+)", suffix)
        meta = flat_metadata(read_safetensors(prerouter)[1])
        meta_k = metadata_int(meta, "K", prerouter)
        k = int(match.group(1)) if match else meta_k
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
        profiles[k] = AdapterFiles(k, prerouter, lora if lora.exists() else None)
    for lora in sorted(model_dir.glob("lora_k*.safetensors")):
        match = re.fullmatch(r"lora_k(\d+)\.safetensors", lora.name)
        if match and int(match.group(1)) not in profiles:
            k = int(match.group(1))
            if k < 1:
                raise Edge0Error(f"{lora}: K={k} is not a routing width (at least 1)")
            profiles[k] = AdapterFiles(k, None, lora)
    return profiles

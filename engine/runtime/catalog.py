"""What a checkpoint folder is, from its config and shard headers (no weights read, no model
built): its family, native K, bytes on disk and the K profiles its adapter search finds. For
`edge0 list`, which shows many models in the time one takes to load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..adapters.profiles import search_profiles
from ..checkpoint.index import base_fingerprint
from ..config import EngineConfig
from .loader import check_checkpoint, routed_top_k


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    family: str  # the mlx-lm architecture
    native_k: int  # experts each token is routed to, as trained
    disk_bytes: int  # the weight shards' bytes
    profiles: dict[int, str]  # K -> the folder its adapter files were found in ("model", ...)
    recovered: tuple[int, ...]  # the K whose profile has both heads and a LoRA

    def as_dict(self) -> dict:
        return {
            "path": str(self.path),
            "family": self.family,
            "native_k": self.native_k,
            "disk_bytes": self.disk_bytes,
            "profiles": {str(k): origin for k, origin in self.profiles.items()},
            "recovered": list(self.recovered),
        }


def summarize_checkpoint(model_dir: str | Path, config: EngineConfig) -> CheckpointSummary:
    """The summary of the checkpoint in `model_dir`; Edge0Error for a folder `load` would refuse
    (`check_checkpoint`'s words). `config` gives the adapter search (data folder, --adapters)."""
    model_dir = Path(model_dir)
    model_config, family, index = check_checkpoint(model_dir)  # the headers, read once
    index.add_moe_layers_by_name()  # the fingerprint covers the routed experts' tensors
    search = search_profiles(model_dir, base_fingerprint(index), config)
    return CheckpointSummary(
        path=model_dir,
        family=family.name,
        native_k=routed_top_k(model_config),
        disk_bytes=sum(shard.stat().st_size for shard in index.shards),
        profiles={k: files.origin for k, files in sorted(search.profiles.items())},
        recovered=tuple(k for k, f in sorted(search.profiles.items()) if f.prerouter and f.lora),
    )

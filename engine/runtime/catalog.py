"""What a checkpoint folder is, from its config and shard headers (no weights read, no model
built): its family, native K, bytes on disk and the K profiles its adapter search finds. For
`edge0 list`, which shows many models in the time one takes to load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..adapters.profiles import search_profiles
from ..checkpoint.families import family_of
from ..checkpoint.index import CheckpointIndex, base_fingerprint, max_checkpoint_tensors
from ..config import EngineConfig
from .loader import check_checkpoint, read_config, routed_top_k


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
    check_checkpoint(model_dir)
    model_config = read_config(model_dir)
    family = family_of(model_config, str(model_dir / "config.json"))
    text = model_config.get("text_config") or model_config
    layers = text.get("num_hidden_layers", model_config.get("num_hidden_layers"))
    index = CheckpointIndex(model_dir, max_checkpoint_tensors(int(layers) if layers else None))
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

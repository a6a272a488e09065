"""The memory plan of a checkpoint from its config.json and shard headers alone: no weight read.

`plan_from_headers(model_dir, config)`, for a header-only copy, takes `load`'s own steps up to
its plan (`check_headers`, `build_model`, `plan_model`: the checked config and family, the shards'
index, mlx-lm's model built lazily, the MoE layers, the compute dtype, the K profiles and the K,
and `plan_load`), so a folder holding only the headers (a Hub repo read by range requests,
`engine.checkpoint.remote`) is planned exactly as a full local copy is. The tokenizer and the
weights' values, which a plan does not depend on, are not looked at.

`plan_hub_model(repo_id, config)` does it for a Hub repo: a header-only copy in a temporary
folder, planned, then removed.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.remote import HubRepo, fetch_header_copy
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from .loader import build_model, check_headers, plan_model
from .memory_plan import MemoryPlan


@dataclass(frozen=True)
class HeaderPlan:
    """What `edge0 info --memory` says of a model planned from its headers."""

    family: str
    layers: int
    moe_layers: int
    experts: int
    native_k: int
    hidden: int
    expert_bytes: int  # every routed expert of every layer, as stored
    checkpoint_bytes: int  # every shard, as stored
    plan: MemoryPlan
    bytes_read: int = 0  # what reading the headers transferred (a Hub repo's)
    model: str = ""  # the repo id (a Hub repo's)

    def verdict_line(self) -> str:
        """Whether the model fits, with the plan's total and K, and what was read to know it."""
        verdict = "fits" if self.plan.fits else "does NOT fit"
        limit = (
            f" of {format_bytes(self.plan.limit_bytes)}"
            if self.plan.limit_bytes is not None
            else ""
        )
        return (
            f"{self.model}: {verdict} this machine: memory plan {format_bytes(self.plan.total_bytes)}"
            f"{limit} at K={self.plan.k} ({self.family}, {format_bytes(self.checkpoint_bytes)}; "
            f"{format_bytes(self.bytes_read)} of headers read, nothing downloaded)"
        )


def plan_from_headers(model_dir: Path, config: EngineConfig) -> HeaderPlan:
    """The plan `load(model_dir, config)` makes, without reading a weight (see the module)."""
    model_config, family, index = check_headers(model_dir)
    model, model_config = build_model(model_dir, model_config, index.shards, family)
    planned = plan_model(model_dir, model, model_config, family, index, config)
    text = model_config.get("text_config") or model_config
    return HeaderPlan(
        family=family.name,
        layers=len(model.layers),
        moe_layers=len(index.layers),
        experts=planned.num_experts,
        native_k=planned.top_k,
        hidden=int(text.get("hidden_size") or 0),
        expert_bytes=index.expert_nbytes,
        checkpoint_bytes=sum(shard.stat().st_size for shard in index.shards),
        plan=planned.plan,
    )


def plan_hub_model(repo_id: str, config: EngineConfig, revision: str | None = None) -> HeaderPlan:
    """The plan of Hub repo `repo_id`, from its config.json, index and shard headers only.
    Errors name the repo and its file, not the temporary folder the headers sit in."""
    repo = HubRepo(repo_id, revision)
    with tempfile.TemporaryDirectory(prefix="edge0-headers-") as folder:
        try:
            planned = plan_from_headers(fetch_header_copy(repo, Path(folder)), config)
        except Edge0Error as e:
            raise Edge0Error(str(e).replace(folder, repo_id)) from None
    return HeaderPlan(**{**planned.__dict__, "bytes_read": repo.bytes_read, "model": repo_id})

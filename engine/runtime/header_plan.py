"""The memory plan of a checkpoint from its config.json and shard headers alone: no weight read.

`plan_from_headers(model_dir, config)`, for a header-only copy (one with no stray shard), takes `load`'s steps up to its plan (the checked config and
family, the shards' index, mlx-lm's model built lazily, the MoE layers, the compute dtype, the K
profiles and the K) and makes the plan with the same `plan_load`, so a folder holding only the
headers (a Hub repo read by range requests, `engine.checkpoint.remote`) is planned exactly as a
full local copy is. The tokenizer and the weights' values, which a plan does not depend on, are
not looked at.

`plan_hub_model(repo_id, config)` does it for a Hub repo: a header-only copy in a temporary
folder, planned, then removed.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

from ..adapters.profiles import chosen_k, k_profiles, profile_bytes, search_profiles
from ..checkpoint.families import check_config_sizes, family_of, find_moe_sites
from ..checkpoint.index import CheckpointIndex, base_fingerprint, max_checkpoint_tensors
from ..checkpoint.remote import HubRepo, fetch_header_copy
from ..config import EngineConfig
from ..errors import Edge0Error
from .blas import dense_prefill_rows
from .loader import check_moe_sites, compute_dtype, read_config, routed_top_k
from .memory_plan import MemoryPlan, largest_expert_weights, plan_load


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


def plan_from_headers(model_dir: Path, config: EngineConfig) -> HeaderPlan:
    """The plan `load(model_dir, config)` makes, without reading a weight (see the module)."""
    model_config = read_config(model_dir)
    family = family_of(model_config, str(model_dir / "config.json"))
    text = model_config.get("text_config") or model_config
    layers = text.get("num_hidden_layers", model_config.get("num_hidden_layers"))
    index = CheckpointIndex(
        model_dir, max_checkpoint_tensors(layers if type(layers) is int else None)
    )
    index.check_stacked_experts()
    shapes = {name: entry.shape for name, entry in index.tensors.items()}
    check_config_sizes(model_config, shapes, str(model_dir / "config.json"))
    model, model_config = _lazy_model(model_dir, family.name)
    sites = find_moe_sites(model)
    check_moe_sites(model, sites, family, model_dir)
    for site in sites:
        site_shapes = {name: tuple(a.shape) for name, a in tree_flatten(site.switch.parameters())}
        index.add_moe_layer(site.layer, site.path, site_shapes["gate_proj.weight"][0], site_shapes)
    float_dtype = compute_dtype(config)
    top_k = routed_top_k(model_config)
    num_experts = index.layers[sites[0].layer].num_experts
    if not 1 <= top_k <= num_experts:
        raise Edge0Error(
            f"{model_dir / 'config.json'}: num_experts_per_tok must be between 1 and the "
            f"{num_experts} routed experts of a layer"
        )
    dense_rows = dense_prefill_rows(config)
    profiles = search_profiles(model_dir, base_fingerprint(index), config)
    usable = k_profiles(top_k, num_experts, family.other_k, family.routing, profiles.profiles)
    k = chosen_k(config.k, config.mode, top_k, usable, model_dir)
    plan, _, _ = plan_load(
        index,
        model_config,
        config,
        float_dtype,
        k,
        largest_expert_weights(sites) if dense_rows is not None else 0,
        dense_rows is not None,
        profile_bytes(profiles, (float_dtype or mx.float32).size),
    )
    return HeaderPlan(
        family=family.name,
        layers=len(model.layers),
        moe_layers=len(index.layers),
        experts=num_experts,
        native_k=top_k,
        hidden=int(text.get("hidden_size") or 0),
        expert_bytes=index.expert_nbytes,
        checkpoint_bytes=sum(shard.stat().st_size for shard in index.shards),
        plan=plan,
    )


def _lazy_model(model_dir: Path, family: str) -> tuple[object, dict]:
    """mlx-lm's model of the header-only copy, built lazily: no weight is read. (`load` points
    mlx-lm at a view of the listed shards only; a header-only copy holds nothing else.)"""
    try:
        return mlx_lm_load_model(model_dir, lazy=True, strict=True)
    except AssertionError as e:  # mlx-lm's own checks of a config (e.g. DeepSeek's topk_method)
        raise Edge0Error(
            f"{model_dir / 'config.json'}: mlx-lm's {family} architecture refuses this config "
            f"({_first_line(e) or 'an assertion in its model code failed'})"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise Edge0Error(
            f"{model_dir}: {family}: checkpoint does not match config.json ({_first_line(e)})"
        ) from None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else ""


def plan_hub_model(repo_id: str, config: EngineConfig, revision: str | None = None) -> HeaderPlan:
    """The plan of Hub repo `repo_id`, from its config.json, index and shard headers only.
    Errors name the repo and its file, not the temporary folder the headers sit in."""
    repo = HubRepo(repo_id, revision)
    with tempfile.TemporaryDirectory(prefix="edge0-headers-") as folder:
        try:
            planned = plan_from_headers(fetch_header_copy(repo, Path(folder)), config)
        except Edge0Error as e:
            raise Edge0Error(str(e).replace(folder, repo_id)) from None
    return HeaderPlan(**{**planned.__dict__, "bytes_read": repo.bytes_read})

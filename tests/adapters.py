"""Helpers that copy a test model and write prerouter and LoRA files with random weights for it."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.adapters.lora import linear_dims, save_lora
from engine.checkpoint.families import FAMILIES
from engine.config import EngineConfig
from engine.routing.prerouter import PrerouterHeads, next_moe_layer, save_prerouter
from engine.runtime.generation import Engine

LORA_TARGETS = (
    "self_attn.q_proj",
    "self_attn.o_proj",
    "attention.query_key_value",
    "attention.dense",
)


def profile_k(family: str, k: int = 4) -> int:
    """The K a test profile of `family` is written for: `k`, or 1 where the family routes to one
    expert only (Llama-4)."""
    return k if FAMILIES[family].other_k else 1


def write_random_profile(model_dir: Path, k: int, seed: int = 0, lora_scale: float = 0.05) -> None:
    """prerouter_k{k} and lora_k{k} files with random weights for the model in `model_dir`."""
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    try:
        loaded = engine.loaded
        mx.random.seed(seed)
        owners = [n for n in sorted(loaded.blocks) if next_moe_layer(n, loaded.blocks)]
        width = loaded.hidden + 2 * loaded.num_experts
        n, e, inner = len(owners), loaded.num_experts, 32
        heads = PrerouterHeads(
            None,
            k,
            owners,
            loaded.hidden,
            e,
            mx.random.normal((n, inner, width)) * 0.3,
            mx.random.normal((n, e, inner)) * 0.3,
            mx.random.normal((n, e, width)) * 0.3,
        )
        save_prerouter(
            model_dir / f"prerouter_k{k}.safetensors", heads, owners[0] + 1, engine.fingerprint
        )
        weights = {}
        for path, module in engine.model.named_modules():
            if path.endswith(LORA_TARGETS):
                d_in, d_out = linear_dims(module)
                a = mx.random.normal((4, d_in)) * lora_scale
                b = mx.random.normal((d_out, 4)) * lora_scale
                weights[path] = (a, b)
        assert weights, "no LoRA targets found"
        save_lora(model_dir / f"lora_k{k}.safetensors", weights, 4, 8.0, k, engine.fingerprint)
    finally:
        engine.close()


def record_executed(engine: Engine) -> dict[int, dict[int, list[int]]]:
    """From now on, the experts every MoE layer executes at each one-token forward, by the
    forward's step (layer -> sorted experts, read on the host here, whether the engine read them
    or kept them on the device). In step order, the forward on the last prompt token is first."""
    forwards: dict[int, dict[int, list[int]]] = {}
    executed = engine.routing.executed

    def recording(layer, x, routed):
        if x.size == x.shape[-1]:
            experts = sorted(np.array(routed).reshape(-1).tolist())
            forwards.setdefault(engine.store.pool.step, {})[layer] = experts
        return executed(layer, x, routed)

    engine.routing.executed = recording
    return forwards


def copy_model(source: Path, tmp_path: Path) -> Path:
    """A copy of the model in `source` as `tmp_path/model` (links copied as links), for a test
    to break."""
    model = tmp_path / "model"
    shutil.copytree(source, model, symlinks=True)
    return model

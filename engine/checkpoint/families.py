"""The model families edge0 runs, and how to find their routed experts.

Every supported family is an mlx-lm architecture whose MoE blocks hold their routed experts in a
`SwitchGLU` at `<block>.switch_mlp`. The loaded block keeps its parameters (gate, shared expert) but
not its routing: `routing.moe_block.RoutedMoE` routes through `routing.functions` (the true router,
or at decode the prerouter's prediction) and streams the experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from ..errors import Edge0Error


@dataclass(frozen=True)
class Family:
    name: str
    router: str  # "softmax-topk" (Qwen) or "sigmoid-group" (Ling / DeepSeek style)
    description: str


FAMILIES = {
    f.name: f
    for f in (
        Family("qwen3_moe", "softmax-topk", "Qwen3-MoE (e.g. Qwen3-30B-A3B)"),
        Family(
            "qwen3_next", "softmax-topk", "Qwen3-Next: Gated DeltaNet + attention, shared expert"
        ),
        Family(
            "qwen3_5_moe", "softmax-topk", "Qwen3.5/3.6-MoE: hybrid linear attention, shared expert"
        ),
        Family(
            "bailing_moe", "sigmoid-group", "Ling / Bailing-MoE: sigmoid group router with bias"
        ),
    )
}


def set_top_k(block: nn.Module, k: int) -> None:
    """Make a family's MoE block route to `k` experts with its own (true) router."""
    if hasattr(block, "gate") and hasattr(block.gate, "top_k"):  # bailing_moe: BailingMoeGate
        block.gate.top_k = k
        block.num_experts_per_tok = k
    else:  # the Qwen families keep k on the block
        block.top_k = k


def family_of(config: dict, where: str) -> Family:
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise Edge0Error(
            f"{where}: model_type {model_type!r} is not supported; edge0 runs "
            + ", ".join(FAMILIES)
        )
    return family


@dataclass(frozen=True)
class MoESite:
    """Where one layer's routed experts live in the loaded model."""

    layer: int
    path: str  # e.g. model.layers.3.mlp.switch_mlp
    parent: nn.Module  # the MoE block
    attribute: str  # "switch_mlp"
    switch: SwitchGLU
    decoder_layer: nn.Module  # the block's parent
    block_attribute: str  # "mlp"


def find_moe_sites(model: nn.Module) -> list[MoESite]:
    """Every routed-expert `SwitchGLU` in the model, by layer."""
    modules = dict(model.named_modules())
    sites = []
    for path, module in modules.items():
        if not isinstance(module, SwitchGLU):
            continue
        match = re.search(r"layers\.(\d+)\.", path)
        parent_path, attribute = path.rsplit(".", 1)
        layer_path, block_attribute = parent_path.rsplit(".", 1)
        if match is None or parent_path not in modules or layer_path not in modules:
            continue
        sites.append(
            MoESite(
                int(match.group(1)),
                path,
                modules[parent_path],
                attribute,
                module,
                modules[layer_path],
                block_attribute,
            )
        )
    return sorted(sites, key=lambda s: s.layer)

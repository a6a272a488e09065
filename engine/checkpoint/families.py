"""The model families edge0 runs, how their config.json sizes match a checkpoint, and how to find
their routed experts.

Every supported family is an mlx-lm architecture whose MoE blocks hold their routed experts in a
`SwitchGLU` at `<block>.switch_mlp`. The loaded block keeps its parameters (gate, shared expert) but
not its routing: `routing.moe_block.RoutedMoE` routes through `routing.functions` (the true router,
or at decode the prerouter's prediction) and streams the experts.
"""

from __future__ import annotations

import math
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


# config.json fields that size the model mlx-lm builds (in any supported family), with their least
# valid value. mlx-lm trusts them: it builds num_hidden_layers layer objects and arrays of these
# sizes before a single weight is compared, so 10**8 layers eats the RAM and 10**9 heads overflows.
SIZE_FIELDS = {
    "num_hidden_layers": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 1,
    "moe_shared_expert_intermediate_size": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "vocab_size": 1,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "num_shared_experts": 0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "decoder_sparse_step": 1,
    "full_attention_interval": 1,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 1,
    "linear_key_head_dim": 1,
    "linear_value_head_dim": 1,
    "linear_conv_kernel_dim": 1,
}
# config.json numbers that are no size but that mlx-lm uses as given: a string or null for them is
# a traceback in the first forward pass, 0 or a negative value NaN in every reply.
POSITIVE_NUMBER_FIELDS = ("rope_theta", "rms_norm_eps")
# Heads times their width is the output width of a projection the checkpoint holds.
HEAD_PRODUCTS = (
    ("num_attention_heads", "head_dim"),
    ("num_key_value_heads", "head_dim"),
    ("linear_num_key_heads", "linear_key_head_dim"),
    ("linear_num_value_heads", "linear_value_head_dim"),
)
# The tensors that fix a size exactly, by name (`model.` may sit under `language_model.`):
# (field, tensor name pattern, what the size is of the tensor, as a message says it).
SIZE_TENSORS = (
    ("hidden_size", re.compile(r"(?:^|\.)model\.norm\.weight$"), "values"),
    ("vocab_size", re.compile(r"(?:^|\.)model\.(?:embed_tokens|word_embeddings)\.weight$"), "rows"),
    ("num_experts", re.compile(r"\.mlp\.gate\.(?:gate_proj\.)?weight$"), "rows (experts)"),
)
MISMATCH = "the checkpoint does not match config.json"
LAYER_NAME = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")


def check_config_sizes(config: dict, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Check config.json's sizes against the checkpoint's tensors (name -> shape) before mlx-lm
    builds anything from them: whole numbers, the layer count and the sizes that a tensor fixes
    exactly, and no other size beyond the largest tensor dimension."""
    scopes = [("", config)]
    if isinstance(config.get("text_config"), dict):  # qwen3_5_moe: the model's sizes live here
        scopes.append(("text_config.", config["text_config"]))
    for prefix, scope in scopes:
        _check_whole_numbers(scope, prefix, where)
        _check_positive_numbers(scope, prefix, where)
    sizes = scopes[-1][1]
    _check_layer_count(sizes, scopes[-1][0], shapes, where)
    for field, pattern, what in SIZE_TENSORS:
        name = next((n for n in sorted(shapes) if pattern.search(n)), None)
        if name is not None and sizes.get(field) not in (None, shapes[name][0]):
            raise Edge0Error(
                f"{where}: {scopes[-1][0]}{field}={sizes[field]} but tensor {name!r} has "
                f"{shapes[name][0]} {what}; {MISMATCH}"
            )
    largest = max((d for shape in shapes.values() for d in shape), default=0)
    for prefix, scope in scopes:
        _check_upper_bounds(scope, prefix, largest, where)


def _check_whole_numbers(scope: dict, prefix: str, where: str) -> None:
    for field, least in SIZE_FIELDS.items():
        value = scope.get(field)
        if value is None:
            continue  # absent: mlx-lm's default, or not a field of this family
        if type(value) is not int:  # also 1e9, which JSON reads as a float
            raise Edge0Error(f"{where}: {prefix}{field}={value!r} is not an integer")
        if value < least:
            raise Edge0Error(f"{where}: {prefix}{field}={value} must be at least {least}")


def _check_positive_numbers(scope: dict, prefix: str, where: str) -> None:
    for field in POSITIVE_NUMBER_FIELDS:
        if field not in scope:
            continue
        value = scope[field]
        number = value if type(value) in (int, float) else None  # not bool, str or null
        if number is None or not math.isfinite(number) or number <= 0:
            raise Edge0Error(f"{where}: {prefix}{field}={value!r} must be a finite number above 0")


def _check_layer_count(sizes: dict, prefix: str, shapes: dict, where: str) -> None:
    layers = {int(m.group(1)) for name in shapes if (m := LAYER_NAME.search(name))}
    count = 1 + max(layers, default=-1)
    if sizes.get("num_hidden_layers") not in (None, count):
        raise Edge0Error(
            f"{where}: {prefix}num_hidden_layers={sizes['num_hidden_layers']} but the checkpoint's "
            f"tensors hold {count} layers; {MISMATCH}"
        )


def _check_upper_bounds(scope: dict, prefix: str, largest: int, where: str) -> None:
    """No size, nor heads times their width, can exceed the largest dimension of any tensor: the
    weights of a layer of that size would have it."""
    for field in SIZE_FIELDS:
        if (scope.get(field) or 0) > largest:
            raise Edge0Error(
                f"{where}: {prefix}{field}={scope[field]} is larger than any tensor dimension of "
                f"the checkpoint (the largest is {largest})"
            )
    for heads, width in HEAD_PRODUCTS:
        if scope.get(heads) and scope.get(width) and scope[heads] * scope[width] > largest:
            raise Edge0Error(
                f"{where}: {prefix}{heads} x {width} = {scope[heads] * scope[width]} is larger "
                f"than any tensor dimension of the checkpoint (the largest is {largest})"
            )


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

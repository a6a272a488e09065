"""The model families edge0 runs, how their config.json sizes match a checkpoint, and how to find
their routed experts.

Every supported family is an mlx-lm architecture whose MoE blocks hold their routed experts in a
`SwitchGLU` at `<block>.switch_mlp`. The loaded block keeps its parameters (gate, shared expert) but
not its routing: `routing.moe_block.RoutedMoE` routes through `routing.functions` (the true router,
or at decode the prerouter's prediction) and streams the experts.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import MODEL_REMAPPING

from ..errors import Edge0Error
from .index import brief


@dataclass(frozen=True)
class Family:
    name: str  # the mlx-lm architecture (`mlx_lm/models/<name>.py`)
    description: str
    # The engine has this family's routing function (`routing.moe_block.FAMILY_OPS`): K profiles,
    # prerouter, and prefetch with heads. Without it the family's own block routes (on-demand,
    # resident, and prefetch by the lookahead's guesses from its gate).
    routing: bool = True
    # K other than the native one (Llama-4's block scales the expert input by one score: K=1).
    other_k: bool = True

    @property
    def modes(self) -> tuple[str, ...]:
        if self.routing:
            return ("resident", "on-demand", "prerouter", "prefetch")
        return ("resident", "on-demand", "prefetch")


# The families with the engine's routing (listed by `edge0 info` and the README's table).
FAMILIES = {
    f.name: f
    for f in (
        Family("qwen3_moe", "Qwen3-MoE"),
        Family("qwen3_next", "Qwen3-Next: Gated DeltaNet + attention"),
        Family("qwen3_5_moe", "Qwen3.5/3.6-MoE: hybrid linear attention"),
        Family("bailing_moe", "Ling / Bailing-MoE: sigmoid group router"),
        Family("gpt_oss", "gpt-oss: mxfp4 experts with biases"),
        Family("glm4_moe", "GLM-4.5/4.6: sigmoid group router"),
        Family("deepseek_v3", "DeepSeek-V3 / Kimi-K2: MLA, group router"),
        Family("mixtral", "Mixtral: softmax over the top-k logits"),
        Family("llama4", "Llama-4: top-1 sigmoid, shared expert", other_k=False),
        Family("minimax", "MiniMax-M2: sigmoid router with bias"),
        Family("qwen2_moe", "Qwen2-MoE / Qwen1.5-MoE"),
        Family("olmoe", "OLMoE"),
        Family("ernie4_5_moe", "ERNIE-4.5-MoE"),
    )
}
# An mlx-lm architecture name is a module name; anything else in model_type is refused unread.
ARCHITECTURE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def family_of(config: dict, where: str) -> Family:
    """The family of a config.json: one of FAMILIES, or any other mlx-lm architecture (streamed
    with its own router, if its routed experts turn out to be a `SwitchGLU`). `model_type`
    aliases are mapped as mlx-lm maps them (kimi_k2 -> deepseek_v3, minimax_m2 -> minimax)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not ARCHITECTURE_NAME.match(model_type):
        raise Edge0Error(f"{where}: model_type {brief(model_type, 40)} is not a model type")
    name = MODEL_REMAPPING.get(model_type, model_type)
    if name in FAMILIES:
        return FAMILIES[name]
    supported = (
        f"{where}: model_type {model_type!r} is not supported: {{why}}; edge0 runs "
        + ", ".join(FAMILIES)
        + " and, on demand, any other mlx-lm MoE family whose experts are a SwitchGLU"
    )
    if importlib.util.find_spec(f"mlx_lm.models.{name}") is None:
        raise Edge0Error(supported.format(why="mlx-lm has no such architecture"))
    try:
        module = importlib.import_module(f"mlx_lm.models.{name}")
    except Exception as e:  # a model file that needs a package this install lacks, or is broken
        raise Edge0Error(
            supported.format(why=f"mlx-lm's {name} cannot be imported ({e})")
        ) from None
    if not hasattr(module, "SwitchGLU"):  # the architecture never builds routed GLU experts
        why = "its routed experts are a SwitchMLP (two projections, no gate)"
        if not hasattr(module, "SwitchMLP"):
            why = f"mlx-lm's {name} is not a mixture-of-experts architecture"
        raise Edge0Error(supported.format(why=why))
    return Family(name, f"mlx-lm {name} (its own router)", routing=False, other_k=False)


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
    # the other MoE families' names for the same sizes (Mixtral, gpt-oss, MiniMax, Llama-4: local
    # experts; DeepSeek, GLM: routed experts; ERNIE: moe_*), and DeepSeek's attention ranks
    "num_local_experts": 1,
    "n_routed_experts": 1,
    "n_shared_experts": 0,
    "moe_num_experts": 1,
    "moe_k": 1,
    "moe_num_shared_experts": 0,
    "moe_layer_start_index": 0,
    "moe_layer_freq": 1,
    "interleave_moe_layer_step": 1,
    "intermediate_size_mlp": 1,
    "q_lora_rank": 1,
    "kv_lora_rank": 1,
    "qk_rope_head_dim": 1,
    "qk_nope_head_dim": 1,
    "v_head_dim": 1,
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
    ("n_routed_experts", re.compile(r"\.mlp\.gate\.weight$"), "rows (experts)"),
    ("moe_num_experts", re.compile(r"\.mlp\.gate\.weight$"), "rows (experts)"),
    (
        "num_local_experts",
        re.compile(r"\.(?:block_sparse_moe\.gate|mlp\.router|feed_forward\.router)\.weight$"),
        "rows (experts)",
    ),
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

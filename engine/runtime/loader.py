"""Load a checkpoint with mlx-lm's own architecture classes, with or without its routed experts.

`resident` mode is stock mlx-lm: every weight in memory (the oracle and the baseline).
`on-demand` mode loads the same model lazily, swaps every `switch_mlp` for a `StreamingSwitchGLU`
before anything is evaluated, then evaluates the rest: the stacked expert tensors are never read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer
from transformers.utils import logging as hf_logging

from ..checkpoint.families import Family, MoESite, family_of, find_moe_sites
from ..checkpoint.index import CheckpointIndex, read_safetensors_header
from ..config import EngineConfig
from ..errors import Edge0Error
from ..experts.store import ExpertStore
from ..experts.switch_glu import StreamingSwitchGLU, projection_specs
from ..routing.moe_block import RoutedMoE, ops_for
from ..routing.state import RoutingState

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    family: Family
    index: CheckpointIndex
    sites: list[MoESite]  # the MoE layers (their original SwitchGLU in resident mode)
    store: ExpertStore | None  # None in resident mode
    float_dtype: mx.Dtype | None
    top_k: int
    num_layers: int
    hidden: int
    num_experts: int
    routing: RoutingState | None  # None in resident mode (stock mlx-lm blocks route themselves)
    blocks: dict[int, RoutedMoE]  # layer -> the engine-routed MoE block (empty in resident mode)


def compute_dtype(config: EngineConfig) -> mx.Dtype | None:
    """float32 on CPU (bf16/fp16 activations make 4-bit matmuls 8-40x slower there), else as saved."""
    if config.dtype is not None:
        return getattr(mx, config.dtype)
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else None


def read_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise Edge0Error(f"{model_dir}: no such model directory")
    path = model_dir / "config.json"
    if not path.exists():
        raise Edge0Error(f"{path}: missing (not an mlx-lm checkpoint directory?)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise Edge0Error(f"{path}: cannot read ({e.strerror or e})") from None
    except RecursionError:
        raise Edge0Error(f"{path}: invalid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise Edge0Error(f"{path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise Edge0Error(f"{path}: expected a JSON object")
    if not isinstance(config.get("text_config", {}), dict):
        raise Edge0Error(f"{path}: text_config is not a JSON object")
    context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    if context is not None and _positive_int(context) is None:
        raise Edge0Error(f"{path}: max_position_embeddings={context!r} is not a positive integer")
    return config


def _positive_int(value: object) -> int | None:
    """`int(value)` as the engine reads config numbers, or None when that fails or is below 1."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number >= 1 else None


def routed_top_k(config: dict) -> int:
    text_config = config.get("text_config", config)
    value = text_config.get("num_experts_per_tok", config.get("num_experts_per_tok", 0))
    return _positive_int(value) or 0


def load(model_dir: str | Path, config: EngineConfig) -> LoadedModel:
    model_dir = Path(model_dir)
    model_config = read_config(model_dir)
    if "model_file" in model_config:
        raise Edge0Error(
            f"{model_dir / 'config.json'}: asks to run the checkpoint's own Python "
            f"({model_config['model_file']!r}); edge0 never runs code that comes with a model"
        )
    family = family_of(model_config, str(model_dir / "config.json"))
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        raise Edge0Error(
            f"{model_dir}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    index = CheckpointIndex(model_dir)  # validates every shard header before mlx-lm reads a byte
    # mlx-lm loads every model*.safetensors, also those the index does not list.
    for shard in sorted(model_dir.glob("model*.safetensors")):
        if shard not in index.shards:
            read_safetensors_header(shard)
    index.check_stacked_experts()

    try:
        model, model_config = mlx_lm_load_model(model_dir, lazy=True, strict=True)
    except (ValueError, KeyError, TypeError) as e:
        raise Edge0Error(
            f"{model_dir}: checkpoint does not match config.json ({_one_line(e)})"
        ) from None
    _check_dtypes(model, index, model_dir)
    try:
        tokenizer = quiet_load_tokenizer(model_dir, model_config.get("eos_token_id"))
    except Exception as e:  # tokenizers raise many types for a broken file
        raise Edge0Error(f"{model_dir}: cannot load the tokenizer ({_one_line(e)})") from None

    sites = find_moe_sites(model)
    if not sites:
        raise Edge0Error(f"{model_dir}: no routed-expert layers found in this {family.name} model")
    float_dtype = compute_dtype(config)
    top_k = routed_top_k(model_config)

    for site in sites:
        shapes = {name: tuple(a.shape) for name, a in tree_flatten(site.switch.parameters())}
        index.add_moe_layer(site.layer, site.path, shapes["gate_proj.weight"][0], shapes)

    num_experts = index.layers[sites[0].layer].num_experts
    if not 1 <= top_k <= num_experts:
        raise Edge0Error(
            f"{model_dir / 'config.json'}: num_experts_per_tok must be between 1 and the "
            f"{num_experts} routed experts of a layer"
        )
    store, routing, blocks = None, None, {}
    if config.mode != "resident":
        store = ExpertStore(index, config, float_dtype)  # the Engine checks the budget for its K
        routing = RoutingState(top_k, num_experts, blocks, float_dtype)
        ops = ops_for(family.router)
        for site in sites:
            specs = projection_specs(site.switch, f"{model_dir} layer {site.layer}")
            streaming = StreamingSwitchGLU(
                store, site.layer, num_experts, specs, site.switch.activation
            )
            setattr(site.parent, site.attribute, streaming)
            block = RoutedMoE(site.parent, site.layer, ops, routing)
            setattr(site.decoder_layer, site.block_attribute, block)
            blocks[site.layer] = block
    hidden = _hidden_size(index.layers[sites[0].layer])

    if float_dtype is not None:
        model.set_dtype(float_dtype)
    mx.eval(model.parameters())
    return LoadedModel(
        model,
        tokenizer,
        model_config,
        family,
        index,
        sites,
        store,
        float_dtype,
        top_k,
        len(model.layers),
        hidden,
        num_experts,
        routing,
        blocks,
    )


def _one_line(error: Exception, limit: int = 400) -> str:
    """A library's error message on one line, cut to `limit` characters (lists of names get long)."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_dtypes(model: nn.Module, index: CheckpointIndex, model_dir: Path) -> None:
    """Refuse tensors whose dtype the layer cannot compute with (mlx-lm checks only shapes):
    a quantized layer's packed weight is uint32, every other parameter is floating point."""
    modules = dict(model.named_modules())
    for name, array in tree_flatten(model.parameters()):
        owner_path, _, attribute = name.rpartition(".")
        owner = modules.get(owner_path)
        quantized = hasattr(owner, "bits") and hasattr(owner, "group_size")
        if quantized and attribute == "weight":
            if array.dtype == mx.uint32:
                continue
            need = "U32 (packed quantized weights, as config.json quantizes this layer)"
        elif quantized and attribute == "scales" and getattr(owner, "mode", "affine") != "affine":
            continue  # microscaling modes keep integer scales
        elif mx.issubdtype(array.dtype, mx.floating):
            continue
        else:
            need = "a floating-point dtype"
        entry = index.tensors.get(name)
        where, dtype = (model_dir, array.dtype) if entry is None else (entry.file, entry.dtype)
        raise Edge0Error(f"{where}: tensor {name!r} is {dtype} but must be {need}")


def quiet_load_tokenizer(model_dir: Path, eos_token_ids) -> TokenizerWrapper:
    """mlx-lm's tokenizer loader, without transformers' warning about model types it has no class
    for (e.g. bailing_moe): the tokenizer itself loads fine."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = load_tokenizer(model_dir, eos_token_ids=eos_token_ids)
        # Our loops feed the model in chunks; the tokenizer's length warning does not apply.
        tokenizer._tokenizer.model_max_length = 1 << 62
        return tokenizer
    finally:
        hf_logging.set_verbosity(previous)


def _hidden_size(layer_experts) -> int:
    """Width of the residual stream: the output rows of a routed expert's down projection."""
    down = next(
        t for t in layer_experts.tensors if t.projection == "down_proj" and t.part == "weight"
    )
    return down.entry.shape[1]

"""Load a checkpoint with mlx-lm's own architecture classes, with or without its routed experts.

`resident` mode is stock mlx-lm: every weight in memory (the oracle and the baseline).
`on-demand` mode loads the same model lazily, swaps every `switch_mlp` for a `StreamingSwitchGLU`
before anything is evaluated, then evaluates the rest: the stacked expert tensors are never read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging as hf_logging

from ..adapters.metadata import nonfinite_tensors
from ..adapters.profiles import (
    ProfileSearch,
    chosen_k,
    k_profiles,
    profile_bytes,
    search_profiles,
)
from ..checkpoint.families import Family, MoESite, check_config_sizes, family_of, find_moe_sites
from ..checkpoint.index import (
    CheckpointIndex,
    base_fingerprint,
    brief,
    check_directory,
    check_regular_file,
    list_dir,
    max_checkpoint_tensors,
    parse_json,
    read_json_file,
)
from ..config import EngineConfig
from ..errors import Edge0Error
from ..experts.freed_memory import return_large_frees_to_os
from ..experts.share import ExpertShare
from ..experts.store import ExpertStore
from ..experts.switch_glu import (
    DensePrefillSwitchGLU,
    StreamingSwitchGLU,
    dense_prefill_linears,
    projection_specs,
)
from ..host_reads import HostReads
from ..routing.moe_block import RoutedMoE, ops_for
from ..routing.prerouter import PrerouterHeads, load_profile_heads
from ..routing.state import RoutingState
from ..trace import NO_TRACE, Tracer
from .blas import dense_prefill_rows
from .memory_plan import MemoryPlan, largest_expert_weights, plan_load

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Files of a model directory that the config and tokenizer loaders (transformers) may open, by
# suffix: each must be a regular file, since opening a FIFO blocks forever.
LOADER_SUFFIXES = (".json", ".jinja", ".txt", ".model")
# The model's two ends (`model.` may sit under `language_model.`), whose quantization scales are
# checked at load with the small tensors.
OUTPUT_ENDS = re.compile(r"(?:^|\.)(?:lm_head|embed_tokens|word_embeddings)$")
TEMPLATES_DIR = "additional_chat_templates"  # transformers also reads every template in here
# JSON files of the tokenizer, read by transformers: each must hold a JSON object.
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)
_SPECIAL_TOKEN = ((str, dict, type(None)), "a string, an object or null")
# tokenizer_config.json fields whose type transformers assumes: field -> (types, as said).
TOKENIZER_CONFIG_TYPES = {
    "added_tokens_decoder": ((dict,), "a JSON object"),
    "additional_special_tokens": ((list,), "a list"),
    "chat_template": ((str, list), "a string or a list of named templates"),
    "model_max_length": ((int, float), "a number"),
    **{
        f"{kind}_token": _SPECIAL_TOKEN
        for kind in ("bos", "eos", "unk", "pad", "sep", "cls", "mask")
    },
}


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
    top_k: int  # the checkpoint's own (native) K
    num_layers: int
    hidden: int
    num_experts: int
    routing: RoutingState | None  # None in resident mode (stock mlx-lm blocks route themselves)
    blocks: dict[int, RoutedMoE]  # layer -> the engine-routed MoE block (empty in resident mode)
    memory_plan: MemoryPlan
    host_reads: HostReads  # every wait of the host on the device goes through it, counted
    engine_config: EngineConfig  # the config the plan is kept with (`plan_load`)
    plan_at: Callable[[int], MemoryPlan]  # the plan at another routing width
    fingerprint: str  # `base_fingerprint`: what adapters for this model record
    # The K profiles over the adapter search, as found when planning (the plan holds the largest).
    profiles: ProfileSearch
    k: int  # the K the run starts at, which the memory plan is made for (`chosen_k`)

    def load_heads(
        self, path: Path, fingerprint: str, k: int, dtype: mx.Dtype | None = None
    ) -> PrerouterHeads:
        """A prerouter file's heads for this model, checked against it (the engine, the student
        path and phase 1's comparison all load heads this one way); weights in `dtype`, by
        default the compute dtype."""
        return load_profile_heads(
            path,
            self.num_layers,
            self.hidden,
            self.num_experts,
            fingerprint,
            k,
            {site.layer for site in self.sites},
            dtype or self.float_dtype or mx.float32,
        )


def compute_dtype(config: EngineConfig) -> mx.Dtype | None:
    """float32 on CPU (bf16/fp16 activations make 4-bit matmuls many times slower there), else as saved."""
    if config.dtype is not None:
        return getattr(mx, config.dtype)
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else None


def read_config(model_dir: Path) -> dict:
    check_directory(model_dir, missing="no such model directory")
    path = model_dir / "config.json"
    check_regular_file(path, missing="missing (not an mlx-lm checkpoint directory?)")
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise Edge0Error(f"{path}: expected a JSON object")
    if not isinstance(config.get("text_config", {}), dict):
        raise Edge0Error(f"{path}: text_config is not a JSON object")
    context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    if context is not None and (type(context) is not int or context < 1):  # not 4096.0 nor true
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
    value = text_config.get("num_experts_per_tok", config.get("num_experts_per_tok"))
    if value is None:
        value = text_config.get("moe_k", 0)  # ERNIE-4.5
    return _positive_int(value) or 0


def check_headers(model_dir: Path) -> tuple[dict, Family, CheckpointIndex]:
    """`check_checkpoint` for a copy of a checkpoint's config and shard headers only (no
    tokenizer, no weights: `header_plan`)."""
    return _checked(model_dir, tokenizer=False)


def check_checkpoint(model_dir: str | Path) -> tuple[dict, Family, CheckpointIndex]:
    """Raise Edge0Error for a directory `load` would refuse before building anything: config,
    family, tokenizer and shard files, shard headers, config sizes. Reads headers, no weights;
    returns what it read (the config, the family, the shards' index)."""
    return _checked(Path(model_dir))


def _checked(model_dir: Path, tokenizer: bool = True) -> tuple[dict, Family, CheckpointIndex]:
    """`tokenizer`: check the tokenizer's files too (False for a copy of the headers only,
    which a memory plan reads without a tokenizer)."""
    model_config = read_config(model_dir)
    if "model_file" in model_config:
        raise Edge0Error(
            f"{model_dir / 'config.json'}: asks to run the checkpoint's own Python "
            f"({model_config['model_file']!r}); edge0 never runs code that comes with a model"
        )
    family = family_of(model_config, str(model_dir / "config.json"))
    if tokenizer:
        check_loader_files(model_dir)
    # Validates every shard header before mlx-lm reads a byte, bounded by the layer count.
    text = model_config.get("text_config") or model_config
    layers = _positive_int(text.get("num_hidden_layers", model_config.get("num_hidden_layers")))
    index = CheckpointIndex(model_dir, max_checkpoint_tensors(layers))
    index.check_stacked_experts()
    shapes = {name: entry.shape for name, entry in index.tensors.items()}
    check_config_sizes(model_config, shapes, str(model_dir / "config.json"))
    return model_config, family, index


@dataclass(frozen=True)
class ModelPlan:
    """What `plan_model` finds before any weight is read: the MoE layers, the compute dtype,
    the native and the chosen K, the K profiles, and the memory plan with the config that keeps
    it (`plan_load`'s)."""

    sites: list[MoESite]
    float_dtype: mx.Dtype | None
    top_k: int
    num_experts: int
    dense_rows: int | None
    fingerprint: str
    profiles: ProfileSearch
    k: int
    plan: MemoryPlan
    config: EngineConfig
    plan_at: Callable[[int], MemoryPlan]


def plan_model(
    model_dir: Path,
    model: nn.Module,
    model_config: dict,
    family: Family,
    index: CheckpointIndex,
    config: EngineConfig,
) -> ModelPlan:
    """`load`'s steps from mlx-lm's (lazy) model to its memory plan, reading no weight: also
    what plans a model from its headers alone (`header_plan`)."""
    sites = find_moe_sites(model)
    check_moe_sites(model, sites, family, model_dir)
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
    dense_rows = dense_prefill_rows(config)
    # The K profiles' files: the largest one's heads and LoRA are planned (any may be chosen).
    fingerprint = base_fingerprint(index)
    profiles = search_profiles(model_dir, fingerprint, config)
    # The K the run starts at: the plan is made for it (a prerouter run plans its heads' K).
    usable = k_profiles(top_k, num_experts, family.other_k, family.routing, profiles.profiles)
    k = chosen_k(config.k, config.mode, top_k, usable, model_dir)
    # Before any weight is read: the plan, and the config that keeps it (or a refusal).
    plan, config, plan_at = plan_load(
        index,
        model_config,
        config,
        float_dtype,
        k,
        largest_expert_weights(sites) if dense_rows is not None else 0,
        dense_rows is not None,
        profile_bytes(profiles, (float_dtype or mx.float32).size),  # heads' dtype, `load_heads`
    )
    return ModelPlan(
        sites,
        float_dtype,
        top_k,
        num_experts,
        dense_rows,
        fingerprint,
        profiles,
        k,
        plan,
        config,
        plan_at,
    )


def load(model_dir: str | Path, config: EngineConfig, tracer: Tracer = NO_TRACE) -> LoadedModel:
    model_dir = Path(model_dir)
    return_large_frees_to_os()  # freed read buffers go back to the OS, not to thread arenas
    model_config, family, index = _checked(model_dir)

    model, model_config = build_model(model_dir, model_config, index.shards, family)
    _check_dtypes(model, index, model_dir)
    tokenizer = quiet_load_tokenizer(model_dir, model_config, family)
    p = plan_model(model_dir, model, model_config, family, index, config)
    sites, float_dtype, top_k, num_experts = p.sites, p.float_dtype, p.top_k, p.num_experts
    plan, config, plan_at, dense_rows = p.plan, p.config, p.plan_at, p.dense_rows
    fingerprint, profiles, k = p.fingerprint, p.profiles, p.k
    _check_finite(model, sites, index, model_dir)  # before the swap below renames the blocks
    store, routing, blocks = None, None, {}
    host_reads = HostReads(config.sync_cost_s)
    if dense_rows is not None:
        dense_prefill_linears(model)  # attention, shared experts, routers: dense from 4 rows
    if config.mode == "resident" and dense_rows is not None:
        for site in sites:  # resident prefill on the same path as the streamed modes' (fair A/B)
            with contextlib.suppress(Edge0Error):  # experts not quantized: stock mlx-lm
                specs = projection_specs(site.switch, f"{model_dir} layer {site.layer}")
                dense = DensePrefillSwitchGLU(site.switch, specs, dense_rows, host_reads)
                setattr(site.parent, site.attribute, dense)
    if config.expert_parallel and config.mode == "resident":
        raise Edge0Error("resident mode holds every expert: ranks share experts in streamed modes")
    if config.mode != "resident":
        # The Engine checks the expert cache for its K (`ExpertStore.set_top_k`).
        store = ExpertStore(index, config, float_dtype, tracer, host_reads)
        if config.expert_parallel:
            if not family.routing:
                raise Edge0Error(
                    f"{model_dir}: {family.name} routes with its own block here, so its experts "
                    "cannot be shared between ranks"
                )
            store.share = ExpertShare.joined(host_reads)
        routing = RoutingState(top_k, num_experts, blocks, float_dtype, host_reads, tracer)
        for site in sites:
            specs = projection_specs(site.switch, f"{model_dir} layer {site.layer}")
            streaming = StreamingSwitchGLU(
                store, site.layer, num_experts, specs, site.switch.activation, dense_rows
            )
            setattr(site.parent, site.attribute, streaming)
            if family.routing:  # else the family's own block routes, calling the streamed experts
                block = RoutedMoE(site.parent, site.layer, ops_for(family.name), routing)
                setattr(site.decoder_layer, site.block_attribute, block)
                blocks[site.layer] = block
    hidden = _hidden_size(index.layers[sites[0].layer])

    if float_dtype is not None:
        model.set_dtype(float_dtype)
    mx.eval(model.parameters())
    if store is not None and config.page_cache_bytes is not None:
        # Only now: reading the resident weights above pulled neighbouring expert pages in
        # (readahead), and a budget starts by dropping every expert page.
        store.set_page_cache_budget(config.page_cache_bytes)
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
        plan,
        host_reads,
        config,
        plan_at,
        fingerprint,
        profiles,
        k,
    )


def check_loader_files(model_dir: Path) -> None:
    """Before any loader opens a file of the directory: it can be listed, it has a tokenizer, and
    every file a config or tokenizer loader may open is a regular file (not a FIFO or a device)."""
    names = list_dir(model_dir)
    if not any(name in names for name in TOKENIZER_FILES):
        raise Edge0Error(
            f"{model_dir}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})"
        )
    for name in names:
        if name.endswith(LOADER_SUFFIXES):
            check_regular_file(model_dir / name)
    templates = model_dir / TEMPLATES_DIR
    if TEMPLATES_DIR in names and templates.is_dir():
        for name in list_dir(templates):
            check_regular_file(templates / name)


def check_moe_sites(
    model: nn.Module, sites: list[MoESite], family: Family, model_dir: Path
) -> None:
    """Refuse, by family and reason, a model whose routed experts edge0 cannot stream exactly."""
    if not sites:
        if any(isinstance(m, SwitchMLP) for _, m in model.named_modules()):
            raise Edge0Error(
                f"{model_dir}: {family.name}: its routed experts are a SwitchMLP (two projections, "
                "no gate), which edge0 does not stream"
            )
        raise Edge0Error(
            f"{model_dir}: {family.name}: no routed experts in a SwitchGLU under a layer; "
            "edge0 streams only mixture-of-experts models"
        )
    for site in sites:
        if type(site.switch) is not SwitchGLU:  # a variant may compute its experts otherwise
            raise Edge0Error(
                f"{model_dir}: {family.name}: layer {site.layer}'s experts are a "
                f"{type(site.switch).__name__}, a SwitchGLU variant edge0 does not stream"
            )


def build_model(
    model_dir: Path, config: dict, shards: list[Path], family: Family
) -> tuple[nn.Module, dict]:
    """mlx-lm's `load_model` on exactly these shards and this (checked) config.

    mlx-lm reads config.json again and every model*.safetensors it finds, including shards the
    index does not list (a stray shard would silently override tensors). So it is pointed at a
    private directory holding the config as read here and links to the listed shards only. MLX
    opens each file as it loads it, so the links are not needed once `load_model` returns."""
    config = {**config}
    if (eos := _generation_eos(model_dir)) is not None:
        config["eos_token_id"] = eos  # what mlx-lm's load_config takes from generation_config.json
    try:
        with tempfile.TemporaryDirectory(prefix="edge0-load-") as view:
            _write_view(Path(view), model_dir, config, shards)
            return mlx_lm_load_model(Path(view), lazy=True, strict=True)
    except AssertionError as e:  # mlx-lm's own checks of a config (e.g. DeepSeek's topk_method)
        raise Edge0Error(
            f"{model_dir / 'config.json'}: mlx-lm's {family.name} architecture refuses this "
            f"config ({_one_line(e) or 'an assertion in its model code failed'})"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise Edge0Error(
            f"{model_dir}: {family.name}: checkpoint does not match config.json ({_one_line(e)})"
        ) from None
    except OSError as e:
        raise Edge0Error(f"{model_dir}: cannot read the checkpoint ({_one_line(e)})") from None


def _write_view(view: Path, model_dir: Path, config: dict, shards: list[Path]) -> None:
    """What mlx-lm may read of the checkpoint, in `view`: config.json and the listed shards."""
    (view / "config.json").write_text(json.dumps(config))
    for number, shard in enumerate(shards):
        os.symlink(os.path.abspath(shard), view / f"model-{number:05d}.safetensors")
    quantization = model_dir / "hf_quant_config.json"  # ModelOpt exports keep it apart
    if quantization.is_file():
        os.symlink(os.path.abspath(quantization), view / quantization.name)


def _generation_eos(model_dir: Path) -> object | None:
    """`eos_token_id` of generation_config.json; like mlx-lm, an unreadable file is ignored."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    try:
        generation = parse_json(path.read_bytes())
    except (OSError, ValueError):
        return None
    return (generation.get("eos_token_id") or None) if isinstance(generation, dict) else None


def _check_finite(
    model: nn.Module, sites: list[MoESite], index: CheckpointIndex, model_dir: Path
) -> None:
    """Refuse NaN or infinity in the resident small tensors: norms, routers, biases and every
    other floating parameter outside a quantized matrix (whose packed weights cannot hold NaN,
    and whose scales are many), and the scales of the two ends, the embedding and the output
    head: the numerical guard repairs hidden states, not logits, and a NaN logit makes every
    token 0. One NaN in a norm or a router turns every reply into garbage; the numerical guard
    reports what this leaves out, at run time."""
    modules = dict(model.named_modules())
    routers = tuple(site.path.rsplit(".", 1)[0] + ".gate." for site in sites)
    experts = tuple(site.path + "." for site in sites)  # streamed, never resident
    small = {}
    for name, array in tree_flatten(model.parameters()):
        owner_path, _, attribute = name.rpartition(".")
        owner = modules.get(owner_path)
        quantized = hasattr(owner, "bits") and hasattr(owner, "group_size")
        small_part = (
            not quantized
            or attribute == "bias"
            or name.startswith(routers)
            or (attribute in ("scales", "biases") and OUTPUT_ENDS.search(owner_path) is not None)
        )
        if small_part and not name.startswith(experts):
            small[name] = array
    for name in nonfinite_tensors(small)[:1]:
        entry = index.tensors.get(name)
        raise Edge0Error(
            f"{entry.file if entry else model_dir}: tensor {name!r} holds NaN or infinite values"
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


def quiet_load_tokenizer(model_dir: Path, config: dict, family: Family) -> TokenizerWrapper:
    """mlx-lm's tokenizer loader, without transformers' warning about model types it has no class
    for (e.g. bailing_moe): the tokenizer itself loads fine. A failure names the file at fault
    when a check of the tokenizer's files finds it."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with _tokenizer_view(model_dir, config, family) as folder:
            tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raise many types for a broken file
        _diagnose_tokenizer(model_dir)
        _diagnose_config(model_dir, e)
        files = " / ".join(n for n in TOKENIZER_JSON[:2] if (model_dir / n).is_file())
        raise Edge0Error(
            f"{model_dir}: cannot load the tokenizer from {files or 'its files'} ({_one_line(e)})"
        ) from None
    finally:
        hf_logging.set_verbosity(previous)
    # Our loops feed the model in chunks; the tokenizer's length warning does not apply.
    tokenizer._tokenizer.model_max_length = 1 << 62
    return tokenizer


@contextlib.contextmanager
def _tokenizer_view(model_dir: Path, config: dict, family: Family):
    """The folder transformers reads the tokenizer from: the model's own, or, for a model_type
    alias transformers has no config class for (kimi_k2: Kimi-K2 ships its own code), a view whose
    config.json says the family's name. transformers reads config.json too, and for an unknown
    model type builds a generic config that fails on DeepSeek's yarn rope fields."""
    model_type = config.get("model_type")
    if model_type == family.name or model_type in CONFIG_MAPPING:
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="edge0-tokenizer-") as view:
        for name in list_dir(model_dir):
            if name != "config.json":
                os.symlink(os.path.abspath(model_dir / name), Path(view) / name)
        (Path(view) / "config.json").write_text(json.dumps({**config, "model_type": family.name}))
        yield Path(view)


def _diagnose_tokenizer(model_dir: Path) -> None:
    """After the tokenizer failed to load: raise an Edge0Error naming the file at fault and what
    is wrong with it, when these checks find it (transformers' own messages name neither)."""
    for name in TOKENIZER_JSON:
        path = model_dir / name
        if not path.is_file():
            continue
        data = read_json_file(path, "cannot load the tokenizer (invalid JSON: {})")
        if not isinstance(data, dict):
            raise Edge0Error(f"{path}: cannot load the tokenizer (expected a JSON object)")
        if name in ("tokenizer_config.json", "special_tokens_map.json"):
            for field, (types, said) in TOKENIZER_CONFIG_TYPES.items():
                if field in data and not isinstance(data[field], types):
                    raise Edge0Error(
                        f"{path}: cannot load the tokenizer ({field}={brief(data[field])} is not "
                        f"{said})"
                    )
        if name == "tokenizer.json":
            for key, kind in (("model", dict), ("added_tokens", list)):
                if not isinstance(data.get(key), kind):
                    raise Edge0Error(
                        f"{path}: cannot load the tokenizer ({key!r} is missing or not a JSON "
                        f"{'object' if kind is dict else 'list'}: not a Hugging Face tokenizer file)"
                    )
            try:
                Tokenizer.from_file(str(path))
            except Exception as e:
                raise Edge0Error(
                    f"{path}: cannot load the tokenizer (the tokenizers library refuses it: "
                    f"{_one_line(e)})"
                ) from None


def _diagnose_config(model_dir: Path, error: Exception) -> None:
    """After the tokenizer failed to load and its own files look sound: transformers reads and
    validates config.json to load a tokenizer too (e.g. max_position_embeddings of 4096.0, a
    rope_scaling without its factor). When config.json alone fails the same way, it is the file
    to name."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        if _one_line(e) == _one_line(error):
            raise Edge0Error(
                f"{model_dir / 'config.json'}: transformers refuses it ({_one_line(e)})"
            ) from None


def _hidden_size(layer_experts) -> int:
    """Width of the residual stream: the output rows of a routed expert's down projection."""
    down = next(
        t for t in layer_experts.tensors if t.projection == "down_proj" and t.part == "weight"
    )
    return down.entry.shape[1]

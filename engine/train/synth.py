"""Synthetic MoE checkpoints: random weights, real formats, no downloads.

`write_synthetic_checkpoint(out_dir, family, preset, seed)` writes a directory that
stock `mlx_lm.utils.load` opens offline and generates from:

- ``config.json``: the family's config as its released checkpoints write it (HF field
  names), with the ``quantization`` block that ``mlx_lm.utils.quantize_model`` produced:
  4-bit affine, group 64, routers 8-bit; gpt-oss as its conversions ship, experts mxfp4
  (group 32) and every other layer 8-bit affine (group 64), recorded per layer.
- ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards (<= 2 GiB each)
  and ``model.safetensors.index.json`` (``weight_map`` + ``metadata.total_size``).
  Experts are stacked per layer with leading dimension E, under the family's own names:
  ``...layers.N.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`` for most,
  ``block_sparse_moe.switch_mlp`` (Mixtral, MiniMax), ``mlp.experts`` (gpt-oss),
  ``feed_forward.experts`` (Llama-4).
- ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained on the
  stdlib's ``pydoc_data.topics`` text, with ChatML special tokens and chat template.

The model is built with mlx-lm's own classes, so every tensor name and shape is the
one mlx-lm expects. Construction is lazy in MLX: nothing is computed until a shard is
written, and shards are evaluated one module at a time, so the multi-gigabyte "wall"
preset never holds the whole model in memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from pydoc_data.topics import topics

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import Edge0Error
from .synth_families import (
    FAMILIES,
    FAMILY_CONFIGS,
    PRESETS,
    SHAPES,
    family_presets,
)

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# BPE trainers put special tokens first, in order, so their ids are fixed.
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)

QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MAX_SHARD_BYTES = 2 << 30
# Written last into every synthetic checkpoint: marks a directory this module may overwrite.
MARKER_FILE = "edge0_synthetic.json"  # per file, header included
# Bounds on safetensors header sizes: a fixed part (length, metadata) and, per
# tensor, its JSON entry apart from the name (dtype, shape, data offsets).
SAFETENSORS_HEADER_BYTES = 1024
SAFETENSORS_ENTRY_BYTES = 128
GROUP_SIZE = 64
BITS = 4
# Routers (and Qwen's shared-expert gates) are kept at 8 bits: a 4-bit router flips close calls.
ROUTER_QUANT = {"group_size": GROUP_SIZE, "bits": 8}
# The router Linears of the families without a quant_predicate of their own.
ROUTER_PATHS = ("mlp.gate", "block_sparse_moe.gate", "feed_forward.router", "shared_expert_gate")
# gpt-oss ships its experts in mxfp4 (OpenAI's release format, which mlx-lm keeps packed) and
# its mlx conversions quantize the rest to 8-bit affine.
GPT_OSS_EXPERT_QUANT = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
GPT_OSS_OTHER_QUANT = {"group_size": GROUP_SIZE, "bits": 8, "mode": "affine"}

# Router weights are multiplied by this before quantization. mlx-lm's default Linear
# init gives logits with std ~0.6: softmax weights over the top-k come out nearly
# flat (which experts win is unchanged: top-k is scale-free). Logits with std ~2.3
# give peaked weights like a trained router, and spread bailing's sigmoid scores
# well beyond the expert bias, which then shifts only the close calls.
ROUTER_SCALE = 4.0
# Element std of the token embeddings (mlx-lm's init gives 1/sqrt(hidden)). Each
# random layer adds ~0.3-0.6 std of mostly token-independent signal to the residual
# stream; with tiny embeddings that common part drowns the token identity, so deep
# layers route every token to the same experts and greedy decoding repeats one token.
EMBED_STD = 0.5
# std of bailing's expert-bias: large enough to shift close calls, small next to the
# sigmoid score spread so the token, not the bias, decides the experts.
EXPERT_BIAS_STD = 0.05


def _model_config(family: str, preset: str = "tiny") -> dict:
    """The unquantized config.json dict of `family` at `preset`."""
    if family not in FAMILY_CONFIGS:
        raise Edge0Error(f"unknown family {family!r}; valid families: {', '.join(FAMILIES)}")
    if preset not in SHAPES:
        raise Edge0Error(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    if preset not in family_presets(family):
        raise Edge0Error(
            f"family {family!r} has no {preset!r} preset; its presets: "
            + ", ".join(family_presets(family))
        )
    config = FAMILY_CONFIGS[family](SHAPES[preset])
    config["eos_token_id"] = EOS_TOKEN_ID
    if "text_config" in config:
        config["text_config"]["eos_token_id"] = EOS_TOKEN_ID
    return config


def write_synthetic_checkpoint(
    out_dir: str | Path,
    family: str,
    preset: str = "tiny",
    seed: int = 0,
    fit: Callable[[nn.Module], None] | None = None,
) -> Path:
    """Write config.json, model*.safetensors (+ model.safetensors.index.json), tokenizer files into out_dir; return out_dir.

    `fit(model)`, if given, trains the float32 model in place before it is cast and quantized:
    a checkpoint that has learned something (tests/agent_model.py: one that calls a tool)."""
    config = _model_config(family, preset)
    out_dir = Path(out_dir)
    marker = out_dir / MARKER_FILE
    # Never overwrite what is not ours: the writer deletes stale model*.safetensors.
    if out_dir.exists() and any(out_dir.iterdir()) and not marker.exists():
        raise Edge0Error(
            f"{out_dir} exists and is not a synthetic checkpoint; choose an empty directory"
        )
    _write_checkpoint(out_dir, config, seed, MAX_SHARD_BYTES, fit)
    build_tokenizer(out_dir, SHAPES[preset]["vocab"])
    marker.write_text(json.dumps({"family": family, "preset": preset, "seed": seed}) + "\n")
    return out_dir


def _write_checkpoint(
    out_dir: Path, config: dict, seed: int, max_shard_bytes: int, fit=None
) -> None:
    """Build the model for `config` and write its weights and config.json."""
    model, quantized_config = _build_model(config, seed, fit)
    weights = dict(tree_flatten(model.parameters()))
    # Drop the model so that `weights` holds the only reference to each tensor and a
    # shard's memory is freed as soon as it is on disk.
    del model
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(out_dir, weights, max_shard_bytes)
    save_config(quantized_config, out_dir / "config.json")


def _build_model(config: dict, seed: int = 0, fit=None) -> tuple[nn.Module, dict]:
    """The quantized random model of `config` (lazy; trained by `fit` first if given), and its
    config with quantization."""
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    _shape_init(model)
    if fit is not None:
        fit(model)
    _cast(model, mx.bfloat16)
    # quantize_model prints a bits-per-weight line; keep test and benchmark output clean.
    with contextlib.redirect_stdout(io.StringIO()):
        model, quantized_config = _quantize(model, config)
    model.eval()
    return model, quantized_config


def _quantize(model: nn.Module, config: dict) -> tuple[nn.Module, dict]:
    """Quantize `model` the way its family's mlx checkpoints are (see GPT_OSS_*_QUANT)."""
    if config["model_type"] == "gpt_oss":
        # Every layer gets an explicit entry, so config.json names each layer's mode.
        return quantize_model(
            model, config, group_size=GROUP_SIZE, bits=8, quant_predicate=_gpt_oss_quant
        )
    # The family's own predicate where it has one (Qwen, bailing, MiniMax: routers 8-bit).
    predicate = getattr(model, "quant_predicate", None) or _router_8bit
    return quantize_model(
        model, config, group_size=GROUP_SIZE, bits=BITS, quant_predicate=predicate
    )


def _router_8bit(path: str, _module: nn.Module) -> dict | bool:
    # DeepSeek-V3's and GLM-4.5's MoEGate is no Linear: it is never quantized at all.
    return dict(ROUTER_QUANT) if path.endswith(ROUTER_PATHS) else True


def _gpt_oss_quant(path: str, _module: nn.Module) -> dict:
    is_expert = path.endswith(
        tuple(f"mlp.experts.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
    )
    return dict(GPT_OSS_EXPERT_QUANT if is_expert else GPT_OSS_OTHER_QUANT)


# Each family's router when it is a Linear: `mlp.gate` (Qwen, OLMoE, ERNIE),
# `block_sparse_moe.gate` (Mixtral, MiniMax), `mlp.router` (gpt-oss), `feed_forward.router`
# (Llama-4).
ROUTER_LINEARS = ("mlp.gate", "block_sparse_moe.gate", "mlp.router", "feed_forward.router")


def _shape_init(model: nn.Module) -> None:
    """Scale embeddings and router weights, give expert / correction biases random values."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            scale = EMBED_STD * module.weight.shape[-1] ** 0.5
            module.weight = module.weight * scale
        if path.endswith(ROUTER_LINEARS) and isinstance(module, nn.Linear):
            module.weight = module.weight * ROUTER_SCALE
        elif path.endswith("mlp.gate") and "gate_proj" in module:
            # bailing: the Linear is `mlp.gate.gate_proj`, next to `expert_bias`.
            module.gate_proj.weight = module.gate_proj.weight * ROUTER_SCALE
            if module.get("expert_bias") is not None:
                shape = module.expert_bias.shape
                module.expert_bias = EXPERT_BIAS_STD * mx.random.normal(shape)
        elif path.endswith("mlp.gate") and "weight" in module:
            # DeepSeek-V3 / GLM-4.5: MoEGate holds a raw weight that mlx-lm initializes to zeros
            # (every token would pick the same experts); draw it as a Linear would be, scaled.
            bound = module.weight.shape[-1] ** -0.5
            weight = mx.random.uniform(-bound, bound, module.weight.shape)
            module.weight = ROUTER_SCALE * weight
        # DeepSeek-V3 / GLM-4.5 (in MoEGate) and MiniMax (on the MoE block): selection-only bias,
        # zeros at init; kept float32 by the family's cast_predicate.
        if "e_score_correction_bias" in module:
            shape = module.e_score_correction_bias.shape
            module.e_score_correction_bias = EXPERT_BIAS_STD * mx.random.normal(shape)


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast float parameters to `dtype`, skipping those the model keeps in float32.

    Mirrors mlx_lm.convert: some models (bailing's expert_bias, qwen3.5's A_log)
    expose a `cast_predicate` for parameters that must stay float32.
    """
    castable = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, value: mx.array) -> mx.array:
        if castable(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


def natural_key(name: str) -> list:
    """Sort key that orders layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_shards(weights: dict[str, mx.array], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shard files of at most `max_shard_bytes` each.

    Tensors of one module (weight, scales, biases) stay together: they come out of
    one quantize op, so evaluating one computes all of them. Only a module larger
    than the limit makes a bigger file (one of its own). `nbytes` is known from shape
    and dtype without evaluating the lazy arrays (`wall.py` plans with plain sizes:
    anything with `nbytes` will do).
    """
    modules: dict[str, list[str]] = {}
    for name in sorted(weights, key=natural_key):
        modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    shards: list[list[str]] = []
    size = 0
    for names in modules.values():
        # Data plus an upper bound on the names' JSON header entries in the file.
        nbytes = sum(weights[n].nbytes + len(n) + SAFETENSORS_ENTRY_BYTES for n in names)
        if not shards or size + nbytes > max_shard_bytes:
            shards.append([])
            size = SAFETENSORS_HEADER_BYTES
        shards[-1].extend(names)
        size += nbytes
    return shards


def write_weights(out_dir: Path, weights: dict[str, mx.array], max_shard_bytes: int) -> None:
    """Evaluate and write `weights` shard by shard, plus model.safetensors.index.json.

    Arrays are popped from `weights` as they are written, so at most one shard (and
    one module's intermediates) is in memory when the caller holds no other reference.
    """
    # mlx-lm loads every model*.safetensors in the folder: stale shards of an earlier
    # write with another shard count would be loaded too.
    for old in out_dir.glob("model*.safetensors"):
        old.unlink()
    shards = plan_shards(weights, max_shard_bytes)
    total_size = sum(v.nbytes for v in weights.values())
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        if len(shards) == 1:
            file_name = "model.safetensors"
        else:
            file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        shard: dict[str, mx.array] = {}
        for name in names:
            shard[name] = weights.pop(name)
            # Evaluate one tensor at a time so only one expert stack's float32 init
            # is live at once (the wall preset's are large).
            mx.eval(shard[name])
        mx.save_safetensors(str(out_dir / file_name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(names, file_name))
        del shard
    index = {
        "metadata": {"total_size": total_size},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")


def train_tokenizer_json(texts: list[str], vocab_size: int) -> str:
    """tokenizer.json text: a byte-level BPE of `vocab_size` trained on `texts`, special tokens
    first (so EOS_TOKEN gets EOS_TOKEN_ID)."""
    # Qwen's pipeline (NFC, regex split, byte level). transformers rebuilds it from
    # the vocab for some model types (qwen3_5_moe -> Qwen3_5Tokenizer) instead of
    # reading tokenizer.json, so any other pre-tokenizer would encode differently.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, so any text encodes even if the corpus lacks a byte.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:
        raise RuntimeError("tokenizer trainer did not put special tokens first")
    return tokenizer.to_str()


# Tokenizers trained on Python's docs, by vocab size; training is deterministic, so one
# training per process serves every synthetic checkpoint.
_PYDOC_TOKENIZER_JSON: dict[int, str] = {}


def _pydoc_tokenizer_json(vocab_size: int) -> str:
    if vocab_size not in _PYDOC_TOKENIZER_JSON:
        texts = [topics[k] for k in sorted(topics)]
        _PYDOC_TOKENIZER_JSON[vocab_size] = train_tokenizer_json(texts, vocab_size)
    return _PYDOC_TOKENIZER_JSON[vocab_size]


def build_tokenizer(out_dir: Path, vocab_size: int = 1024, texts: list[str] | None = None) -> None:
    """Write tokenizer.json (trained on `texts`, default Python's docs) and tokenizer_config.json
    (ChatML) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trained = (
        _pydoc_tokenizer_json(vocab_size)
        if texts is None
        else train_tokenizer_json(texts, vocab_size)
    )
    (out_dir / "tokenizer.json").write_text(trained)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def write_synthetic_teacher(
    out_dir: str | Path, family: str, preset: str = "tiny", seed: int = 0
) -> Path:
    """The float (bf16) model that `synth.write_synthetic_checkpoint(.., family, preset, seed)`
    quantized: the same seeded construction without the quantization, so the 4-bit checkpoint is
    exactly its 4-bit quantization (a real quantization gap for the LoRA to pay back).
    """
    config = _model_config(family, preset)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    _shape_init(model)
    _cast(model, mx.bfloat16)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):
        save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    build_tokenizer(out_dir, SHAPES[preset]["vocab"])
    return out_dir

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
from pathlib import Path
from pydoc_data.topics import topics

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import Edge0Error

PRESETS: tuple[str, ...] = ("tiny", "small", "wall")
# The wall preset is sized for the engine's first four families only; the others are written
# at tiny and small.
WALL_FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "bailing_moe")

# Shapes shared by every family. `lin_*` are the Gated DeltaNet (linear attention)
# dims of the hybrid families; `dense` is the FFN width of bailing's dense layer 0.
# hidden and moe_int are multiples of 64 so every projection quantizes at group 64.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden": 64,
        "layers": 4,
        "experts": 16,
        "top_k": 4,
        "moe_int": 64,
        "dense": 128,
        "heads": 2,
        "kv_heads": 1,
        "head_dim": 32,
        "vocab": 1024,
        "full_attention_interval": 2,
        "lin_k_heads": 2,
        "lin_v_heads": 4,
        "lin_k_dim": 32,
        "lin_v_dim": 32,
    },
    "small": {
        "hidden": 512,
        "layers": 8,
        "experts": 32,
        "top_k": 8,
        "moe_int": 256,
        "dense": 1024,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 64,
        "vocab": 4096,
        "full_attention_interval": 4,
        "lin_k_heads": 4,
        "lin_v_heads": 8,
        "lin_k_dim": 64,
        "lin_v_dim": 64,
    },
    # The memory-wall checkpoint: per token, its cold expert reads take about as long as its
    # compute on a 2-core CPU. At K=4 one layer reads 4 experts x 2.65 MB (3 projections x
    # (768 x 2048 / 2 packed bytes + 2 x 768 x 32 x 2 scale/bias bytes)) = 10.6 MB: ~10-20 ms cold
    # at 0.5-1 GB/s, while its compute is those same 10.6 MB through the 4-bit CPU kernel (~0.9 GB/s
    # of packed weights: ~12 ms) plus attention kept small (8 query / 2 kv heads of 128: 5.2 M
    # 4-bit params, ~3 ms). 20 layers x 128 experts x 2.65 MB = 6.8 GB of experts.
    "wall": {
        "hidden": 2048,
        "layers": 20,
        "experts": 128,
        "top_k": 8,
        "moe_int": 768,
        "dense": 4096,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 128,
        "vocab": 8192,
        "full_attention_interval": 4,
        "lin_k_heads": 16,
        "lin_v_heads": 32,
        "lin_k_dim": 128,
        "lin_v_dim": 128,
    },
}

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


def qwen3_moe_config(s: dict[str, int]) -> dict:
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["moe_int"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab"],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }


def _linear_attention_fields(s: dict[str, int]) -> dict:
    """Gated DeltaNet fields shared by qwen3_next and qwen3_5."""
    return {
        "full_attention_interval": s["full_attention_interval"],
        "linear_num_key_heads": s["lin_k_heads"],
        "linear_num_value_heads": s["lin_v_heads"],
        "linear_key_head_dim": s["lin_k_dim"],
        "linear_value_head_dim": s["lin_v_dim"],
        "linear_conv_kernel_dim": 4,
        "shared_expert_intermediate_size": s["moe_int"],
    }


def _qwen3_next_config(s: dict[str, int]) -> dict:
    config = qwen3_moe_config(s)
    config.update(_linear_attention_fields(s))
    config.update(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        partial_rotary_factor=0.25,
        attention_bias=False,
    )
    return config


def _qwen3_5_moe_config(s: dict[str, int]) -> dict:
    text = qwen3_moe_config(s)
    text.update(_linear_attention_fields(s))
    text.update(
        model_type="qwen3_5_moe_text",
        attention_bias=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    for key in ("architectures", "rope_theta", "mlp_only_layers"):
        text.pop(key)
    return {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
    }


def _bailing_moe_config(s: dict[str, int]) -> dict:
    # bailing derives head_dim = hidden / heads, so it has no head_dim field.
    return {
        "model_type": "bailing_moe",
        "architectures": ["BailingMoeV2ForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["moe_int"],
        "num_shared_experts": 1,
        "moe_shared_expert_intermediate_size": s["moe_int"],
        "first_k_dense_replace": 1,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab"],
        "rope_theta": 600000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }


# The families below are written at tiny and small only. Mixtral, Qwen2-MoE and OLMoE have no
# head_dim field (mlx-lm derives hidden / heads): those shapes have hidden == heads * head_dim.


def _mixtral_config(s: dict[str, int]) -> dict:
    # Mixtral's intermediate_size is the width of one expert; it has no dense FFN.
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["moe_int"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "hidden_act": "silu",
        "router_aux_loss_coef": 0.02,
        "output_router_logits": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-5,
        "vocab_size": s["vocab"],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }


def _group_routing_fields(s: dict[str, int]) -> dict:
    """DeepSeek-V3 style routing shared with GLM-4.5: sigmoid scores with a correction bias,
    4 groups of which the best 2 are searched, one shared expert, one dense first layer."""
    return {
        "n_routed_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["moe_int"],
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    }


def _glm4_moe_config(s: dict[str, int]) -> dict:
    # GLM-4.5 (not Air: Air has no qk norm and one group). Its config names no scoring or
    # top-k method: both are DeepSeek-V3's (sigmoid, noaux_tc), mlx-lm's defaults.
    return {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        **_group_routing_fields(s),
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": s["vocab"],
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


def _deepseek_v3_config(s: dict[str, int]) -> dict:
    # Multi-head latent attention, scaled from V3's (nope 128, rope 64, v 128 per head) by
    # head_dim; every rank is a multiple of 64 so the projections quantize at group 64.
    d = s["head_dim"]
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["heads"],
        "q_lora_rank": 2 * d,
        "kv_lora_rank": 2 * d,
        "qk_nope_head_dim": 2 * d,
        "qk_rope_head_dim": d,
        "v_head_dim": 2 * d,
        **_group_routing_fields(s),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "attention_bias": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab"],
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
    }


def _gpt_oss_config(s: dict[str, int]) -> dict:
    # intermediate_size is one expert's width. Layers alternate sliding-window and full
    # attention, starting with a sliding one, as gpt-oss-20b/120b do.
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["moe_int"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "experts_per_token": s["top_k"],
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (s["layers"] // 2),
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.9,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": s["vocab"],
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "initial_context_length": 4096,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


def _llama4_config(s: dict[str, int]) -> dict:
    # Scout's layout: every layer MoE (Maverick interleaves dense layers, step 2, which leaves
    # no MoE layer whose next layer is one: no prerouter owners), one routed expert plus a shared
    # one. mlx-lm hard-codes the rest: every fourth layer is NoPE with global attention, the
    # others chunked (so >= 4 layers).
    layers, step = s["layers"], 1
    text = {
        "model_type": "llama4_text",
        "hidden_size": s["hidden"],
        "num_hidden_layers": layers,
        "intermediate_size": s["moe_int"],
        "intermediate_size_mlp": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": 1,  # mlx-lm asserts 1
        "interleave_moe_layer_step": step,
        "moe_layers": [i for i in range(layers) if i % step == step - 1],
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
        "attention_chunk_size": 8192,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "use_qk_norm": True,
        "attention_bias": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": s["vocab"],
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
    }
    return {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": False,
    }


def _minimax_config(s: dict[str, int]) -> dict:
    # MiniMax-M2 (mlx-lm maps its model_type minimax_m2 to models/minimax.py): sigmoid router
    # with a correction bias, no shared expert, qk norm over all heads, half-dim rotary.
    return {
        "model_type": "minimax_m2",
        "architectures": ["MiniMaxM2ForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["moe_int"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "shared_intermediate_size": 0,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "rotary_dim": s["head_dim"] // 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab"],
        "rope_theta": 5000000.0,
        "max_position_embeddings": 196608,
        "tie_word_embeddings": False,
        # transformers' MiniMaxM2Config would otherwise default it to 200034, outside the vocab.
        "bos_token_id": None,
    }


def _qwen2_moe_config(s: dict[str, int]) -> dict:
    # Qwen1.5-MoE: a sigmoid-gated shared expert 4 experts wide, top-k weights not renormalized.
    return {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["moe_int"],
        "shared_expert_intermediate_size": 4 * s["moe_int"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": s["layers"],
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": s["vocab"],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }


def _olmoe_config(s: dict[str, int]) -> dict:
    # OLMoE: intermediate_size is one expert's width; q/k norms span all heads.
    return {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["moe_int"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "norm_topk_prob": False,
        "attention_bias": False,
        "clip_qkv": None,
        "router_aux_loss_coef": 0.01,
        "output_router_logits": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": s["vocab"],
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }


def _ernie4_5_moe_config(s: dict[str, int]) -> dict:
    # ERNIE-4.5-21B-A3B's layout: layer 0 dense, MoE from layer 1 to the last, a shared expert.
    # The release routes aux-free with a correction bias, which mlx-lm drops in sanitize and
    # never uses; the synthetic checkpoint has none, so it says moe_use_aux_free false.
    # Untied head: with a tied one, a random model's logits favour the input token (it is
    # still in the residual) and greedy decoding repeats it.
    return {
        "model_type": "ernie4_5_moe",
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "hidden_size": s["hidden"],
        "num_hidden_layers": s["layers"],
        "intermediate_size": s["dense"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "moe_num_experts": s["experts"],
        "moe_k": s["top_k"],
        "moe_intermediate_size": s["moe_int"],
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": s["layers"] - 1,
        "moe_layer_interval": 1,
        "moe_capacity": [s["experts"]] * 3,
        "moe_gate": "topk",
        "moe_gate_act": "softmax",
        "moe_use_aux_free": False,
        "use_bias": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": s["vocab"],
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


_FAMILY_CONFIGS = {
    "qwen3_moe": qwen3_moe_config,
    "qwen3_next": _qwen3_next_config,
    "qwen3_5_moe": _qwen3_5_moe_config,
    "bailing_moe": _bailing_moe_config,
    "mixtral": _mixtral_config,
    "glm4_moe": _glm4_moe_config,
    "deepseek_v3": _deepseek_v3_config,
    "gpt_oss": _gpt_oss_config,
    "llama4": _llama4_config,
    "minimax": _minimax_config,
    "qwen2_moe": _qwen2_moe_config,
    "olmoe": _olmoe_config,
    "ernie4_5_moe": _ernie4_5_moe_config,
}
# Every family synth writes, by the name that `write_synthetic_checkpoint` takes (mlx-lm's
# module name: `minimax` writes model_type minimax_m2, `llama4` wraps a llama4_text config).
FAMILIES: tuple[str, ...] = tuple(_FAMILY_CONFIGS)


def family_presets(family: str) -> tuple[str, ...]:
    """The presets `family` can be written at."""
    return PRESETS if family in WALL_FAMILIES else ("tiny", "small")


def _model_config(family: str, preset: str = "tiny") -> dict:
    """The unquantized config.json dict of `family` at `preset`."""
    if family not in _FAMILY_CONFIGS:
        raise Edge0Error(f"unknown family {family!r}; valid families: {', '.join(FAMILIES)}")
    if preset not in SHAPES:
        raise Edge0Error(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    if preset not in family_presets(family):
        raise Edge0Error(
            f"family {family!r} has no {preset!r} preset; its presets: "
            + ", ".join(family_presets(family))
        )
    config = _FAMILY_CONFIGS[family](SHAPES[preset])
    config["eos_token_id"] = EOS_TOKEN_ID
    if "text_config" in config:
        config["text_config"]["eos_token_id"] = EOS_TOKEN_ID
    return config


def write_synthetic_checkpoint(
    out_dir: str | Path, family: str, preset: str = "tiny", seed: int = 0
) -> Path:
    """Write config.json, model*.safetensors (+ model.safetensors.index.json), tokenizer files into out_dir; return out_dir."""
    config = _model_config(family, preset)
    out_dir = Path(out_dir)
    marker = out_dir / MARKER_FILE
    # Never overwrite what is not ours: the writer deletes stale model*.safetensors.
    if out_dir.exists() and any(out_dir.iterdir()) and not marker.exists():
        raise Edge0Error(
            f"{out_dir} exists and is not a synthetic checkpoint; choose an empty directory"
        )
    _write_checkpoint(out_dir, config, seed, MAX_SHARD_BYTES)
    build_tokenizer(out_dir, SHAPES[preset]["vocab"])
    marker.write_text(json.dumps({"family": family, "preset": preset, "seed": seed}) + "\n")
    return out_dir


def _write_checkpoint(out_dir: Path, config: dict, seed: int, max_shard_bytes: int) -> None:
    """Build the model for `config` and write its weights and config.json."""
    model, quantized_config = _build_model(config, seed)
    weights = dict(tree_flatten(model.parameters()))
    # Drop the model so that `weights` holds the only reference to each tensor and a
    # shard's memory is freed as soon as it is on disk.
    del model
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(out_dir, weights, max_shard_bytes)
    save_config(quantized_config, out_dir / "config.json")


def _build_model(config: dict, seed: int = 0) -> tuple[nn.Module, dict]:
    """The quantized random model of `config` (lazy), and its config with quantization."""
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    _shape_init(model)
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
            # is live at once (the wall preset's are ~800 MB each).
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

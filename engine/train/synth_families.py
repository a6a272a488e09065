"""Each family's config.json as synth writes it, at a preset's shapes.

One function per family gives the unquantized config its released checkpoints write (HF field
names) from a preset's shapes; `engine.train.synth` adds the tokenizer's EOS id, builds the model
with mlx-lm's classes and writes it.
"""

from __future__ import annotations

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
    # compute on a 2-core CPU: a layer's routed experts are read cold from an SSD in about the
    # time the 4-bit CPU kernel takes to compute with the same bytes, and attention is kept small
    # (8 query / 2 kv heads of 128). Its experts are as large as a 30B model's (3 projections of
    # 768 x 2048 at 4 bits), 20 layers of 128 of them.
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


FAMILY_CONFIGS = {
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
FAMILIES: tuple[str, ...] = tuple(FAMILY_CONFIGS)


def family_presets(family: str) -> tuple[str, ...]:
    """The presets `family` can be written at."""
    return PRESETS if family in WALL_FAMILIES else ("tiny", "small")

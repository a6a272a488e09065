"""The families synth writes beyond the first four (tiny preset): configs with their released
field names, stock mlx-lm loads and generates from them, routing is not degenerate, and gpt-oss
is quantized the way its conversions ship (mxfp4 experts, 8-bit affine elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import load

from engine.errors import Edge0Error
from engine.train import synth

PROMPT = "The assert statement is a convenient way to insert debugging assertions into a program."
TINY = synth.SHAPES["tiny"]

# family -> (model_type, the field that counts routed experts, other fields its released
# config.json has). llama4's sizes live in its text_config.
REAL_CONFIGS: dict[str, tuple[str, str, set[str]]] = {
    "mixtral": ("mixtral", "num_local_experts", {"num_experts_per_tok", "intermediate_size"}),
    "glm4_moe": (
        "glm4_moe",
        "n_routed_experts",
        {
            "n_shared_experts",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "first_k_dense_replace",
            "moe_intermediate_size",
            "norm_topk_prob",
            "partial_rotary_factor",
            "use_qk_norm",
            "head_dim",
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        "n_routed_experts",
        {
            "n_shared_experts",
            "n_group",
            "topk_group",
            "topk_method",
            "scoring_func",
            "routed_scaling_factor",
            "first_k_dense_replace",
            "moe_intermediate_size",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        },
    ),
    "gpt_oss": (
        "gpt_oss",
        "num_local_experts",
        {"num_experts_per_tok", "sliding_window", "layer_types", "head_dim", "swiglu_limit"},
    ),
    "llama4": (
        "llama4",
        "num_local_experts",
        {
            "num_experts_per_tok",
            "interleave_moe_layer_step",
            "intermediate_size_mlp",
            "attention_chunk_size",
            "use_qk_norm",
            "head_dim",
        },
    ),
    "minimax": (
        "minimax_m2",
        "num_local_experts",
        {"scoring_func", "use_routing_bias", "rotary_dim", "use_qk_norm", "head_dim"},
    ),
    "qwen2_moe": (
        "qwen2_moe",
        "num_experts",
        {"moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"},
    ),
    "olmoe": ("olmoe", "num_experts", {"num_experts_per_tok", "norm_topk_prob"}),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        "moe_num_experts",
        {
            "moe_k",
            "moe_gate_act",
            "moe_intermediate_size",
            "moe_num_shared_experts",
            "moe_layer_start_index",
        },
    ),
}
NEW_FAMILIES = tuple(REAL_CONFIGS)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per new family, shared by the tests of this module."""
    root = tmp_path_factory.mktemp("synth-families")
    return {f: synth.write_synthetic_checkpoint(root / f, f, "tiny") for f in NEW_FAMILIES}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_family_list_order():
    old = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "bailing_moe")
    assert synth.FAMILIES == old + NEW_FAMILIES


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_config_has_the_released_field_names(tiny_dirs, family):
    model_type, experts_field, fields = REAL_CONFIGS[family]
    config = _config(tiny_dirs[family])
    assert config["model_type"] == model_type
    text = config.get("text_config", config)
    assert text[experts_field] == TINY["experts"]
    # No other family's name for the expert count slipped in.
    others = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
    assert not (others - {experts_field}) & set(text)
    assert fields <= set(text), fields - set(text)


def test_family_specific_values():
    deepseek = synth._model_config("deepseek_v3", "tiny")
    assert (deepseek["topk_method"], deepseek["scoring_func"]) == ("noaux_tc", "sigmoid")
    for family in ("deepseek_v3", "glm4_moe"):
        config = synth._model_config(family, "small")
        assert config["n_routed_experts"] % config["n_group"] == 0
        assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] == 1
    llama4 = synth._model_config("llama4", "small")
    assert llama4["text_config"]["model_type"] == "llama4_text"
    assert llama4["text_config"]["num_experts_per_tok"] == 1
    gpt_oss = synth._model_config("gpt_oss", "small")
    assert len(gpt_oss["layer_types"]) == gpt_oss["num_hidden_layers"]
    assert synth._model_config("ernie4_5_moe", "tiny")["moe_layer_start_index"] == 1


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_no_wall_preset(tmp_path, family):
    with pytest.raises(Edge0Error, match=f"{family}.*tiny, small$"):
        synth._model_config(family, "wall")
    with pytest.raises(Edge0Error, match=family):
        synth.write_synthetic_checkpoint(tmp_path, family, "wall")
    assert not list(tmp_path.iterdir())


class _RecordExperts(nn.Module):
    """Wraps a SwitchGLU and records the expert indices of each call."""

    def __init__(self, experts: nn.Module, calls: list[list[list[int]]]):
        super().__init__()
        self.experts, self.calls = experts, calls

    def __call__(self, x, indices):
        self.calls.append(indices.reshape(-1, indices.shape[-1]).tolist())
        return self.experts(x, indices)


def _record_last_moe_layer(model: nn.Module) -> list[list[list[int]]]:
    """Record the experts the model's last MoE layer picks, call by call."""
    paths = [p for p, m in model.named_modules() if isinstance(m, SwitchGLU)]
    parent_path, name = max(paths, key=synth.natural_key).rsplit(".", 1)
    parent = dict(model.named_modules())[parent_path]
    calls: list[list[list[int]]] = []
    setattr(parent, name, _RecordExperts(getattr(parent, name), calls))
    return calls


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_stock_mlx_lm_loads_and_generates(tiny_dirs, family):
    path = tiny_dirs[family]
    model, tokenizer, config = load(str(path), return_config=True)  # strict=True inside
    prompt = mx.array(tokenizer.encode(PROMPT))
    # The loaded model is the one synth built: sanitize renamed or touched nothing.
    built, _ = synth._build_model(synth._model_config(family, "tiny"), seed=0)
    assert mx.array_equal(model(prompt[None]), built(prompt[None])).item()
    assert config["eos_token_id"] == synth.EOS_TOKEN_ID

    calls = _record_last_moe_layer(model)
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=12)]
    # Greedy decoding of a random model wanders instead of repeating a token.
    assert len(tokens) == 12 and len(set(tokens)) >= 6
    top_k = 1 if family == "llama4" else TINY["top_k"]
    decode = calls[1:]  # calls[0] is the prefill
    assert len(decode) >= 11 and all(len(call[0]) == top_k for call in decode)
    used = {e for call in decode for row in call for e in row}
    assert len(used) >= top_k + 2, used


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "minimax"])
def test_correction_bias_is_random_float32(tiny_dirs, family):
    tensors = mx.load(str(tiny_dirs[family] / "model.safetensors"))
    biases = [v for k, v in tensors.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) >= TINY["layers"] - 1
    for bias in biases:
        assert bias.dtype == mx.float32 and mx.abs(bias).min().item() > 0
    if family != "minimax":  # MoEGate's raw router weight (zeros in mlx-lm) is drawn, not 0
        gates = [v for k, v in tensors.items() if k.endswith("mlp.gate.weight")]
        assert gates and all(mx.abs(g).max().item() > 0 for g in gates)


def test_gpt_oss_experts_are_mxfp4_and_the_rest_8bit_affine(tiny_dirs):
    path = tiny_dirs["gpt_oss"]
    quant = _config(path)["quantization"]
    tensors = mx.load(str(path / "model.safetensors"))
    for layer in range(TINY["layers"]):
        prefix = f"model.layers.{layer}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{prefix}.mlp.experts.{proj}"
            assert quant[name] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
            # mxfp4 stores one uint8 (e8m0) scale per 32 weights and no biases.
            assert tensors[f"{name}.scales"].dtype == mx.uint8
            assert f"{name}.biases" not in tensors
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"{prefix}.self_attn.{proj}"
            assert quant[name] == {"group_size": 64, "bits": 8, "mode": "affine"}
            assert tensors[f"{name}.scales"].dtype == mx.bfloat16
            assert f"{name}.biases" in tensors
        assert quant[f"{prefix}.mlp.router"]["bits"] == 8
    model, _ = load(str(path))
    experts, attention = model.layers[0].mlp.experts.up_proj, model.layers[0].self_attn.q_proj
    assert (experts.mode, experts.bits, experts.group_size) == ("mxfp4", 4, 32)
    assert (attention.mode, attention.bits, attention.group_size) == ("affine", 8, 64)


@pytest.mark.parametrize("family", [f for f in NEW_FAMILIES if f != "gpt_oss"])
def test_other_families_are_4bit_with_8bit_routers(tiny_dirs, family):
    quant = _config(tiny_dirs[family])["quantization"]
    assert (quant["bits"], quant["group_size"], quant["mode"]) == (4, 64, "affine")
    routers = {k: v for k, v in quant.items() if k.endswith(synth.ROUTER_LINEARS)}
    # DeepSeek-V3 and GLM-4.5 route with MoEGate, which is not a Linear and stays bf16.
    if family in ("deepseek_v3", "glm4_moe"):
        assert not routers
    else:
        assert routers and all(v["bits"] == 8 for v in routers.values())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_teacher_is_the_float_model(tmp_path, family):
    synth.write_synthetic_teacher(tmp_path, family, "tiny")
    model, _, config = load(str(tmp_path), return_config=True)
    assert "quantization" not in config
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    assert all(
        dtype == (mx.float32 if k.endswith("e_score_correction_bias") else mx.bfloat16)
        for k, dtype in dtypes.items()
    )

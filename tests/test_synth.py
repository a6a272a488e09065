"""Synthetic checkpoints load with stock mlx-lm and behave like MoE models."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate, generate_step
from mlx_lm.utils import load, load_tokenizer

from engine.errors import Edge0Error
from engine.train import synth, synth_families

PROMPT = "The assert statement is a convenient way to insert debugging assertions into a program."


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per Qwen / Bailing family, shared by the tests of this module (the
    other families' layouts are checked in test_synth_families.py)."""
    root = tmp_path_factory.mktemp("synth")
    return {
        f: synth.write_synthetic_checkpoint(root / f, f, "tiny")
        for f in synth_families.WALL_FAMILIES
    }


def _weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _tensors(path: Path) -> dict[str, mx.array]:
    weights = {}
    for name in sorted(set(_weight_map(path).values())):
        weights.update(mx.load(str(path / name)))
    return weights


@pytest.mark.parametrize("family", synth_families.WALL_FAMILIES)
def test_tiny_loads_and_matches_built_model(tiny_dirs, family):
    path = tiny_dirs[family]
    model, tokenizer, config = load(str(path), return_config=True)  # strict=True inside
    built, _ = synth._build_model(synth._model_config(family, "tiny"), seed=0)
    tokens = mx.array([tokenizer.encode(PROMPT)])
    loaded_logits, built_logits = model(tokens), built(tokens)
    assert loaded_logits.shape == (1, tokens.shape[1], synth.SHAPES["tiny"]["vocab"])
    assert mx.isfinite(loaded_logits).all().item()
    # Exact equality: sanitize must not touch the weights (no norm +1, conv1d moves).
    assert mx.array_equal(loaded_logits, built_logits).item()
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    assert isinstance(generate(model, tokenizer, PROMPT, max_tokens=4), str)
    # Greedy decoding of a random model should wander, not repeat one token.
    steps = generate_step(tokens[0], model, max_tokens=32)
    assert len({int(token) for token, _ in steps}) >= 8


@pytest.mark.parametrize("family", synth_families.WALL_FAMILIES)
def test_experts_are_stacked_quantized_tensors(tiny_dirs, family):
    shapes = synth.SHAPES["tiny"]
    experts, hidden = shapes["experts"], shapes["hidden"]
    prefix = "language_model.model.layers" if family == "qwen3_5_moe" else "model.layers"
    tensors = _tensors(tiny_dirs[family])
    assert set(tensors) == set(_weight_map(tiny_dirs[family]))
    first_moe = 1 if family == "bailing_moe" else 0  # bailing's layer 0 is dense
    for layer in range(first_moe, shapes["layers"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            base = f"{prefix}.{layer}.mlp.switch_mlp.{proj}"
            weight = tensors[f"{base}.weight"]
            assert weight.dtype == mx.uint32 and weight.shape[0] == experts
            assert tensors[f"{base}.scales"].shape[0] == experts
            assert tensors[f"{base}.biases"].shape[0] == experts
        up = tensors[f"{prefix}.{layer}.mlp.switch_mlp.up_proj.weight"]
        assert up.shape == (experts, shapes["moe_int"], hidden * 4 // 32)
    if family == "bailing_moe":
        assert f"{prefix}.0.mlp.gate_proj.weight" in tensors
        bias = tensors[f"{prefix}.1.mlp.gate.expert_bias"]
        assert bias.dtype == mx.float32 and mx.abs(bias).min().item() > 0


def test_family_configs():
    bailing = synth._model_config("bailing_moe", "small")
    assert bailing["score_function"] == "sigmoid" and bailing["moe_router_enable_expert_bias"]
    assert (bailing["n_group"], bailing["topk_group"]) == (4, 2)
    assert bailing["routed_scaling_factor"] == 2.5 and bailing["first_k_dense_replace"] == 1
    qwen35 = synth._model_config("qwen3_5_moe", "tiny")
    assert qwen35["model_type"] == "qwen3_5_moe" and qwen35["text_config"]["num_experts"] == 16
    for family in synth.FAMILIES:
        for preset in synth.family_presets(family):
            config = synth._model_config(family, preset)
            text = config.get("text_config", config)
            assert text["max_position_embeddings"] >= 4096
            assert config["eos_token_id"] == synth.EOS_TOKEN_ID


class _RecordExperts(nn.Module):
    """Wraps a router and records the experts it picks for each token."""

    def __init__(self, router: nn.Module, top_k: int, picks: list[set]):
        super().__init__()
        self.router, self.top_k, self.picks = router, top_k, picks

    def __call__(self, x):
        out = self.router(x)
        # bailing's gate returns (indices, scores); Qwen's returns logits.
        inds = out[0] if isinstance(out, tuple) else mx.argpartition(-out, self.top_k - 1)
        self.picks.extend(
            frozenset(r[: self.top_k]) for r in inds.reshape(-1, inds.shape[-1]).tolist()
        )
        return out


@pytest.mark.parametrize("family", synth_families.WALL_FAMILIES)
def test_routing_varies_by_token(tiny_dirs, family):
    model, tokenizer = load(str(tiny_dirs[family]))
    top_k, experts = synth.SHAPES["tiny"]["top_k"], synth.SHAPES["tiny"]["experts"]
    picks_per_layer = []
    for layer in model.layers:
        if isinstance(getattr(layer.mlp, "gate", None), nn.Module):
            picks_per_layer.append([])
            layer.mlp.gate = _RecordExperts(layer.mlp.gate, top_k, picks_per_layer[-1])
    tokens = tokenizer.encode(PROMPT)
    model(mx.array([tokens]))
    assert len(picks_per_layer) >= 3
    for picks in picks_per_layer:
        assert len(picks) == len(tokens)
        assert len(set(picks)) >= len(tokens) // 2  # top-k sets differ across tokens
        assert len(frozenset().union(*picks)) >= experts * 3 // 4  # most experts used


def test_same_seed_same_bytes(tmp_path):
    a = synth.write_synthetic_checkpoint(tmp_path / "a", "qwen3_next", "tiny", seed=3)
    b = synth.write_synthetic_checkpoint(tmp_path / "b", "qwen3_next", "tiny", seed=3)
    c = synth.write_synthetic_checkpoint(tmp_path / "c", "qwen3_next", "tiny", seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in files and files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_multi_shard_checkpoint_loads(tmp_path):
    config = synth._model_config("qwen3_5_moe", "tiny")
    synth._write_checkpoint(tmp_path, config, seed=0, max_shard_bytes=200_000)
    synth.build_tokenizer(tmp_path, synth.SHAPES["tiny"]["vocab"])
    shards = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    assert len(shards) >= 2 and "model.safetensors" not in shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    tensors = _tensors(tmp_path)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for shard in shards:
        assert (tmp_path / shard).stat().st_size <= 200_000
    model, tokenizer = load(str(tmp_path))
    built, _ = synth._build_model(config, seed=0)
    tokens = mx.array([tokenizer.encode(PROMPT)])
    assert mx.array_equal(model(tokens), built(tokens)).item()
    # A folder that is not a synthetic checkpoint is never overwritten...
    with pytest.raises(Edge0Error, match="not a synthetic checkpoint"):
        synth.write_synthetic_checkpoint(tmp_path, "qwen3_5_moe", "tiny")
    # ...one that is gets rewritten as one file, leaving no stale shard for mlx-lm to pick up.
    (tmp_path / synth.MARKER_FILE).write_text("{}")
    synth.write_synthetic_checkpoint(tmp_path, "qwen3_5_moe", "tiny")
    assert [p.name for p in tmp_path.glob("model*.safetensors")] == ["model.safetensors"]
    model, _ = load(str(tmp_path))
    assert mx.array_equal(model(tokens), built(tokens)).item()


def test_tokenizer_chat_template_and_round_trip(tiny_dirs):
    from transformers import AutoTokenizer

    path = tiny_dirs["qwen3_moe"]
    messages = [{"role": "user", "content": "What does assert do?"}]
    for tokenizer in (load_tokenizer(path), AutoTokenizer.from_pretrained(path)):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == "<|im_start|>user\nWhat does assert do?<|im_end|>\n<|im_start|>assistant\n"
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        im_start, im_end = (
            tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")
        )
        assert ids.count(im_start) == 2 and ids.count(im_end) == 1
        assert tokenizer.eos_token == "<|im_end|>" and im_end == synth.EOS_TOKEN_ID
        sample = "def f(x):\n    return x ** 2  # naïve ✓ 日本語\n"
        encoded = tokenizer.encode(sample)
        assert len(encoded) < len(sample.encode()) and tokenizer.decode(encoded) == sample
    assert len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]) == 1024


@pytest.mark.parametrize(
    "family, preset, valid", [("llama", "tiny", "qwen3_moe"), ("qwen3_moe", "huge", "wall")]
)
def test_unknown_names_raise(tmp_path, family, preset, valid):
    with pytest.raises(Edge0Error, match=valid):
        synth.write_synthetic_checkpoint(tmp_path, family, preset)
    assert not list(tmp_path.iterdir())

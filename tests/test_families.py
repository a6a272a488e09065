"""The family table at the edges: model_type aliases, an mlx-lm MoE family without the engine's
routing (streamed on demand with its own block's router), and configs edge0 refuses by family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from adapters import write_random_profile
from cli_runner import run_cli

from edge0_tui.cli import main
from engine.checkpoint.families import FAMILIES, family_of
from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.routing.moe_block import FAMILY_OPS, ops_for
from engine.runtime.generation import Engine
from engine.train import synth

GREEDY_32 = GenerationConfig(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37 + 5) % 1000 + 3 for i in range(40)]  # chunked prefill, whole-layer reads


def test_every_family_in_the_table_has_its_routing_and_a_synthetic_checkpoint():
    assert set(FAMILIES) == set(FAMILY_OPS) == set(synth.FAMILIES)
    for name, family in FAMILIES.items():
        assert family.routing and "prerouter" in family.modes
        assert ops_for(name) is FAMILY_OPS[name]


def _granite_config() -> dict:
    """IBM Granite-MoE (granite-3.0-1b-a400m's layout), tiny: an mlx-lm MoE family without the
    engine's routing (its router is its own top-k gating module)."""
    return {
        "model_type": "granitemoe",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": 1024,
        "logits_scaling": 1.0,
        "attention_multiplier": 0.125,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "rope_theta": 10000.0,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "tie_word_embeddings": False,
        "eos_token_id": synth.EOS_TOKEN_ID,
    }


@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("granite")
    synth._write_checkpoint(out, _granite_config(), seed=0, max_shard_bytes=synth.MAX_SHARD_BYTES)
    synth.build_tokenizer(out, 1024)
    return out


def _tokens(model_dir: Path, **config) -> list[int]:
    with Engine(model_dir, EngineConfig(prefill_chunk=16, exact_kernels=True, **config)) as engine:
        return engine.generate(PROMPT, GREEDY_32).tokens


def test_another_mlx_lm_moe_family_streams_with_its_own_router(granite):
    resident = _tokens(granite, mode="resident")
    # A cache of 5 experts: one layer's 4 and a spare, so experts are read again every step.
    with Engine(granite, EngineConfig(mode="on-demand")) as engine:
        one_layer = 5 * engine.store.resident_expert_nbytes(0)
        assert engine.loaded.family.name == "granitemoe"
        assert not engine.loaded.family.routing and engine.loaded.blocks == {}
        assert engine.modes() == ["on-demand", "prefetch"]
        assert [p.k for p in engine.profiles()] == [4]  # the native K only
        info = engine.info()
        assert info["family_modes"] == ["resident", "on-demand", "prefetch"]
        assert info["expert_format"].startswith("affine 4-bit, group 64")
    streamed = _tokens(granite, mode="on-demand", expert_cache_bytes=one_layer)
    assert len(resident) == 32 and streamed == resident
    # Prefetch: the lookahead guesses from the block's own gate; the tokens stay resident's.
    assert _tokens(granite, mode="prefetch", expert_cache_bytes=one_layer) == resident
    with pytest.raises(Edge0Error, match="prerouter_k"):
        Engine(granite, EngineConfig(mode="prerouter"))
    with pytest.raises(Edge0Error, match="granitemoe: .*no routing function"):
        ops_for("granitemoe")


def test_aliases_map_as_mlx_lm_maps_them(checkpoint_dir, tmp_path):
    model = tmp_path / "kimi"
    shutil.copytree(checkpoint_dir("deepseek_v3"), model)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (model / "config.json").write_text(json.dumps(config))
    out = run_cli("info", str(model))
    assert out.returncode == 0, out.stderr
    assert "deepseek_v3, " in out.stdout and "prerouter, prefetch" in out.stdout
    minimax = json.loads((checkpoint_dir("minimax") / "config.json").read_text())
    assert minimax["model_type"] == "minimax_m2"  # as released; runs as the minimax family


def test_info_names_the_family_modes_and_the_expert_format(checkpoint_dir):
    out = run_cli("info", str(checkpoint_dir("gpt_oss")))
    assert out.returncode == 0, out.stderr
    assert "gpt_oss" in out.stdout
    assert "modes: resident, on-demand, prerouter, prefetch" in out.stdout
    assert "experts stored mxfp4 4-bit, group 32, with biases" in out.stdout


def _edit(config: dict, family: str, change: str) -> None:
    scope = config.get("text_config", config)
    if change == "topk_method":
        scope["topk_method"] = "greedy"  # mlx-lm's DeepSeek-V3 gate supports noaux_tc only
    elif change == "two experts":
        scope["num_experts_per_tok"] = 2  # mlx-lm's Llama-4 block routes to one
    else:
        config["model_type"] = change


REFUSED = [
    ("deepseek_v3", "topk_method", "config.json", ("deepseek_v3", "refuses this config")),
    ("llama4", "two experts", "config.json", ("llama4", "refuses this config")),
    ("qwen3_moe", "phixtral", "config.json", ("'phixtral'", "SwitchMLP")),
    ("qwen3_moe", "llama", "config.json", ("'llama'", "not a mixture-of-experts")),
    ("qwen3_moe", "mamba_moe_9", "config.json", ("'mamba_moe_9'", "no such architecture")),
    ("qwen3_moe", "../qwen3_moe", "config.json", ("'../qwen3_moe'", "not a model type")),
]


@pytest.mark.parametrize(
    "family, change, where, problem", REFUSED, ids=[f"{f}-{c}" for f, c, _, _ in REFUSED]
)
def test_unsupported_or_malformed_moe_config_is_one_line_naming_the_family(
    checkpoint_dir, tmp_path, family, change, where, problem
):
    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir(family), model)
    config = json.loads((model / "config.json").read_text())
    _edit(config, family, change)
    (model / "config.json").write_text(json.dumps(config))
    out = run_cli("info", str(model))
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge0: error: "), out.stderr
    assert str(model / where) in lines[0]
    for part in problem:
        assert part in lines[0], lines[0]


def test_mxfp4_experts_stay_mxfp4_in_the_pool(checkpoint_dir):
    """gpt-oss experts are read and computed in their own format: packed words and uint8 scales
    in the pool's slot bank (no dequantize-on-load), with the output biases widened to the compute
    dtype, bit for bit the checkpoint's values."""
    model = checkpoint_dir("gpt_oss")
    with Engine(model, EngineConfig(mode="on-demand")) as engine:
        engine.generate([5, 9, 13], GenerationConfig(max_tokens=4, temperature=0.0))
        pool = engine.store.pool
        assert len(pool)
        layer, expert = pool.keys()[0]
        arrays = engine.store.bank(layer).arrays
        assert arrays["gate_proj.weight"].dtype == mx.uint32
        assert arrays["gate_proj.scales"].dtype == mx.uint8
        assert "gate_proj.biases" not in arrays  # mxfp4 has no quantization biases
        assert arrays["gate_proj.bias"].dtype == mx.float32
        slot = pool.slot_of((layer, expert))
        for tensor in engine.store.index.layers[layer].tensors:
            name = f"{tensor.projection}.{tensor.part}"
            want = mx.load(str(tensor.entry.file))[tensor.entry.name][expert]
            if want.dtype == mx.bfloat16:
                want = want.astype(mx.float32)
            assert mx.array_equal(arrays[name][slot], want), name


@pytest.fixture(scope="module")
def maverick(tmp_path_factory) -> Path:
    """Llama-4-Maverick's layout, tiny: MoE layers 1 and 3, a dense FFN between them."""
    config = synth._model_config("llama4", "tiny")
    config["text_config"].update(interleave_moe_layer_step=2, moe_layers=[1, 3])
    out = tmp_path_factory.mktemp("maverick")
    synth._write_checkpoint(out, config, seed=0, max_shard_bytes=synth.MAX_SHARD_BYTES)
    synth.build_tokenizer(out, 1024)
    return out


def test_interleaved_moe_layers_stream_and_predict_across_the_dense_layer(
    maverick, tmp_path, monkeypatch, capsys
):
    """A head of MoE layer 1 predicts MoE layer 3 (the next MoE layer, past the dense layer 2):
    on-demand equals resident, the prerouter routes layer 3 by its prediction with nothing
    dropped, and phase 1 trains that head."""
    assert _tokens(maverick, mode="on-demand") == _tokens(maverick, mode="resident")
    write_random_profile(maverick, 1)
    with Engine(maverick, EngineConfig(mode="prerouter")) as engine:
        assert engine.routing.heads.owners == [1] and engine.routing.heads.consumers == [3]
        result = engine.generate(PROMPT[:5], GREEDY_32)
    decode = [s for s in result.steps if s.phase == "decode"]
    assert decode and all(s.predicted == 1 and s.dropped == 0 for s in decode)
    monkeypatch.setenv("EDGE0_DATA_DIR", str(tmp_path / "data"))
    args = ["train", "heads", str(maverick), "--k", "1", "--steps", "4", "--max-tokens", "600"]
    assert main(args) == 0
    assert "head of layer   1 -> layer   3" in capsys.readouterr().out


def test_an_architecture_that_cannot_be_imported_is_one_error(monkeypatch):
    import importlib

    real = importlib.import_module

    def failing(name, *args):
        if name == "mlx_lm.models.granitemoe":
            raise ImportError("No module named 'some_optional_package'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.raises(Edge0Error, match="granitemoe cannot be imported .*some_optional_package"):
        family_of({"model_type": "granitemoe"}, "config.json")

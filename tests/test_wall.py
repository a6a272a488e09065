"""`edge0 synth OUT --from MODEL --expert-width N`: a trained model with wider, zero-padded experts
computes the same function, so it is a memory wall with real routing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from edge0_tui.cli import main
from engine import Engine, EngineConfig, GenerationConfig
from engine.checkpoint.index import CheckpointIndex, read_safetensors
from engine.errors import Edge0Error
from engine.train.wall import pad_experts

DEMO = Path(__file__).resolve().parent.parent / "assets" / "demo"
WIDTH = 512  # the demo's experts are 128 wide: 4x the bytes
PROMPTS = ("Where is the duke tonight?", "O Romeo, wherefore art thou", "To be, or not to be")
ADAPTERS = [f"{kind}_k{k}.safetensors" for kind in ("prerouter", "lora") for k in (2, 4, 8)]


@pytest.fixture(scope="module")
def wall(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wall") / "demo-wall"
    # A small shard limit, so that the streamed writer makes several shards and an index.
    report = pad_experts(DEMO, out, WIDTH, max_shard_bytes=16 << 20)
    assert report.shards > 1 and sorted(report.restamped) == sorted(ADAPTERS)
    assert not report.copied_unchanged
    return out


def _greedy(model: Path, mode: str, k: int | None) -> list[list[int]]:
    with Engine(model, EngineConfig(mode=mode, k=k)) as engine:
        return [
            engine.generate(engine.encode(p, chat=True), GenerationConfig(max_tokens=12)).tokens
            for p in PROMPTS
        ]


@pytest.mark.parametrize("mode,k", [("resident", None), ("on-demand", None), ("prerouter", 4)])
def test_padded_wall_generates_the_same_greedy_tokens(wall, mode, k):
    assert _greedy(wall, mode, k) == _greedy(DEMO, mode, k)


def test_expert_bytes_grow_by_the_width_ratio_and_padding_is_zero(wall):
    before, after = CheckpointIndex(DEMO), CheckpointIndex(wall)
    assert _expert_bytes(after) == WIDTH // 128 * _expert_bytes(before)
    # Everything that is not a routed expert is the same tensor.
    others = {n: (e.dtype, e.shape) for n, e in before.tensors.items() if ".switch_mlp." not in n}
    assert others == {
        n: (e.dtype, e.shape) for n, e in after.tensors.items() if ".switch_mlp." not in n
    }
    source = mx.load(str(DEMO / "model.safetensors"))
    padded = {}
    for shard in after.shards:
        padded.update(mx.load(str(shard)))
    for name in ("gate_proj", "up_proj"):  # output rows
        for part in ("weight", "scales", "biases"):
            key = f"model.layers.3.mlp.switch_mlp.{name}.{part}"
            assert mx.array_equal(padded[key][:, :128], source[key])
            assert not mx.any(padded[key][:, 128:]).item()
    for part, columns in (("weight", 16), ("scales", 2), ("biases", 2)):  # down_proj input groups
        key = f"model.layers.3.mlp.switch_mlp.down_proj.{part}"
        assert padded[key].shape[-1] == columns * WIDTH // 128
        assert mx.array_equal(padded[key][..., :columns], source[key])
        assert not mx.any(padded[key][..., columns:]).item()
    assert mx.array_equal(padded["lm_head.weight"], source["lm_head.weight"])


def _expert_bytes(index: CheckpointIndex) -> int:
    return sum(e.nbytes for n, e in index.tensors.items() if ".switch_mlp." in n)


def test_adapters_are_stamped_for_the_padded_base_and_load(wall):
    with Engine(wall, EngineConfig(mode="prerouter", k=4)) as engine:
        fingerprint = engine.fingerprint
        assert engine.k == 4
    for name in ADAPTERS:
        tensors, metadata = read_safetensors(wall / name)
        source_tensors, source_metadata = read_safetensors(DEMO / name)
        assert metadata["base_fingerprint"] == fingerprint != source_metadata["base_fingerprint"]
        assert {**metadata, "base_fingerprint": ""} == {**source_metadata, "base_fingerprint": ""}
        # Only the header changed: the tensors' bytes are the source's.
        data = (wall / name).read_bytes()
        source_data = (DEMO / name).read_bytes()
        for key, entry in tensors.items():
            src = source_tensors[key]
            assert (
                data[entry.offset : entry.offset + entry.nbytes]
                == (source_data[src.offset : src.offset + src.nbytes])
            )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (wall / name).read_bytes() == (DEMO / name).read_bytes()


def test_synth_from_cli_writes_a_wall_and_refuses_mistakes(tmp_path, capsys):
    out = tmp_path / "wall"
    assert main(["synth", str(out), "--from", str(DEMO), "--expert-width", "192"]) == 0
    assert "128 -> 192 wide" in capsys.readouterr().out
    assert main(["synth", str(out), "--from", str(DEMO), "--expert-width", "192"]) == 0  # rewrite
    capsys.readouterr()
    cases = [
        (["--expert-width", "200"], "not a whole number of quantization groups"),
        (["--expert-width", "64"], "narrower than the experts' width 128"),
        ([], "--from needs --expert-width"),
        (["--expert-width", "256", "--preset", "wall"], "--preset does not apply"),
    ]
    for extra, message in cases:
        assert main(["synth", str(tmp_path / "other"), "--from", str(DEMO), *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["synth", str(DEMO), "--from", str(DEMO), "--expert-width", "256"]) == 2
    assert "the output directory is the source" in capsys.readouterr().err
    assert main(["synth", str(tmp_path / "x"), "--expert-width", "256"]) == 2
    assert "give it with --from MODEL" in capsys.readouterr().err


def test_other_families_pad_where_the_width_is_theirs_alone(checkpoint_dir, tmp_path):
    """Bailing's shared experts default to moe_intermediate_size: the padded config pins them, so
    the padded model computes the same tokens; DeepSeek-V3 sizes its shared experts from the
    same field and is refused by name, before anything is written."""
    source = tmp_path / "bailing"
    shutil.copytree(checkpoint_dir("bailing_moe"), source)
    config = json.loads((source / "config.json").read_text())
    del config["moe_shared_expert_intermediate_size"]  # released Ling configs may leave it out
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "bailing-wall"
    pad_experts(source, out, 128)
    greedy = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = []
    for model in (source, out):
        with Engine(model, EngineConfig(mode="on-demand", exact_kernels=True)) as engine:
            tokens.append(engine.generate([5, 9, 13, 17], greedy).tokens)
    assert tokens[0] == tokens[1]
    with pytest.raises(Edge0Error, match="deepseek_v3: only families whose routed experts"):
        pad_experts(checkpoint_dir("deepseek_v3"), tmp_path / "ds-wall", 128)
    assert not (tmp_path / "ds-wall").exists()

"""`edge0 list` (issue 35, "Model list"): the models used before and the MoE checkpoints in the
Hugging Face cache, with family, size, native K and the profiles found; no weights, no network."""

from __future__ import annotations

import json
import shutil

from adapters import write_random_profile
from cli_runner import run_cli

from edge0_tui.model_source import BUNDLED_DEMO
from edge0_tui.preferences import ModelPreferences, PreferenceStore, model_key
from engine import format_bytes


def test_list_shows_used_models_and_moe_checkpoints_in_the_hub_cache(
    checkpoint_dir, tmp_path, monkeypatch
):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    snapshot = hub / "models--owner--tiny-moe" / "snapshots" / "abc123"
    shutil.copytree(checkpoint_dir("qwen3_moe", "tiny"), snapshot)
    (hub / "models--owner--tiny-moe" / "refs").mkdir()
    (hub / "models--owner--tiny-moe" / "refs" / "main").write_text("abc123")
    not_moe = hub / "models--owner--plain" / "snapshots" / "def"
    not_moe.mkdir(parents=True)
    (not_moe / "config.json").write_text('{"model_type": "llama"}')
    mine = tmp_path / "mine"
    shutil.copytree(checkpoint_dir("bailing_moe", "tiny"), mine)
    write_random_profile(mine, 2)  # K=2: heads and LoRA, recovered
    (mine / "lora_k2.safetensors").rename(mine / "spare.safetensors")  # heads only now
    store = PreferenceStore(tmp_path / "config")
    monkeypatch.setenv("EDGE0_CONFIG_DIR", str(tmp_path / "config"))
    for model in ("demo", str(mine), str(tmp_path / "gone"), str(snapshot)):
        store.save(model_key(model), ModelPreferences())

    out = run_cli("list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert list(rows) == ["demo", str(mine.resolve()), str(tmp_path / "gone"), "owner/tiny-moe"]
    assert rows["owner/tiny-moe"]["where"] == "used"  # the snapshot is its repo id, once
    assert rows["owner/tiny-moe"]["family"] == "qwen3_moe"
    assert "no such" in rows[str(tmp_path / "gone")]["error"]
    assert rows[str(mine.resolve())]["profiles"] == {"2": "model"}
    assert rows[str(mine.resolve())]["recovered"] == []
    if (BUNDLED_DEMO / "config.json").exists():
        demo = rows["demo"]
        assert demo["family"] == "qwen3_moe" and demo["native_k"] == 8
        assert set(demo["profiles"]) == {"2", "4", "8"} and demo["recovered"] == [2, 4, 8]
        size = sum(p.stat().st_size for p in BUNDLED_DEMO.glob("model*.safetensors"))
        assert demo["disk_bytes"] == size

    out = run_cli("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "SIZE", "K", "PROFILES", "WHERE"]
    (tiny,) = [line for line in lines if line.startswith("owner/tiny-moe")]
    assert "qwen3_moe" in tiny and format_bytes(rows["owner/tiny-moe"]["disk_bytes"]) in tiny
    (heads_only,) = [line for line in lines if line.startswith(str(mine.resolve()))]
    assert "K=2*" in heads_only
    assert lines[-1].startswith("* heads or LoRA only")
    assert not any("plain" in line for line in lines)  # not an MoE: not listed


def test_list_with_nothing_says_how_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    out = run_cli("list")
    assert out.returncode == 0 and "edge0 chat demo" in out.stdout


def test_the_catalog_fingerprints_a_model_as_its_engine_does(checkpoint_dir, family):
    """`edge0 list` reads headers only; the fingerprint it finds K profiles by (the automatic
    adapter folder is named by it) must be the loaded engine's, for every family. (It was the
    config's alone: profiles `train heads` wrote there were not listed.)"""
    from engine.checkpoint.index import CheckpointIndex, base_fingerprint, max_checkpoint_tensors
    from engine.config import EngineConfig
    from engine.runtime.generation import Engine

    model = checkpoint_dir(family)
    index = CheckpointIndex(model, max_checkpoint_tensors(None))
    index.add_moe_layers_by_name()
    with Engine(model, EngineConfig(mode="on-demand")) as engine:
        assert base_fingerprint(index) == engine.fingerprint
        assert sorted(index.layers) == sorted(engine.loaded.index.layers)


def test_profiles_in_the_automatic_folder_are_listed(checkpoint_dir, tmp_path):
    import shutil

    from adapters import write_random_profile

    from engine import summarize_checkpoint
    from engine.adapters.locations import auto_adapter_dir
    from engine.config import EngineConfig
    from engine.runtime.generation import Engine

    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    write_random_profile(model, 2)
    data = tmp_path / "data"
    with Engine(model, EngineConfig(mode="on-demand", data_dir=data)) as engine:
        auto = auto_adapter_dir(engine.fingerprint, data)
    auto.mkdir(parents=True)
    for path in model.glob("*_k2.safetensors"):
        shutil.move(path, auto / path.name)
    summary = summarize_checkpoint(model, EngineConfig(data_dir=data))
    assert summary.profiles == {2: "auto"} and summary.recovered == (2,)

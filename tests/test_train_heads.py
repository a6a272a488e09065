"""Phase 1 on a synthetic model: `edge0 train heads` writes heads that beat chance and serve."""

from __future__ import annotations

import json
import pydoc_data.topics
import re
import shutil

from edge0_tui.cli import main
from engine.config import EngineConfig, GenerationConfig
from engine.runtime.generation import Engine
from engine.train.heads import TrainHeadsConfig, train_heads


def _text() -> str:
    return "\n\n".join(pydoc_data.topics.topics.values())


def test_trained_heads_beat_chance(checkpoint_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    # 4000 tokens and 60 steps reach the held-out recall@4 of 12000 and 150 (0.334 and 0.335;
    # untrained heads: 0.28), in a third of the time.
    config = TrainHeadsConfig(k=4, max_tokens=4000, steps=60, window=64, log_every=6)
    lines = []
    data = EngineConfig(data_dir=tmp_path / "data")  # the automatic adapter folder goes there
    out, recalls = train_heads(
        model_dir, _text(), config, progress=lines.append, engine_config=data
    )
    chance = 4 / 16
    mean = sum(recalls.values()) / len(recalls)
    print("\n" + "\n".join(lines[-len(recalls) - 3 :]))
    assert out.exists() and out.parent.parent == tmp_path / "data" / "adapters"
    assert mean > 1.2 * chance, f"mean held-out recall@4 {mean:.3f} vs chance {chance:.3f}"
    losses = [
        float(m.group(1)) for line in lines if (m := re.match(r"step \d+/\d+ +loss ([\d.]+)", line))
    ]
    assert len(losses) >= 10 and losses[-1] < losses[0]
    # The cost line counts the positions a step trains on (the batch), not its features' elements.
    (cost,) = [
        m for line in lines if (m := re.match(r"a step took ([\d.]+) s \(([\d.]+) s per 1k", line))
    ]
    step_s, per_1k = float(cost.group(1)), float(cost.group(2))
    assert abs(per_1k - step_s / config.batch * 1000) <= 0.05 / config.batch * 1000 + 0.01

    engine = Engine(
        model_dir, EngineConfig(mode="prerouter", shadow_router=True, data_dir=tmp_path / "data")
    )
    try:
        assert engine.k == 4
        summary = engine.generate([5, 6, 7], GenerationConfig(max_tokens=16)).summary
        assert summary["dropped"] == 0 and summary["median_predicted"] > 0
    finally:
        engine.close()


def test_cli_train_heads(checkpoint_dir, tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("bailing_moe"), model_dir)
    monkeypatch.setenv("EDGE0_DATA_DIR", str(tmp_path / "data"))
    text = tmp_path / "text.txt"
    text.write_text(_text()[:60_000])
    adapters = tmp_path / "adapters"
    args = ["train", "heads", str(model_dir), "--k", "2", "--text", str(text), "--steps", "20"]
    assert main(args + ["--max-tokens", "4000", "--adapters", str(adapters), "--window", "64"]) == 0
    printed = capsys.readouterr().out
    assert "held-out recall@2" in printed
    assert "collection: " in printed and "plan: " in printed  # before the work, its progress
    assert re.search(r"peak memory: MLX [\d.]+ \w+, process RSS [\d.]+ \w+", printed), printed
    (state,) = adapters.glob("work/**/checkpoint.json")
    peaks = json.loads(state.read_text())["peak_memory"]  # the saving process's, its kernel's mark
    assert peaks["peak_rss_bytes"] > 0 and peaks["peak_rss_scope"] == "process"
    assert (adapters / "prerouter_k2.safetensors").exists()
    (progress,) = adapters.glob("work/traces-*/progress.json")
    assert json.loads(progress.read_text())["shape"]["window"] == 64  # --window reached collection
    assert not list(model_dir.glob("prerouter_*")) and not (tmp_path / "data").exists()
    assert main(["info", str(model_dir)]) == 0
    assert "K=2: prerouter" not in capsys.readouterr().out  # not in the search without --adapters
    assert main(["info", str(model_dir), "--adapters", str(adapters)]) == 0
    assert "K=2: prerouter (quality not recovered, --adapters folder" in capsys.readouterr().out

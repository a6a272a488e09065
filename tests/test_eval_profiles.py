"""`edge0 eval --profiles`: every K profile against the 4-bit model at its native K, kept for
`edge0 info` and the app; a kept file that is not ours adds nothing and breaks nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from adapters import write_random_profile

from edge0_tui.cli import main
from engine.adapters.locations import auto_adapter_dir
from engine.adapters.quality import QUALITY_FILE, kept_quality

TEXT = " ".join(f"the {i % 13} of a line {i % 29}, and so on." for i in range(2000))


def test_every_profile_is_measured_against_the_native_model_and_kept(
    checkpoint_dir, tmp_path, capsys
):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT)
    args = ["eval", str(model_dir), "--text", str(text), "--profiles", "--max-tokens", "512"]
    assert main([*args, "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    variants = [(row["k"], row["variant"]) for row in table["rows"]]
    assert variants == [(4, "int4 model (true router)"), (2, "heads only"), (2, "heads + LoRA")]
    native, heads, lora = table["rows"]
    assert native["vs_native"] == 1.0
    for row in (heads, lora):
        assert row["vs_native"] == pytest.approx(row["perplexity"] / native["perplexity"])
        assert 0 <= row["recall_mean"] <= 1 and row["recall_per_layer"]
    # The LoRA changes what the student computes: the two rows differ.
    assert heads["perplexity"] != lora["perplexity"]
    quality = kept_quality(table["fingerprint"])
    assert quality == {2: {"heads only": heads["vs_native"], "heads + LoRA": lora["vs_native"]}}
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| 2 | heads + LoRA |" in printed and "kept in" in printed


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"rows": "no"}),
        json.dumps({"rows": [{}, {"k": 2, "variant": "heads only", "vs_native": "NaN"}]}),
        json.dumps({"rows": [{}, {"k": 2, "variant": "heads only", "vs_native": float("inf")}]}),
        "x" * (2 << 20),
    ],
)
def test_a_kept_table_that_is_not_ours_adds_nothing(tmp_path, content):
    folder = auto_adapter_dir("f" * 16, tmp_path)
    folder.mkdir(parents=True)
    (folder / QUALITY_FILE).write_text(content)
    assert kept_quality("f" * 16, tmp_path) == {}


async def test_the_k_selector_shows_each_profiles_measured_quality(
    checkpoint_dir, tmp_path, monkeypatch
):
    from textual.widgets import RadioButton

    from edge0_tui.app import Edge0App
    from edge0_tui.widgets.routing_selector import RoutingSelector
    from engine.adapters.quality import keep_quality
    from engine.config import EngineConfig
    from engine.runtime.generation import Engine

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    write_random_profile(model_dir, 2)
    data = tmp_path / "data"
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    fingerprint = engine.fingerprint  # the one adapters are stamped with
    engine.close()
    rows = [{"k": 4, "variant": "int4 model (true router)", "vs_native": 1.0}]
    rows.append({"k": 2, "variant": "heads + LoRA", "vs_native": 1.087})
    keep_quality({"rows": rows}, fingerprint, data)
    monkeypatch.setattr("edge0_tui.engine_service.service.QUALITY_POLL_S", 0.1)
    app = Edge0App(
        model=str(model_dir),
        engine_config=EngineConfig(expert_cache_bytes=200_000, data_dir=data),
        data_dir=tmp_path / "chats",
        cache_dir=tmp_path / "cache",
        reopen=False,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(500):
            if app.chat_screen.controller.ready:
                break
            await pilot.pause(0.02)
        selector = app.chat_screen.query_one(RoutingSelector)
        labels = {b.id: str(b.label) for b in selector.query("RadioButton")}
        assert labels["k-2"] == "2 +8.7%"
        assert labels["k-4"] == "4"  # the native K on its own router: no measured cost
        # An eval run beside the open app: its figures show without a reload, K as chosen.
        rows[1] = {"k": 2, "variant": "heads + LoRA", "vs_native": 1.042}
        keep_quality({"rows": rows}, fingerprint, data)
        for _ in range(500):
            labels = {b.id: str(b.label) for b in selector.query("RadioButton")}
            if labels["k-2"] != "2 +8.7%":
                break
            await pilot.pause(0.02)
        assert labels["k-2"] == "2 +4.2%"
        assert selector.query_one("#k-4", RadioButton).value  # the native K, still chosen
        await pilot.press("ctrl+q")

"""`edge0 eval --profiles`: every K profile against the 4-bit model at its native K, kept for
`edge0 info` and the app; a kept file that is not ours adds nothing and breaks nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from adapters import write_random_profile
from cli_runner import run_cli

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
    # One layer-major pass of the text: each expert read at most once (the students here fit in
    # memory, dequantized: they read none).
    assert 0 < native["expert_reads"] <= 1.0 and heads["expert_reads"] == 0
    for row in (heads, lora):
        assert row["vs_native"] == pytest.approx(row["perplexity"] / native["perplexity"])
        assert 0 <= row["recall_mean"] <= 1 and row["recall_per_layer"]
    # The LoRA changes what the student computes: the two rows differ.
    assert heads["perplexity"] != lora["perplexity"]
    quality = kept_quality(table["fingerprint"])
    assert quality.warning is None and quality.table == {
        2: {"heads only": heads["vs_native"], "heads + LoRA": lora["vs_native"]}
    }
    assert main(args) == 0
    out, err = capsys.readouterr()
    printed = out
    # Each row's perplexity says how far it is and what is left (issue 48 item 3).
    assert err.count("perplexity, its first layer: ") == 3 and "left take about" in err
    assert "| 2 | heads + LoRA |" in printed and "kept in" in printed
    assert "| expert reads |" in printed


def _row(k: object = 2, ratio: object = 1.1) -> dict:
    return {"k": k, "variant": "heads only", "vs_native": ratio}


@pytest.mark.parametrize(
    "content, why",
    [
        ("not json", "invalid JSON"),
        (json.dumps({"rows": "no"}), '"rows"'),
        (json.dumps({"rows": [{}, _row(ratio="NaN")]}), "vs_native"),
        (json.dumps({"rows": [{}, _row(ratio=float("inf"))]}), "Infinity"),
        ("x" * (2 << 20), "bytes, more than"),
        # Issue 47 item 8: each was a traceback in `edge0 info`, `serve` and the app.
        ('{"rows": [{}, {"k": 1e400, "variant": "heads only", "vs_native": 1.1}]}', "rows[1].k"),
        (json.dumps({"rows": [{}, _row(k=2.5)]}), "rows[1].k"),
        (json.dumps({"rows": [{}, _row(ratio=10**400)]}), "rows[1].vs_native"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_a_kept_table_that_is_not_ours_adds_nothing_and_one_warning(tmp_path, content, why):
    folder = auto_adapter_dir("f" * 16, tmp_path)
    folder.mkdir(parents=True)
    (folder / QUALITY_FILE).write_text(content)
    kept = kept_quality("f" * 16, tmp_path)
    assert kept.table == {}
    assert kept.warning.startswith(f"{folder / QUALITY_FILE}: ") and why in kept.warning


def test_edge0_info_over_a_kept_table_out_of_range_is_one_warning(checkpoint_dir, private_data_dir):
    """Issue 47 item 8: `{"k": 1e400}` was an OverflowError traceback in `edge0 info` (and the
    app's engine, and `serve`, which calls the same `info()` at open)."""
    from engine.checkpoint.index import CheckpointIndex, base_fingerprint

    model = checkpoint_dir("qwen3_moe")
    index = CheckpointIndex(model)
    index.add_moe_layers_by_name()  # as the catalog finds the fingerprint, without loading
    fingerprint = base_fingerprint(index)
    folder = auto_adapter_dir(fingerprint, private_data_dir)
    folder.mkdir(parents=True)
    (folder / QUALITY_FILE).write_text('{"rows": [{}, {"k": 1e400, "variant": "heads only"}]}')
    done = run_cli("info", str(model), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["profile_quality"] == {}
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"edge0: warning: {folder / QUALITY_FILE}: rows[1].k: inf")


async def test_the_app_says_a_kept_table_it_ignores(checkpoint_dir, private_data_dir, tmp_path):
    """The app's engine opens over the same table with one warning, as `info` and `serve`."""
    from test_tui_app import make_app, ready, record_notifications

    from engine.checkpoint.index import CheckpointIndex, base_fingerprint

    model = checkpoint_dir("qwen3_moe")
    index = CheckpointIndex(model)
    index.add_moe_layers_by_name()
    folder = auto_adapter_dir(base_fingerprint(index), private_data_dir)
    folder.mkdir(parents=True)
    (folder / QUALITY_FILE).write_text('{"rows": [{}, {"k": 1e400, "variant": "heads only"}]}')
    app = make_app(model, tmp_path)
    notices = record_notifications(app)
    async with app.run_test() as pilot:
        await ready(app, pilot)
        said = [text for text, severity in notices if severity == "warning"]
        assert any(t.startswith(f"{folder / QUALITY_FILE}: rows[1].k: inf") for t in said), said


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

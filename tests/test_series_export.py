"""The live series exported from the palette (issue 35, "Export"): after a reply, CSV and JSON
hold one row per decode step the panels show, with the engine's own figures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from test_tui_app import SIZE, make_app, ready, record_notifications, reply_done, send

from edge0_tui.series_export import FIELDS


@pytest.fixture
def model(checkpoint_dir) -> Path:
    return checkpoint_dir("qwen3_moe", "tiny")


async def test_the_steps_export_as_csv_and_json_from_the_palette(model, tmp_path, monkeypatch):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    monkeypatch.setattr("edge0_tui.app.user_downloads_path", lambda: downloads)
    app = make_app(model, tmp_path)
    notices = record_notifications(app)
    async with app.run_test(size=SIZE) as pilot:
        await ready(app, pilot)
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        commands["Export the steps as CSV"].callback()  # nothing to export yet: said
        assert notices[-1] == ("no decode steps yet: export after a reply", "warning")
        await send(app, pilot, "hello there")
        await reply_done(app, pilot)
        steps = app.session.metrics.recent_steps
        assert steps
        for fmt in ("CSV", "JSON"):
            {c.title: c for c in app.get_system_commands(app.screen)}[
                f"Export the steps as {fmt}"
            ].callback()
    csv_file, json_file = sorted(downloads.glob("edge0-steps-*.csv")) + sorted(
        downloads.glob("edge0-steps-*.json")
    )
    rows = list(csv.DictReader(csv_file.open()))
    assert list(rows[0]) == list(FIELDS) and len(rows) == len(steps)
    assert [int(r["loads"]) for r in rows] == [s.loads for s in steps]
    assert [float(r["blocked_ms"]) for r in rows] == [round(s.blocked_ms, 3) for s in steps]
    assert all(r["mode"] == "on-demand" and r["k"] == "4" for r in rows)
    kept = json.loads(json_file.read_text())
    assert kept["fields"] == list(FIELDS) and len(kept["steps"]) == len(steps)
    assert [s["rss_bytes"] for s in kept["steps"]] == [s.rss_bytes for s in steps]
    assert any(str(csv_file) in message for message, _ in notices)

"""The step timeline: `edge0 generate --trace` writes a Chrome/Perfetto trace of real work, and
reads are served most urgent first."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from edge0_tui.cli import main
from engine import NO_TRACE, Tracer
from engine.experts.reads import ReadQueue

DEMO = Path(__file__).resolve().parent.parent / "assets" / "demo"


def test_generate_writes_a_trace_of_steps_reads_and_waits(tmp_path, capsys):
    trace = tmp_path / "steps.json"
    # The demo model has prerouter heads: reads ahead, on-demand misses and a head flush.
    code = main(
        [
            "generate",
            str(DEMO),
            "--prompt",
            "Where is the duke tonight?",
            "--chat",
            "--mode",
            "prerouter",
            "--k",
            "4",
            "--max-tokens",
            "6",
            "--expert-cache",
            "4M",
            "--trace",
            str(trace),
        ]
    )
    assert code == 0
    assert "trace written" in capsys.readouterr().err
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    kinds = {e["name"].rsplit(" ", 1)[0] for e in spans}
    assert {"decode", "prefill", "layer", "evaluate", "head", "sample", "pread", "queued"} <= {
        k.split(" ")[0] for k in kinds
    }
    assert any(e["name"].startswith("blocked ") and "read" in e.get("args", {}) for e in spans)
    assert all(e["dur"] >= 0 for e in spans)
    threads = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(name.startswith("edge0-read") for name in threads)  # reads on reader threads
    # Reads ahead run on reader threads; a blocked engine thread does urgent reads itself.
    engine_tids = {e["tid"] for e in spans if e["name"].startswith("decode step")}
    read_tids = {e["tid"] for e in spans if e["name"].startswith("pread")}
    assert len(engine_tids) == 1 and read_tids - engine_tids
    # One step span per forward: a prefill chunk, the last prompt token, then decode steps.
    steps = [e for e in spans if e["name"].endswith(" step")]
    decode = [e for e in steps if e["name"] == "decode step"]
    assert len(steps) == len(decode) + 2 and 1 <= len(decode) <= 5


def test_trace_of_an_unwritable_path_is_a_clear_error(tmp_path, capsys):
    code = main(
        ["generate", str(DEMO), "--prompt", "hi", "--max-tokens", "1"]
        + ["--trace", str(tmp_path / "no" / "such" / "dir" / "t.json")]
    )
    assert code == 2
    assert "cannot write the trace" in capsys.readouterr().err


def test_no_trace_records_nothing():
    with NO_TRACE.span("x", "y"):
        NO_TRACE.instant("i", "y")
    with pytest.raises(RuntimeError):
        NO_TRACE.write("/tmp/never.json")
    tracer = Tracer()
    with tracer.span("x", "y", n=1):
        pass
    assert [e["name"] for e in tracer.events if e["ph"] == "X"] == ["x"]


def test_reads_needed_now_go_before_reads_ahead_and_ahead_in_layer_order():
    queue = ReadQueue(threads=1, name="test-read")
    gate, order = threading.Event(), []
    try:
        queue.submit((0, 0), gate.wait)  # holds the only reader thread
        time.sleep(0.05)
        futures = [
            queue.submit((1, 5), order.append, "ahead for layer 5"),
            queue.submit((1, 2), order.append, "ahead for layer 2"),
            queue.submit((0, 0), order.append, "needed now"),
            queue.submit((1, 2), order.append, "second ahead for layer 2"),
        ]
        gate.set()
        for future in futures:
            future.result(timeout=5)
    finally:
        queue.shutdown()
    assert order == [
        "needed now",
        "ahead for layer 2",
        "second ahead for layer 2",
        "ahead for layer 5",
    ]


def test_read_queue_shutdown_cancels_queued_reads_and_reports_errors():
    queue = ReadQueue(threads=1, name="test-read")
    gate = threading.Event()
    running = queue.submit((0, 0), gate.wait)
    failing_later = queue.submit((0, 0), lambda: 1 / 0)
    queued = queue.submit((1, 3), lambda: "never")
    time.sleep(0.05)
    gate.set()
    with pytest.raises(ZeroDivisionError):
        failing_later.result(timeout=5)
    queue.shutdown()
    assert running.result() is True
    assert queued.cancelled() or queued.result() == "never"
    with pytest.raises(RuntimeError):
        queue.submit((0, 0), lambda: None)

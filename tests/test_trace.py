"""The step timeline: `edge0 generate --trace` writes a Chrome/Perfetto trace of real work, and
reads are served most urgent first."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from edge0_tui.cli import main
from engine import NO_TRACE, Tracer, compute_waits
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
    err = capsys.readouterr().err
    assert "trace written" in err
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
    # Each step says how often it waited on the device: prerouter at K=4 with its first layer
    # held in this 4M cache, once (its token and the next step's predictions, read together).
    assert all(e["args"]["host_syncs"] == 1 for e in decode)
    if sys.platform == "linux":  # MLX's compute thread's clock, sampled at every event
        busy = [e for e in events if e["ph"] == "C" and e["name"] == "MLX compute busy"]
        first, last = min(e["ts"] for e in decode), max(e["ts"] + e["dur"] for e in decode)
        during = [e["args"]["busy"] for e in busy if first <= e["ts"] <= last]
        assert len(during) > 10 * len(decode) and all(0 <= b <= 1 for b in during)
        assert min(during) < 0.5 < max(during)  # it computed, and it waited
        waits = compute_waits(events)
        assert waits.steps == len(decode) and 0 < waits.waited_ms < waits.step_ms
        assert "MLX compute waited" in err


def _span(name: str, tid: int, start: float, end: float) -> dict:
    return {"name": name, "ph": "X", "tid": tid, "ts": start, "dur": end - start}


def test_compute_waits_add_up_the_idle_share_by_what_the_engine_thread_did():
    engine = 1
    busy = [(0, 0.0), (200, 1.0), (600, 0.5), (700, 1.0), (2100, 1.0)]  # from each ts on
    events = [
        _span("decode step", engine, 0, 1000),
        _span("layer 0", engine, 0, 300),
        _span("blocked 0.5", engine, 100, 250),  # inside layer 0
        _span("layer 1", engine, 300, 700),
        _span("sample", engine, 900, 1000),
        _span("decode step", engine, 1000, 2000),  # the compute never waited in this one
    ] + [{"name": "MLX compute busy", "ph": "C", "ts": t, "args": {"busy": b}} for t, b in busy]
    waits = compute_waits(events)
    assert waits.steps == 2 and waits.step_ms == pytest.approx(1.0)
    # Waits: 0-200 all idle (layer 0 100, blocked 100), 600-700 half idle (layer 1 50 us).
    assert waits.waited_ms == pytest.approx(0.125)
    assert waits.by_engine_span == pytest.approx({"layer": 0.075, "blocked": 0.05})
    assert compute_waits([e for e in events if e["ph"] != "C"]) is None


def test_a_followed_clock_becomes_a_counter_track_of_busy_shares():
    tracer = Tracer()
    tracer.follow_clock(time.CLOCK_THREAD_CPUTIME_ID, "this thread busy")
    with tracer.span("spin", "test"):
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:  # on a core
            pass
    with tracer.span("sleep", "test"):
        time.sleep(0.05)  # off it
    tracer.instant("done", "test")
    shares = [e["args"]["busy"] for e in tracer.events if e["ph"] == "C"]
    assert len(shares) >= 3 and all(0 <= s <= 1 for s in shares)
    # Samples at the span starts and ends: spinning, then sleeping.
    assert max(shares) > 0.5 and min(shares) < 0.2


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread CPU clocks of other threads: Linux")
def test_the_compute_thread_found_is_the_one_whose_cpu_time_grows_with_mlx_work():
    import mlx.core as mx

    from engine.runtime.compute_activity import find_compute_thread, thread_cpu_ns

    tid = find_compute_thread()
    assert tid is not None and tid not in {t.native_id for t in threading.enumerate()}
    before = thread_cpu_ns(tid)
    x = mx.random.uniform(shape=(1 << 20,))
    for _ in range(30):
        x = mx.exp(-x)
        mx.eval(x)
    assert thread_cpu_ns(tid) - before > 1_000_000  # over 1 ms of CPU for 30 MiB-passes


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


def test_tracing_leaves_a_seeded_reply_as_it_is():
    """Following MLX's compute thread (a probe evaluation when first traced) draws no random
    numbers: a sampled reply with a seed is the same traced or not."""
    from engine import Engine, EngineConfig, GenerationConfig

    gen = GenerationConfig(max_tokens=8, temperature=1.0, seed=7)
    config = EngineConfig(mode="on-demand", k=4, expert_cache_bytes=4 << 20)
    replies = []
    for tracer in (NO_TRACE, Tracer()):
        with Engine(DEMO, config, tracer=tracer) as engine:
            replies.append(engine.generate(engine.encode("Where is the duke?"), gen).tokens)
    assert replies[0] == replies[1]


def test_the_docs_describe_the_trace_the_file_holds():
    """README and docs name the compute counter track the trace writes (issue 35 item 8: the
    README once described an "MLX compute (sampled)" track with `computing` spans)."""
    from pathlib import Path

    from engine.runtime.compute_activity import COMPUTE_TRACK

    root = Path(__file__).resolve().parents[1]
    docs = {name: (root / name).read_text() for name in ("README.md", "docs/design.md")}
    assert f'"{COMPUTE_TRACK}"' in docs["docs/design.md"]
    for name, text in docs.items():
        assert "MLX compute (sampled)" not in text and "`computing`" not in text, name
    assert "Ctrl+Q quits" in docs["README.md"]


def test_the_reply_ends_before_the_trace_lines(tmp_path):
    """On a terminal stdout and stderr interleave: the reply's last line (and its newline) comes
    before what --trace says on stderr, not after it."""
    import subprocess

    trace = tmp_path / "steps.json"
    command = [
        sys.executable, "-m", "edge0_tui.cli", "generate", str(DEMO), "--prompt", "Speak.",
        "--max-tokens", "4", "--trace", str(trace),
    ]  # fmt: skip
    done = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
        cwd=DEMO.parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    written = next(i for i, line in enumerate(lines) if "trace written" in line)
    summary = next(i for i, line in enumerate(lines) if "tok/s" in line)
    assert summary < written  # the reply, then its summary, then the trace's lines
    assert not lines[written - 1].startswith("edge0:") or "tok/s" in lines[written - 1]

"""When MLX's compute thread computes and when it waits, for the step timeline.

On the CPU, MLX evaluates a graph on one stream thread of its own, which no trace event can come
from. Its CPU-time clock can still be read from the engine's threads (Linux gives every thread a
clock: `clock_gettime` on an id made from its thread id), so a `Tracer` told to follow it samples
it at every event and writes a counter track, the share of each stretch between two events that
compute was on a core (`Tracer.follow_clock`). No sampler thread: one would need the GIL, which
the engine thread holds while it builds a layer, just when the samples matter. The dips in that
track, beside the engine thread's spans, tell reads that cost compute time from reads hidden
under it; `compute_waits` adds them up per decode step by what the engine thread was doing.

Linux only, and only with compute on the CPU (on a GPU the stream thread only encodes).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from ..trace import Tracer

# The counter track the engine's trace gets for MLX's compute thread.
COMPUTE_TRACK = "MLX compute busy"
# The kernel's clock id for a thread's CPU time (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)).
_PER_THREAD = 4
_SCHED = 2


def thread_cpu_clock(tid: int) -> int:
    """The clock id whose `clock_gettime` is thread `tid`'s CPU time (Linux)."""
    return ((~tid) << 3) | _PER_THREAD | _SCHED


def follow_compute(tracer: Tracer) -> bool:
    """Have `tracer` sample MLX's compute thread at every event (see the module). False where
    that thread cannot be found or followed."""
    tid = find_compute_thread()
    if tid is None:
        return False
    tracer.follow_clock(thread_cpu_clock(tid), COMPUTE_TRACK)
    return True


def thread_cpu_ns(tid: int) -> int | None:
    """Thread `tid`'s CPU time in ns, or None where it cannot be read (ended, not Linux)."""
    try:
        return time.clock_gettime_ns(thread_cpu_clock(tid))
    except (OSError, OverflowError, AttributeError):
        return None


def find_compute_thread() -> int | None:
    """The thread id of MLX's CPU stream thread, or None where it cannot be found (not Linux,
    compute on a GPU): the thread outside Python's own whose CPU time grows while a probe
    computes."""
    if not os.path.isdir("/proc/self/task") or mx.default_device().type != mx.DeviceType.cpu:
        return None
    python = {thread.native_id for thread in threading.enumerate()}
    mx.eval(mx.zeros(1) + 1)  # MLX starts its stream thread on the first evaluation
    before = {tid: thread_cpu_ns(tid) for tid in _native_threads() if tid not in python}
    probe = mx.arange(1 << 20, dtype=mx.float32)  # not mx.random: a seeded reply stays the same
    for _ in range(20):
        probe = mx.sin(probe)  # elementwise, on the stream thread (no BLAS, no helper threads)
        mx.eval(probe)
    grown = {}
    for tid, start in before.items():
        now = thread_cpu_ns(tid)
        if start is not None and now is not None:
            grown[tid] = now - start
    if not grown:
        return None
    tid = max(grown, key=grown.get)
    return tid if grown[tid] > 0 else None


def _native_threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


@dataclass
class ComputeWaits:
    """How long the compute thread waited in a trace's decode steps, and what the engine thread
    was doing meanwhile (its innermost span: `layer N` building a layer's graph, `router sync`,
    `blocked`, `evaluate`, ...; numbers dropped so that like spans add up)."""

    steps: int
    step_ms: float  # means over the steps
    waited_ms: float
    by_engine_span: dict[str, float]  # ms per step


def compute_waits(events: list[dict], step_name: str = "decode step") -> ComputeWaits | None:
    """Add up, inside every `step_name` span of a trace's events (one process's), the time the
    followed compute clock's counter track says compute was off its core, by the engine thread's
    innermost span at the time. None without such a track."""
    samples = sorted(
        (e["ts"], e["args"]["busy"])
        for e in events
        if e.get("ph") == "C" and e.get("name") == COMPUTE_TRACK
    )
    if not samples:
        return None
    steps = [e for e in events if e.get("name") == step_name and e.get("ph") == "X"]
    engine_tid = steps[0]["tid"] if steps else None
    engine = _innermost(
        sorted(
            (e["ts"], e["ts"] + e["dur"], _kind(e["name"]))
            for e in events
            if e.get("tid") == engine_tid and e.get("ph") == "X" and _doing(e, step_name)
        )
    )
    starts = [piece[0] for piece in engine]
    waited = 0.0
    by_span: dict[str, float] = {}
    times = [t for t, _ in samples]
    for step in steps:
        step_start, step_end = step["ts"], step["ts"] + step["dur"]
        for i in range(max(bisect.bisect_right(times, step_start) - 1, 0), len(samples) - 1):
            (t0, busy), t1 = samples[i], times[i + 1]
            if t0 >= step_end:
                break
            start, end = max(t0, step_start), min(t1, step_end)
            if end <= start or busy >= 1.0:
                continue
            idle = 1.0 - busy
            waited += (end - start) * idle
            for label, overlap in _overlaps(engine, starts, start, end):
                by_span[label] = by_span.get(label, 0.0) + overlap * idle
    n = max(len(steps), 1)
    step_ms = sum(s["dur"] for s in steps) / n / 1e3
    ordered = sorted(by_span.items(), key=lambda kv: -kv[1])
    return ComputeWaits(len(steps), step_ms, waited / n / 1e3, {k: v / n / 1e3 for k, v in ordered})


def largest_waits(by_engine_span: dict[str, float], count: int = 4) -> str:
    """The `count` engine spans compute waited under the longest, as "layer 7.3, pread 3.3"."""
    parts = sorted(by_engine_span.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {ms:.1f}" for name, ms in parts)


def _doing(event: dict, step_name: str) -> bool:
    """Whether a span of the engine thread says what it was doing: not the step itself, and not
    a read's `queued` span (from its submission to its start, whoever ran it meanwhile)."""
    return event["name"] != step_name and not event["name"].startswith("queued")


def _kind(name: str) -> str:
    """A span's name without its layer or expert numbers: `blocked 3.17` -> `blocked`."""
    words = [w for w in name.split() if not w.replace(".", "").isdigit()]
    return " ".join(words) or name


def _innermost(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Nested spans (sorted by start) flattened into back-to-back (start, end, label) pieces, each
    labelled by the innermost span over it ("between spans" where none is)."""
    pieces: list[tuple[float, float, str]] = []
    stack: list[tuple[float, str]] = []  # (end, label) of the open spans, innermost last
    cursor = spans[0][0] if spans else 0.0

    def advance(to: float) -> None:
        nonlocal cursor
        while stack and stack[-1][0] <= to:  # close spans that end before `to`
            end, label = stack.pop()
            if end > cursor:
                pieces.append((cursor, end, label))
                cursor = end
        if to > cursor:
            pieces.append((cursor, to, stack[-1][1] if stack else "between spans"))
            cursor = to

    for start, end, label in spans:
        advance(start)
        stack.append((end, label))
    advance(float("inf") if not stack else max(e for e, _ in stack))
    return pieces


def _overlaps(
    pieces: list[tuple[float, float, str]], starts: list[float], start: float, end: float
):
    """(label, time) of [start, end] by the engine's innermost span (`pieces` from `_innermost`,
    `starts` their start times)."""
    first = max(bisect.bisect_right(starts, start) - 1, 0)
    covered = start
    for piece_start, piece_end, label in pieces[first:]:
        if piece_start >= end:
            break
        overlap = min(piece_end, end) - max(piece_start, start)
        if overlap > 0:
            yield label, overlap
            covered = min(piece_end, end)
    if covered < end:
        yield "between spans", end - covered

"""A step timeline in the Chrome / Perfetto trace format: where every millisecond of a step went.

The engine thread records each forward's phases (graph building per layer, waits on the true
router, blocked waits on expert reads with the expert they waited for, the final evaluation, the
head flush, sampling); each reader thread records its reads (time queued, pread, copy into MLX
memory). Open the written JSON in https://ui.perfetto.dev or chrome://tracing.

MLX computes lazily on its own stream thread, which records nothing itself: a layer's compute runs
between its `async_eval` (an instant marked "submit") and the step's final evaluation. Where that
thread's CPU clock can be read (Linux, compute on the CPU: `runtime/compute_activity.py`), every
event also samples it, and the trace gets a counter track: the share of the time since the
previous event that compute was on a core. Its dips are compute waiting, and the engine span
above a dip says for what. Blocked waits while earlier layers were submitted are reads that
compute did not hide.

Tracing is off unless a `Tracer` is passed down; `NO_TRACE` records nothing at almost no cost.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path


class Tracer:
    """Collects trace events from any thread; `write` saves them as Chrome trace JSON."""

    enabled = True
    # Whether the engine has this trace follow MLX's compute thread (`follow_clock`).
    samples_compute = True

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._named_threads: set[int] = set()
        # A thread's CPU clock sampled at every event (None: none followed, or its thread ended),
        # the counter track its samples make, and the samples: (perf_counter time, CPU ns).
        self._clock: int | None = None
        self._clock_name = ""
        self._clock_samples: list[tuple[float, int]] = []

    def follow_clock(self, clock_id: int, track: str) -> None:
        """Sample the CPU-time clock `clock_id` (of a thread that records nothing itself) at every
        event from now on; `write` turns the samples into the counter track `track`."""
        self._clock, self._clock_name = clock_id, track

    def now(self) -> float:
        """A timestamp for `complete` (seconds, perf_counter)."""
        return self._tick()

    @contextmanager
    def span(self, name: str, category: str, **args):
        """Record the time the `with` block takes, on the calling thread."""
        start = self._tick()
        try:
            yield
        finally:
            self.complete(name, category, start, time.perf_counter(), **args)

    def complete(self, name: str, category: str, start: float, end: float, **args) -> None:
        """Record a span measured elsewhere (`start`, `end` from `now()`), on the calling thread."""
        self._add(
            {
                "name": name,
                "cat": category,
                "ph": "X",
                "ts": self._us(start),
                "dur": (end - start) * 1e6,
            },
            args,
        )

    def instant(self, name: str, category: str, **args) -> None:
        self._add(
            {
                "name": name,
                "cat": category,
                "ph": "i",
                "s": "t",
                "ts": self._us(time.perf_counter()),
            },
            args,
        )

    def counter(self, name: str, **values: float) -> None:
        """A counter track (e.g. bytes in flight), drawn as a graph."""
        self._add({"name": name, "ph": "C", "ts": self._us(time.perf_counter())}, values)

    def write(self, path: str | Path, events: list[dict] | None = None) -> Path:
        """Write the trace; `events`: `self.events` where the caller has it already (building it
        sorts every clock sample)."""
        path = Path(path)
        events = self.events if events is None else events
        document = {"traceEvents": events, "displayTimeUnit": "ms"}
        path.write_text(json.dumps(document, separators=(",", ":")) + "\n")
        return path

    @property
    def events(self) -> list[dict]:
        """The events so far, the followed clock's counter track included."""
        with self._lock:
            return list(self._events) + self._clock_track()

    def _us(self, t: float) -> float:
        return (t - self._origin) * 1e6

    def _tick(self) -> float:
        """The time now, and a sample of the followed clock (if any) at that time."""
        now = time.perf_counter()
        if self._clock is not None:
            try:
                cpu = time.clock_gettime_ns(self._clock)
            except OSError:  # the thread ended: stop following it
                self._clock = None
            else:
                self._clock_samples.append((now, cpu))  # append is thread-safe
        return now

    def _clock_track(self) -> list[dict]:
        """Counter events: at each sample, the share of the time until the next one that the
        followed thread was on a core (samples from several threads, so sorted first)."""
        samples = sorted(self._clock_samples)
        pid = os.getpid()
        counters = []
        for (t0, cpu0), (t1, cpu1) in zip(samples, samples[1:]):
            if t1 > t0:
                busy = min(max((cpu1 - cpu0) / 1e9 / (t1 - t0), 0.0), 1.0)
                counters.append(
                    {
                        "name": self._clock_name,
                        "ph": "C",
                        "pid": pid,
                        "ts": self._us(t0),
                        "args": {"busy": round(busy, 4)},
                    }
                )
        return counters

    def _add(self, event: dict, args: dict) -> None:
        self._tick()
        thread = threading.current_thread()
        event["pid"], event["tid"] = os.getpid(), thread.ident
        if args:
            event["args"] = args
        with self._lock:
            if thread.ident not in self._named_threads:
                self._named_threads.add(thread.ident)
                name = "engine" if thread is threading.main_thread() else thread.name
                self._events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": event["pid"],
                        "tid": thread.ident,
                        "args": {"name": name},
                    }
                )
            self._events.append(event)


class _NoTrace(Tracer):
    """Records nothing: the default, so traced code needs no `if tracer` around each call."""

    enabled = False
    samples_compute = False

    def __init__(self) -> None:
        pass

    def follow_clock(self, clock_id: int, track: str) -> None:
        pass

    def now(self) -> float:
        return time.perf_counter()

    @contextmanager
    def span(self, name: str, category: str, **args):
        yield

    def complete(self, name: str, category: str, start: float, end: float, **args) -> None:
        pass

    def instant(self, name: str, category: str, **args) -> None:
        pass

    def counter(self, name: str, **values: float) -> None:
        pass

    def write(self, path: str | Path, events: list[dict] | None = None) -> Path:
        raise RuntimeError("tracing is off: pass a Tracer to record a trace")


NO_TRACE: Tracer = _NoTrace()

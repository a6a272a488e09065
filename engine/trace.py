"""A step timeline in the Chrome / Perfetto trace format: where every millisecond of a step went.

The engine thread records each forward's phases (graph building per layer, waits on the true
router, blocked waits on expert reads with the expert they waited for, the final evaluation, the
head flush, sampling); each reader thread records its reads (time queued, pread, copy into MLX
memory). Open the written JSON in https://ui.perfetto.dev or chrome://tracing.

MLX computes lazily on its own stream thread, which this module cannot see: a layer's compute runs
between its `async_eval` (an instant marked "submit") and the step's final evaluation. Blocked
waits while earlier layers were submitted are reads that compute did not hide.

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

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._named_threads: set[int] = set()

    def now(self) -> float:
        """A timestamp for `complete` (seconds, perf_counter)."""
        return time.perf_counter()

    @contextmanager
    def span(self, name: str, category: str, **args):
        """Record the time the `with` block takes, on the calling thread."""
        start = time.perf_counter()
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

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        with self._lock:
            events = list(self._events)
        document = {"traceEvents": events, "displayTimeUnit": "ms"}
        path.write_text(json.dumps(document, separators=(",", ":")) + "\n")
        return path

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def _us(self, t: float) -> float:
        return (t - self._origin) * 1e6

    def _add(self, event: dict, args: dict) -> None:
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

    def __init__(self) -> None:
        pass

    @contextmanager
    def span(self, name: str, category: str, **args):
        yield

    def complete(self, name: str, category: str, start: float, end: float, **args) -> None:
        pass

    def instant(self, name: str, category: str, **args) -> None:
        pass

    def counter(self, name: str, **values: float) -> None:
        pass

    def write(self, path: str | Path) -> Path:
        raise RuntimeError("tracing is off: pass a Tracer to record a trace")


NO_TRACE: Tracer = _NoTrace()

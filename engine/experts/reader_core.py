"""A core of its own for the reader threads, on Linux CPU compute.

On the MLX CPU backend one thread computes a step (MLX's stream worker) while the reader threads
copy experts: from the page cache into a buffer (`pread`), into MLX memory, and in a memory cgroup
the kernel reclaims pages on their behalf. Left to the scheduler, the readers share the compute
thread's core whenever they wake, and a read issued ahead then costs compute time instead of hiding
under it. On the 2-core CI box, pinning the readers took prerouter on the real-routing wall much
closer to its overlap limit (docs/notebook/figures-from-code-comments.md).

So in prerouter mode the readers run on the last core the process may use, and with them every
Python thread (the engine's, which builds the next layer's graph while the current one computes,
and an app's); MLX's stream worker, which computes, and any other native thread (BLAS) run on the
rest. With the engine thread on the compute core instead, building a layer took compute time from
the layer it should run under: on the wall preset, warm, prerouter decode steps were slower than
with this split, and slower than unpinned (figures as above). Threads started later inherit
their creator's cores (MLX starts its worker on the first evaluation, while loading, before
anything is pinned). Only in prerouter mode: on-demand and prefetch misses are read partly by the
engine thread itself while the forward waits, and confined to the compute cores those reads cost
more than they save (on-demand's step grew on the same wall). Nothing is pinned with fewer than
two cores, off Linux (no thread affinity on macOS) or when compute is on a GPU (the CPU then only
reads).
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx


def reader_cores() -> tuple[set[int], set[int]] | None:
    """(compute cores, reader cores) for this process, or None where nothing is pinned."""
    if not hasattr(os, "sched_setaffinity") or mx.default_device().type != mx.DeviceType.cpu:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    return set(allowed[:-1]), {allowed[-1]}


def pin_threads(compute: set[int], reader: set[int], readers: set[int]) -> None:
    """Run the `readers` (native thread ids) and every Python thread on the `reader` cores, the
    process's other threads (MLX's compute worker, BLAS) on the `compute` cores."""
    python = {thread.native_id for thread in threading.enumerate()}
    for task in _threads():
        _pin(task, reader if task in readers or task in python else compute)


def unpin_all_threads(cores: set[int]) -> None:
    """Let every thread of the process run on `cores` again (the engine closed: a process that
    goes on, a test run or the app loading another model, gets its cores back, and so do the
    processes it starts, which inherit its mask)."""
    for task in _threads():
        _pin(task, cores)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _pin(task: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(task, cores)
    except OSError:  # ended meanwhile, or not allowed: leave it
        pass

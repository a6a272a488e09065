"""The doctor's disk checks: cold read bandwidth, the fixed cost of one load, F_NOCACHE on macOS.

Cold means not in the page cache, and every figure says how that was proven: the shards' pages
are dropped (Linux: posix_fadvise(DONTNEED); macOS, which has no fadvise: msync(MS_INVALIDATE)
over a shared mapping of the file, as vmtouch -e does there; not yet run on a Mac) and `mincore`
then shows how much of the sampled expert bytes is still resident; the engine's reader counts
each read's cold bytes with `mincore` just before it reads. On macOS the reads go through
F_NOCACHE descriptors, as the engine's do under a page-cache budget.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import random
import sys
import time
from concurrent.futures import wait
from pathlib import Path

from ..checkpoint.index import CheckpointIndex
from ..config import EngineConfig, format_bytes
from ..experts.page_cache import LIBC, PAGE_SIZE, FileResidency, evict_file
from ..experts.page_cache_budget import CAN_EVICT_RANGES
from ..experts.reads import ExpertReader
from ..runtime.generation import Engine
from .doctor_checks import COLD_READS, NO_FAULTS, Check, Faults, fail, median, ok, skipped

# At most this many expert bytes are read for the bandwidth (a large model's disk is measured on a
# sample of its experts, in random order).
SAMPLE_BYTES = 128 << 20
# Cold one-page reads timed for the fixed cost of a load.
LATENCY_READS = 64
# At least this share of the sampled bytes must be absent from the page cache before the reads
# for the figure to be the disk's.
COLD_SHARE = 0.9


def _index(model_dir: Path) -> tuple[CheckpointIndex, int]:
    """The checkpoint's index with its MoE layers registered, and the engine's reader threads."""
    with Engine(model_dir, EngineConfig(mode="on-demand", refuse_over_plan=False)) as engine:
        return engine.loaded.index, engine.config.reader_threads


def _sample(index: CheckpointIndex) -> list[tuple[int, int]]:
    """(layer, expert) pairs in random order, at most SAMPLE_BYTES of them."""
    experts = [(n, e) for n, layer in index.layers.items() for e in range(layer.num_experts)]
    random.Random(0).shuffle(experts)
    size = next(iter(index.layers.values())).expert_nbytes
    return experts[: max(1, SAMPLE_BYTES // max(1, size))]


def _ranges(index: CheckpointIndex, experts: list[tuple[int, int]]) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of every tensor of the sampled experts."""
    return [
        (t.entry.file, t.entry.offset + e * t.expert_nbytes, t.expert_nbytes)
        for n, e in experts
        for t in index.layers[n].tensors
    ]


def _resident(ranges: list[tuple[Path, int, int]]) -> int:
    """Bytes of the ranges in the page cache now (mincore)."""
    files = {path: FileResidency(path) for path in {r[0] for r in ranges}}
    try:
        return sum(files[path].resident_bytes(offset, length) for path, offset, length in ranges)
    finally:
        for residency in files.values():
            residency.close()


def _evict(index: CheckpointIndex, ranges, faults: Faults) -> None:
    if faults.pages_kept:  # the fault: the pages read in, and left there
        for path, offset, length in ranges:
            with open(path, "rb") as f:
                f.seek(offset)
                f.read(length)
        return
    for shard in index.shards:
        if CAN_EVICT_RANGES:
            evict_file(shard)
        else:
            _invalidate(shard)


# msync's flag, the same on Linux and macOS (<sys/mman.h>).
MS_INVALIDATE = 2


def _invalidate(path: Path) -> None:
    """macOS: drop a file's clean cached pages with msync(MS_INVALIDATE) over a shared mapping
    (mincore, asked next, says whether it did)."""
    size = os.path.getsize(path)
    if size == 0:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        address = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        return
    LIBC.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    LIBC.msync(address, size, MS_INVALIDATE)
    LIBC.munmap(address, size)


def _how_proven(resident: int, total: int) -> str:
    how = "posix_fadvise(DONTNEED)" if CAN_EVICT_RANGES else "msync(MS_INVALIDATE)"
    return (
        f"evicted by {how}, then mincore found {format_bytes(resident)} of {format_bytes(total)} "
        "resident"
    )


def check_cold_reads(model_dir: Path, faults: Faults = NO_FAULTS) -> tuple[Check, Check]:
    """(cold read bandwidth, fixed cost of one load)."""
    index, threads = _index(model_dir)
    experts = _sample(index)
    ranges = _ranges(index, experts)
    total = sum(r[2] for r in ranges)
    fixed = _fixed_cost(index, ranges, faults)

    _evict(index, ranges, faults)
    resident = _resident(ranges)
    reader = ExpertReader(index, threads, bypass_page_cache=not CAN_EVICT_RANGES)
    try:
        start = time.perf_counter()
        reads = [reader.submit_expert(n, e, ahead=True) for n, e in experts]
        wait(reads)
        seconds = time.perf_counter() - start
        results = [r.result() for r in reads]
    finally:
        reader.close()
    read = sum(r.nbytes for r in results)
    cold = sum(r.cold_bytes for r in results)
    rate = read / seconds
    title = COLD_READS
    figures = {"bytes_per_s": rate, "bytes": read, "cold_bytes": cold}
    # (Reads find a little less than all of it cold: small tensors of neighbouring experts share
    # pages, and the first read of a page brings it in for the next.)
    detail = (
        f"{format_bytes(rate)}/s: {len(experts)} experts ({format_bytes(read)}, "
        f"{format_bytes(total // len(experts))} each) on {threads} reader threads, "
        f"{cold / read:.0%} of the bytes cold when read; {_how_proven(resident, total)}"
    )
    if resident > (1 - COLD_SHARE) * total:
        if not CAN_EVICT_RANGES:  # macOS: the pages could not be dropped
            cached = (
                f"{_how_proven(resident, total)}: the figure would be memory's; `sudo purge` "
                "drops every cached page, then run it again"
            )
            return skipped("disk", title, cached), fixed
        why = (
            f"{detail}: the pages stayed in the page cache, so the page-cache budget "
            "(--page-cache) cannot hold here either"
        )
        return fail("disk", title, why, **figures), fixed
    return ok("disk", title, detail, **figures), fixed


def _fixed_cost(index: CheckpointIndex, ranges, faults: Faults) -> Check:
    """The latency of a cold one-page read: what every load pays whatever its size."""
    title = "fixed cost of one load"
    _evict(index, ranges, faults)
    pages = {}
    for path, offset, _ in ranges:  # one page per sampled tensor, each page once
        pages.setdefault((path, offset // PAGE_SIZE * PAGE_SIZE), None)
    pages = list(pages)[:LATENCY_READS]
    files = {path: FileResidency(path) for path in {p for p, _ in pages}}
    fds = {path: _open_uncached(path) for path in files}
    times, warm = [], 0
    buffer = bytearray(PAGE_SIZE)
    try:
        for path, offset in pages:
            if files[path].resident_bytes(offset, 1):
                warm += 1  # cached already: not a cold read
                continue
            start = time.perf_counter()
            os.preadv(fds[path], [buffer], offset)
            times.append(time.perf_counter() - start)
    finally:
        for fd in fds.values():
            os.close(fd)
        for residency in files.values():
            residency.close()
    if len(times) < len(pages) // 2 or not times:
        why = f"{warm} of {len(pages)} pages were cached before their read (mincore)"
        if not CAN_EVICT_RANGES:
            return skipped("disk", title, why + ": `sudo purge`, then run it again")
        return fail("disk", title, why + ": posix_fadvise(DONTNEED) did not drop them")
    latency = median(times)
    return ok(
        "disk",
        title,
        f"{latency * 1e6:.0f} us (median of {len(times)} cold one-page reads, each proven absent "
        "by mincore just before)",
        latency_s=latency,
    )


def _open_uncached(path: Path) -> int:
    """A descriptor as the engine reads experts: no readahead (Linux), F_NOCACHE (macOS)."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    if hasattr(fcntl, "F_NOCACHE"):
        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
    return fd


def check_nocache(model_dir: Path) -> Check:
    """macOS: reads through an F_NOCACHE descriptor leave nothing in the page cache, so a read
    right after one is as cold (the page-cache budget there relies on it)."""
    title = "F_NOCACHE reads bypass the cache"
    if sys.platform != "darwin" or not hasattr(fcntl, "F_NOCACHE"):
        return skipped(
            "disk",
            title,
            "macOS only: Linux drops pages with posix_fadvise instead, proven in the cold-read line",
        )
    index, _ = _index(model_dir)
    ranges = _ranges(index, _sample(index))
    _evict(index, ranges, NO_FAULTS)
    ranges = [r for r in ranges if _resident([r]) == 0][:LATENCY_READS]
    if not ranges:
        return skipped(
            "disk", title, "every sampled expert page is cached: `sudo purge`, then run it again"
        )
    fds = {path: _open_uncached(path) for path in {r[0] for r in ranges}}
    try:
        for path, offset, length in ranges:
            os.preadv(fds[path], [bytearray(length)], offset)
    finally:
        for fd in fds.values():
            os.close(fd)
    after = _resident(ranges)
    total = sum(r[2] for r in ranges)
    detail = f"{len(ranges)} reads of absent pages left {format_bytes(after)} of {format_bytes(total)} cached"
    return fail("disk", title, detail) if after else ok("disk", title, detail)

"""Per-step metrics: where the time and the memory went.

One `StepMetrics` per forward pass. The expert store fills a `LoadCounters` during the step; the
generation loop adds wall time and a `MemorySnapshot`. Everything here is cheap enough to leave on:
page-cache residency of the checkpoint's expert tensors is the only costly probe (one mincore per
expert tensor), so it is re-sampled only as often as keeps it under a set share of step time.
"""

from __future__ import annotations

import ctypes
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from ..config import format_bytes
from ..experts.counters import LoadCounters, sum_layer_routed
from ..experts.page_cache import FileResidency

MIB = 1024 * 1024


@dataclass
class MemorySnapshot:
    mlx_active_bytes: int
    mlx_cache_bytes: int
    mlx_peak_bytes: int
    rss_bytes: int  # resident now
    page_cache_expert_bytes: int  # the checkpoint's expert tensors resident in the OS page cache
    # The kernel's high-water mark of the process's RSS now: since the request began where the
    # peak can be reset (`reset_process_peak_rss`), else since the process started.
    rss_peak_bytes: int = 0


@dataclass
class StepMetrics:
    phase: str  # "prefill" (everything up to the first token) or "decode"
    tokens: int  # input tokens in this forward
    wall_ms: float
    blocked_ms: float
    loads: int
    hits: int
    mib_read: float
    mib_per_load: float
    cold_fraction: float  # cold bytes / bytes read (0 when nothing was read)
    ms_per_load: float
    whole_layer_reads: int
    whole_layer_mib: float
    transient_peak_mib: float
    expert_pool_mib: float
    mlx_active_bytes: int
    mlx_cache_bytes: int
    mlx_peak_bytes: int
    rss_bytes: int  # resident when the step ended (a sample, not a peak)
    page_cache_expert_bytes: int
    rss_peak_bytes: int = 0  # the kernel's high-water mark when the step ended (MemorySnapshot's)
    mode: str = ""
    k: int = 0
    predicted: int = 0  # layers routed by the prerouter's prediction
    prefetch_issued: int = 0
    prefetch_in_time: int = 0
    prefetch_late: int = 0
    # Reads ahead given up because the expert cache could not also hold what a layer needed now
    # (its experts are read again when used): 0 when the cache holds a step's routed experts.
    prefetch_given_up: int = 0
    dropped: int = 0  # routed experts missing from the staged set: 0 by construction
    shadow_recall: float | None = None  # recall@K of predictions against the true routers
    prefetch_hit_rate: float | None = None  # prefetch: share of routed experts read ahead
    nonfinite_repaired: int = 0  # hidden values the numerical guard zeroed or clipped
    flush_ms: float = 0.0  # the prerouter head flush and issuing its reads
    page_cache_evicted_mib: float = 0.0  # expert pages dropped to keep the page-cache budget
    # The lookahead (routing/lookahead.py): reads issued for its guesses of this step's layers,
    # those read in time or late when the layer needed them, those the layer did not route to
    # (dropped when it routed), and the share of routed experts it had guessed.
    lookahead_issued: int = 0
    lookahead_in_time: int = 0
    lookahead_late: int = 0
    lookahead_dropped: int = 0
    lookahead_recall: float | None = None
    # Prefetch mode: head predictions made this step and not read ahead, their layer's heads
    # guessing it less well than the lookahead (the gate in experts/ledger.py).
    heads_not_read: int = 0
    # By MoE layer: where its routed experts came from (`LayerRouted` as a dict).
    routed_by_layer: dict[int, dict] = field(default_factory=dict)
    # Times the host waited on the device for a value (engine/host_reads.py): each one drains the
    # GPU's queue on Metal. By reason in `host_sync_reasons`.
    host_syncs: int = 0
    host_sync_reasons: dict[str, int] = field(default_factory=dict)
    # Host milliseconds spent on the grammar's mask of the token this step sampled (constrained
    # replies only: runtime/constraint.py).
    mask_ms: float = 0.0
    # Speculative decoding (runtime/speculative.py): tokens drafted into this forward (its
    # positions are `tokens`: the last token and the drafts), drafts the model kept, and the
    # tokens the step gave the reply (kept + 1; fewer where the reply ended within them).
    drafted: int = 0
    accepted: int = 0
    given: int = 1
    # Distinct (layer, expert) pairs the forward routed to (the union over its positions, what
    # it read or found resident) against the sum over positions of each one's own: their
    # difference is what one forward over the positions saved against one at a time.
    experts_union: int = 0
    experts_summed: int = 0

    @classmethod
    def build(
        cls,
        phase: str,
        tokens: int,
        wall_ms: float,
        counters: LoadCounters,
        memory: MemorySnapshot,
        expert_pool_bytes: int = 0,
        routing=None,
        mode: str = "",
        k: int = 0,
        nonfinite_repaired: int = 0,
        flush_ms: float = 0.0,
        host_syncs: int = 0,
        host_sync_reasons: dict[str, int] | None = None,
    ) -> StepMetrics:
        loads = counters.loads
        per_expert_bytes = counters.bytes_read - counters.whole_layer_bytes
        routed = {}
        if routing is not None:
            routed = {"predicted": routing.predicted, "dropped": routing.dropped}
            if routing.shadow_total:
                routed["shadow_recall"] = routing.shadow_hits / routing.shadow_total
            if routing.prefetch_routed:
                routed["prefetch_hit_rate"] = routing.prefetch_hits / routing.prefetch_routed
        guessed_of = sum(r.guessed_of for r in counters.layers.values())
        if guessed_of:
            routed["lookahead_recall"] = (
                sum(r.guessed_right for r in counters.layers.values()) / guessed_of
            )
        return cls(
            phase=phase,
            tokens=tokens,
            wall_ms=wall_ms,
            blocked_ms=counters.blocked_ms,
            loads=loads,
            hits=counters.hits,
            mib_read=counters.bytes_read / MIB,
            mib_per_load=per_expert_bytes / MIB / loads if loads else 0.0,
            cold_fraction=counters.cold_bytes / counters.bytes_read if counters.bytes_read else 0.0,
            ms_per_load=counters.read_ms / loads if loads else 0.0,
            whole_layer_reads=counters.whole_layer_reads,
            whole_layer_mib=counters.whole_layer_bytes / MIB,
            transient_peak_mib=counters.transient_peak_bytes / MIB,
            expert_pool_mib=expert_pool_bytes / MIB,
            **asdict(memory),
            mode=mode,
            k=k,
            prefetch_issued=counters.prefetch_issued,
            prefetch_in_time=counters.prefetch_in_time,
            prefetch_late=counters.prefetch_late,
            prefetch_given_up=counters.prefetch_given_up,
            nonfinite_repaired=nonfinite_repaired,
            flush_ms=flush_ms,
            page_cache_evicted_mib=counters.page_cache_evicted_bytes / MIB,
            lookahead_issued=counters.lookahead_issued,
            lookahead_in_time=counters.lookahead_in_time,
            lookahead_late=counters.lookahead_late,
            lookahead_dropped=counters.lookahead_dropped,
            heads_not_read=counters.heads_not_read,
            routed_by_layer={n: asdict(r) for n, r in sorted(counters.layers.items())},
            host_syncs=host_syncs,
            host_sync_reasons=host_sync_reasons or {},
            **routed,
        )

    def as_dict(self) -> dict:
        return asdict(self)


def metal_wired_limit_bytes() -> int | None:
    """How much memory Metal lets MLX wire on this Mac (the GPU's recommended working set);
    None where there is no Metal (Linux, CPU)."""
    try:
        if not mx.metal.is_available():
            return None
        value = mx.device_info().get("max_recommended_working_set_size")
    except (AttributeError, RuntimeError):
        return None
    return int(value) if value else None


def process_rss_bytes() -> int:
    """Resident set size now: /proc on Linux, proc_pidinfo on macOS; the peak as a last resort."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    if sys.platform == "darwin" and (current := _darwin_rss_bytes()) is not None:
        return current
    return _ru_maxrss_bytes()


def process_peak_rss_bytes() -> int:
    """The kernel's high-water mark of this process's resident set size: VmHWM on Linux (since the
    last `reset_process_peak_rss`), else ru_maxrss (the process's lifetime peak).

    Not a maximum of samples: a transient that comes and goes between two samples is in it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:  123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    # Linux's ru_maxrss is no substitute where VmHWM exists: it also counts the memory of the
    # process image before exec (a copy of the parent's at fork), and a reset does not lower it.
    return _ru_maxrss_bytes()


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


# The highest peaks read just before a reset: a report over the whole process (a training run, an
# eval, a soak) still sees the peaks of requests whose start reset the counters.
_lifetime_peak_rss_bytes = 0
_lifetime_peak_mlx_bytes = 0

PEAK_SCOPE_REQUEST = "request"  # the peak since the request began
PEAK_SCOPE_PROCESS = "process"  # the peak since the process started: it could not be reset


def reset_process_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS ("5" to /proc/self/clear_refs,
    Linux >= 4.0). False where it cannot (macOS, an older kernel, no permission, a sandbox without
    the file): `process_peak_rss_bytes` is then the process's lifetime peak."""
    global _lifetime_peak_rss_bytes
    before = process_peak_rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # missing, not writable, or EINVAL from a kernel without "5"
        return False
    _lifetime_peak_rss_bytes = max(_lifetime_peak_rss_bytes, before)
    return True


def reset_request_peaks() -> str:
    """Start a request's peaks: MLX's peak counter and the process's RSS high-water mark. Returns
    the scope of the RSS peak read at the request's end (PEAK_SCOPE_REQUEST or, where the kernel's
    mark cannot be reset, PEAK_SCOPE_PROCESS)."""
    global _lifetime_peak_mlx_bytes
    _lifetime_peak_mlx_bytes = max(_lifetime_peak_mlx_bytes, mx.get_peak_memory())
    mx.reset_peak_memory()
    return PEAK_SCOPE_REQUEST if reset_process_peak_rss() else PEAK_SCOPE_PROCESS


def process_lifetime_peaks() -> dict:
    """The most MLX memory and the most resident memory this process has held since it started,
    resets by `reset_request_peaks` included: the figures a whole run (training, eval, soak)
    reports, as `peak_mlx_bytes`, `peak_rss_bytes` and `peak_rss_scope`."""
    return {
        "peak_mlx_bytes": max(_lifetime_peak_mlx_bytes, mx.get_peak_memory()),
        "peak_rss_bytes": max(_lifetime_peak_rss_bytes, process_peak_rss_bytes()),
        "peak_rss_scope": PEAK_SCOPE_PROCESS,
    }


def peak_memory_line(peaks: dict | None = None) -> str:
    """'peak memory: MLX X, process RSS Y' (the process's lifetime peaks unless `peaks` given)."""
    peaks = peaks or process_lifetime_peaks()
    return (
        f"peak memory: MLX {format_bytes(peaks['peak_mlx_bytes'])}, process RSS "
        f"{format_bytes(peaks['peak_rss_bytes'])}"
    )


_PROC_PIDTASKINFO = 4  # <sys/proc_info.h>


def _darwin_rss_bytes() -> int | None:
    """macOS: struct proc_taskinfo is 6 uint64 then 12 int32 (96 bytes); pti_resident_size is the
    second uint64. One system call, no subprocess. Not run on a Mac here: any failure is None."""
    try:
        libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
        libc.proc_pidinfo.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        libc.proc_pidinfo.restype = ctypes.c_int
        info = (ctypes.c_uint64 * 12)()
        filled = libc.proc_pidinfo(os.getpid(), _PROC_PIDTASKINFO, 0, info, ctypes.sizeof(info))
    except (OSError, AttributeError):
        return None
    return int(info[1]) if filled == ctypes.sizeof(info) else None


class MemorySampler:
    """Reads MLX and process memory every step; page-cache residency of expert tensors when due."""

    def __init__(self, expert_ranges: list[tuple[Path, int, int]], max_share: float = 0.02) -> None:
        self._ranges = expert_ranges
        self._residency = {path: FileResidency(path) for path in {r[0] for r in expert_ranges}}
        self._max_share = max_share
        self._last_value = 0
        self.last_probe_seconds = 0.0
        self._last_at = -float("inf")
        self.probe_seconds = 0.0  # total time spent in page-cache probes

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(
            mlx_active_bytes=mx.get_active_memory(),
            mlx_cache_bytes=mx.get_cache_memory(),
            mlx_peak_bytes=mx.get_peak_memory(),
            rss_bytes=process_rss_bytes(),
            page_cache_expert_bytes=self._page_cache_bytes(),
            rss_peak_bytes=process_peak_rss_bytes(),
        )

    def _page_cache_bytes(self) -> int:
        now = time.perf_counter()
        # Re-sample only once the time since the last sample is cost/share: the probe then takes at
        # most `max_share` of wall time, whatever the checkpoint size.
        if now - self._last_at < self.last_probe_seconds / self._max_share:
            return self._last_value
        self._last_value = self.page_cache_bytes_now()
        self._last_at = time.perf_counter()
        self.last_probe_seconds = self._last_at - now
        self.probe_seconds += self.last_probe_seconds
        return self._last_value

    def page_cache_bytes_now(self) -> int:
        return sum(self._residency[p].resident_bytes(off, n) for p, off, n in self._ranges)

    def close(self) -> None:
        for residency in self._residency.values():
            residency.close()


def merged(steps: list[StepMetrics]) -> StepMetrics:
    """Several forwards as one (a prompt's prefill chunks): counts and times added, the cold
    fraction weighted by bytes, memory as after the last."""
    last = steps[-1]
    mib = sum(s.mib_read for s in steps)
    loads = sum(s.loads for s in steps)
    return replace(
        last,
        tokens=sum(s.tokens for s in steps),
        wall_ms=sum(s.wall_ms for s in steps),
        blocked_ms=sum(s.blocked_ms for s in steps),
        loads=loads,
        hits=sum(s.hits for s in steps),
        mib_read=mib,
        cold_fraction=sum(s.mib_read * s.cold_fraction for s in steps) / mib if mib else 0.0,
        ms_per_load=sum(s.ms_per_load * s.loads for s in steps) / loads if loads else 0.0,
        whole_layer_reads=sum(s.whole_layer_reads for s in steps),
        whole_layer_mib=sum(s.whole_layer_mib for s in steps),
        transient_peak_mib=max(s.transient_peak_mib for s in steps),
        page_cache_evicted_mib=sum(s.page_cache_evicted_mib for s in steps),
    )


def summarize(
    steps: list[StepMetrics],
    prompt_tokens: int,
    peak_mlx_bytes: int,
    peak_rss_bytes: int,
    peak_rss_scope: str,
) -> dict:
    """Medians of the decode-step metrics, prefill figures apart, and the request's peaks as read
    at its end: MLX's peak counter and the kernel's RSS high-water mark (`peak_rss_scope` says
    whether that is the request's or, where it could not be reset, the process's). The per-step
    `rss_bytes` are samples of the current RSS: their median is reported, never their maximum."""
    prefill = [s for s in steps if s.phase == "prefill"]
    decode = [s for s in steps if s.phase == "decode"]
    ttft_ms = sum(s.wall_ms for s in prefill)
    decode_ms = sum(s.wall_ms for s in decode)
    decoded = sum(s.given for s in decode)  # a verify step gives several tokens
    summary = {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": decoded + (1 if prefill else 0),
        "ttft_ms": ttft_ms,
        "prefill_tok_per_s": prompt_tokens / (ttft_ms / 1e3) if ttft_ms else 0.0,
        "decode_tok_per_s": decoded / (decode_ms / 1e3) if decode_ms else 0.0,
        "prefill_mib_read": sum(s.mib_read for s in prefill),
        "prefill_blocked_ms": sum(s.blocked_ms for s in prefill),
        "peak_mlx_bytes": peak_mlx_bytes,
        "peak_rss_bytes": peak_rss_bytes,
        "peak_rss_scope": peak_rss_scope,
        "peak_transient_mib": max((s.transient_peak_mib for s in steps), default=0.0),
        "dropped": sum(s.dropped for s in steps),
        "nonfinite_repaired": sum(s.nonfinite_repaired for s in steps),
        "mask_ms": sum(s.mask_ms for s in steps),
    }
    drafted = sum(s.drafted for s in decode)
    if drafted:
        summary["draft"] = {
            "steps": len(decode),
            "drafted": drafted,
            "accepted": sum(s.accepted for s in decode),
            "experts_union": sum(s.experts_union for s in decode),
            "experts_summed": sum(s.experts_summed for s in decode),
        }
    recalls = [s.shadow_recall for s in decode if s.shadow_recall is not None]
    if recalls:
        summary["shadow_recall"] = statistics.mean(recalls)
    hit_rates = [s.prefetch_hit_rate for s in decode if s.prefetch_hit_rate is not None]
    if hit_rates:
        summary["prefetch_hit_rate"] = statistics.mean(hit_rates)
    by_layer = routed_by_layer(decode)
    if by_layer:
        summary["routed_by_layer"] = by_layer
        guessed_of = sum(r["guessed_of"] for r in by_layer.values())
        if guessed_of:
            right = sum(r["guessed_right"] for r in by_layer.values())
            summary["lookahead_recall"] = right / guessed_of
    for name in (
        "wall_ms",
        "blocked_ms",
        "loads",
        "hits",
        "mib_read",
        "mib_per_load",
        "cold_fraction",
        "ms_per_load",
        "expert_pool_mib",
        "mlx_active_bytes",
        "mlx_cache_bytes",
        "page_cache_expert_bytes",
        "rss_bytes",
        "predicted",
        "prefetch_issued",
        "prefetch_in_time",
        "prefetch_late",
        "lookahead_issued",
        "lookahead_in_time",
        "lookahead_late",
        "lookahead_dropped",
        "heads_not_read",
        "flush_ms",
        "host_syncs",
        "mask_ms",
    ):
        values = [getattr(s, name) for s in decode]
        summary[f"median_{name}"] = statistics.median(values) if values else 0.0
    return summary


def routed_by_layer(steps: list[StepMetrics]) -> dict[int, dict]:
    """Where each MoE layer's routed experts came from over `steps` (summed): resident, read
    ahead by the heads, read ahead by the lookahead, missed; and the lookahead's recall of it
    (`lookahead_recall`, None for a layer it never guessed)."""
    out = {}
    for layer, total in sum_layer_routed(s.routed_by_layer for s in steps).items():
        row = asdict(total)
        row["lookahead_recall"] = (
            total.guessed_right / total.guessed_of if total.guessed_of else None
        )
        out[layer] = row
    return out

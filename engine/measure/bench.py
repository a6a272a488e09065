"""`edge0 bench`: the paper's same-session A/B, on any machine.

Single runs swing by tens of percent on shared machines, so every claim is a ratio from rotated
same-session runs:
- each arm (a mode: resident, on-demand, prerouter) runs in its own process, so MLX's allocator,
  peak counters and the pool start fresh;
- the order of the arms rotates every round;
- one token sequence is sampled once, then every arm replays it teacher-forced: same work;
  except where an arm drafts (`MODE+lookup`: speculative decoding, runtime/speculative.py):
  then every arm decodes greedily from the sampled prompt, the same work again, and the report
  says whether every run gave the same tokens (`greedy_tokens_identical`);
- all arms get the same expert-cache budget;
- `--ram-limit` puts each arm's process in a memory cgroup (anonymous memory and page cache
  together): the machine on which the checkpoint does not fit;
- `--cold` evicts the checkpoint's pages before each arm and proves it with mincore;
- `--read-limit` puts each arm's process in a blkio (v1) or io (v2) cgroup that throttles its reads
  from the checkpoint's disk: the I/O-bound machine (a laptop SSD under a fast GPU). The throttle
  lets short bursts through, so each arm reports the read bandwidth it achieved (`read_mib_per_s`).
Figures are medians over rounds, with min-max.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint.index import checkpoint_shards
from ..errors import Edge0Error
from ..experts.page_cache import FileResidency, evict_file
from ..runtime.ranks import run_ranks_here
from ..trace import Tracer
from . import bench_reads_ahead
from .bench_arms import (
    COMPUTE_ONLY,
    STREAMED_MODES,
    check_arms,
    compute_only_mode,
    drafted_mode,
    ranked_arm,
)
from .memory_cgroup import MemoryCgroup
from .read_limit import ReadLimitCgroup, block_device

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
READ_LIMITERS = ("cgroup", "pacing")
# (label, summary key, format) of the figures reported per arm.
FIGURES = (
    ("decode tok/s", "decode_tok_per_s", "{:.2f}"),
    ("ms/step", "median_wall_ms", "{:.1f}"),
    ("blocked ms/step", "median_blocked_ms", "{:.1f}"),
    ("flush ms/step", "median_flush_ms", "{:.1f}"),
    ("host syncs/step", "median_host_syncs", "{:.1f}"),
    ("loads/step", "median_loads", "{:.1f}"),
    ("MiB/step", "median_mib_read", "{:.1f}"),
    ("MiB/load", "median_mib_per_load", "{:.2f}"),
    ("cold fraction", "median_cold_fraction", "{:.2f}"),
    ("ms/load", "median_ms_per_load", "{:.2f}"),
    ("peak MLX MiB", "peak_mlx_mib", "{:.0f}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
    ("plan MiB", "plan_mib", "{:.0f}"),
    ("peak RSS / plan", "peak_rss_vs_plan", "{:.2f}"),
    ("page-cache share", "page_cache_share", "{:.2f}"),
    ("read MiB/s", "read_mib_per_s", "{:.1f}"),
    ("disk MiB read", "read_disk_mib", "{:.1f}"),
    ("cold MiB read", "read_cold_mib", "{:.1f}"),
    ("read-busy ms", "read_busy_ms", "{:.0f}"),
    ("compute waited ms/step", "compute_waited_ms", "{:.1f}"),
    ("sum ms/layer", "all_sum_ms", "{:.2f}"),  # ranked arms: one MoE layer's sum over the ranks
    ("sum ms/token", "all_sum_ms_per_token", "{:.1f}"),
    ("tokens/step", "tokens_per_step", "{:.2f}"),  # above 1 where an arm drafts
    ("drafts kept", "draft_kept_share", "{:.2f}"),
    *bench_reads_ahead.READ_AHEAD_FIGURES,
)


TABLE_4 = (
    "median_loads",
    "median_mib_read",
    "median_mib_per_load",
    "median_cold_fraction",
    "median_ms_per_load",
    "peak_mlx_mib",
    "peak_rss_mib",
    "plan_mib",
    "peak_rss_vs_plan",
    "page_cache_share",
)
# A run's true peak may pass its memory plan by this share before the report flags it (issue 31:
# the plan is computed before loading, from sizes, and the runtime term is measured at that time).
PLAN_SLACK = 0.10


@dataclass
class BenchConfig:
    model: Path
    arms: list[str]
    k: int | None = None
    rounds: int = 3
    tokens: int = 64
    prompt: str = DEFAULT_PROMPT
    expert_cache_bytes: int = 1 << 30
    # Each arm's expert cache takes what its memory plan leaves (in its cgroup, with --ram-limit).
    expert_cache_auto: bool = False
    ram_limit_bytes: int | None = None
    cold: bool = False
    read_limit_bps: int | None = None  # bytes/s each arm may read from the checkpoint's disk
    # How: "cgroup" (the kernel's throttle, Linux; lets bursts through) or "pacing" (the reader
    # threads pace cold bytes as one device of that bandwidth, any OS; experts/read_pacing.py).
    read_limit_by: str = "cgroup"
    seed: int = 0
    temperature: float = 0.7
    # Each host read of a device array waits this long more (EngineConfig.sync_cost_s): the GPU
    # queue drain it costs on Metal, modelled on any machine.
    sync_cost_s: float = 0.0
    trace_dir: Path | None = None  # each arm's step timeline: DIR/<arm>-round<N>.json
    # Every arm, resident included, computes prefill the same way: today's kernels with this,
    # else the dense prefill path wherever the arm's process has a fast BLAS (EngineConfig's).
    exact_kernels: bool = False
    # Each streaming arm's page-cache budget for the model's expert pages (EngineConfig's); None:
    # the OS's page cache as it is.
    page_cache_bytes: int | None = None
    # Where every arm looks for K profiles (EngineConfig's fields of the same names).
    adapter_dirs: tuple[Path, ...] = ()
    data_dir: Path | None = None

    @property
    def throttled(self) -> bool:
        """A read limit the kernel applies: each streaming arm in a read-throttled cgroup."""
        return self.read_limit_bps is not None and self.read_limit_by == "cgroup"

    @property
    def paced(self) -> bool:
        """A read limit the arms' reader threads apply (`ReadPacer`)."""
        return self.read_limit_bps is not None and self.read_limit_by == "pacing"


@dataclass
class ArmRun:
    arm: str
    round: int
    ok: bool
    summary: dict = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)
    error: str = ""
    cgroup_peak_bytes: int = 0
    evicted_check: float | None = None  # share of the checkpoint resident after eviction (--cold)
    read_limit_rules: list[str] = field(default_factory=list)  # the throttle, as the kernel read it
    device_read_bytes: int = 0  # what the arm's process read from the throttled disk (load too)
    tokens: list[int] = field(default_factory=list)  # the greedy tokens (where arms draft)


# -- one arm, in its own process --------------------------------------------------------------------


def run_arm(spec: dict) -> dict | None:
    """Run one arm (in the child process) and return its figures as plain data."""
    from ..config import EngineConfig, GenerationConfig
    from ..runtime.compute_activity import compute_waits
    from ..runtime.generation import Engine

    config = EngineConfig(
        mode=spec["mode"],
        expert_cache_bytes=spec["expert_cache_bytes"],
        expert_cache_auto=spec.get("expert_cache_auto", False),
        k=spec["k"],
        exact_kernels=spec.get("exact_kernels", False),
        adapter_dirs=tuple(Path(d) for d in spec["adapter_dirs"]),
        data_dir=Path(spec["data_dir"]) if spec["data_dir"] else None,
        read_pace_bps=spec.get("read_pace_bps"),
        page_cache_bytes=spec.get("page_cache_bytes"),
        sync_cost_s=spec.get("sync_cost_s", 0.0),
        expert_parallel=spec.get("ranks", 1) > 1,
    )
    reads = ReadSpans(whole_trace=spec.get("trace") is not None)
    with Engine(spec["model"], config, tracer=reads) as engine:
        if engine.share is not None and engine.share.rank != 0:
            engine.follow()  # rank 0 runs the arm; this rank runs each forward with it
            return None
        if spec.get("preload_experts"):
            engine.store.load_all()
            reads.spans.clear()
        if spec.get("sample"):
            prompt = engine.encode(spec["prompt"], chat=True)
            gen = GenerationConfig(spec["tokens"], spec["temperature"], 0.95, 0, spec["seed"])
            result = engine.generate(prompt, gen)
            return {"prompt_tokens": prompt, "tokens": result.tokens}
        disk_before = disk_read_bytes()
        if spec.get("greedy"):
            gen = GenerationConfig(spec["tokens"], ignore_eos=True, draft=spec.get("draft"))
            result = engine.generate(spec["prompt_tokens"], gen)
        else:
            result = engine.generate(spec["prompt_tokens"], forced_tokens=spec["forced_tokens"])
        disk_after = disk_read_bytes()
        summary = dict(result.summary)
        if spec.get("trace") is not None:
            events = reads.events
            reads.write(spec["trace"], events)
            if (waits := compute_waits(events)) is not None:
                summary["compute_waited_ms"] = waits.waited_ms
                summary["compute_waits_by_span"] = waits.by_engine_span
        summary["peak_mlx_mib"] = summary["peak_mlx_bytes"] / 2**20
        summary["peak_rss_mib"] = summary["peak_rss_bytes"] / 2**20
        # The plan this arm's process computed before it loaded, beside the peak it reached.
        plan_bytes = engine.memory_plan.total_bytes
        summary["plan_mib"] = plan_bytes / 2**20
        summary["peak_rss_vs_plan"] = summary["peak_rss_bytes"] / plan_bytes
        expert_bytes = engine.loaded.index.expert_nbytes
        summary["page_cache_share"] = summary["median_page_cache_expert_bytes"] / expert_bytes
        summary["k"] = engine.k
        if engine.share is not None:
            summary["all_sum_ms"] = engine.time_layer_sum()
            summary["all_sum_ms_per_token"] = summary["all_sum_ms"] * len(engine.loaded.blocks)
        if draft := summary.get("draft"):
            summary["tokens_per_step"] = (summary["generated_tokens"] - 1) / draft["steps"]
            summary["draft_kept_share"] = draft["accepted"] / draft["drafted"]
        disk = None if disk_before is None or disk_after is None else disk_after - disk_before
        summary.update(reads.achieved(disk))
        decode = [s.wall_ms for s in result.steps if s.phase == "decode"]
        return {"summary": summary, "step_ms": decode, "tokens": result.tokens}


class ReadSpans(Tracer):
    """A tracer that keeps only the reader threads' pread spans: (start, end, cold bytes).

    An arm's achieved read bandwidth is the bytes its process read from disk during the replay
    (`read_bytes` of /proc/self/io: what the block layer, and so the throttle, delivered, readahead
    included; where that is missing, the reads' cold bytes by mincore) over its read-busy time: the
    length of the union of its pread spans, i.e. the time during which at least one expert read was
    in flight. Concurrent reads share the throttled bandwidth, so overlapping spans count once;
    compute and waits with no read in flight do not count. mincore alone would undercount: a
    whole-layer read's readahead brings the next range in from disk before mincore looks at it.
    The model's load happens before the replay and is not counted.
    """

    def __init__(self, whole_trace: bool = False) -> None:
        super().__init__()
        self.spans: list[tuple[float, float, int]] = []
        self.whole_trace = whole_trace  # also keep every event, for `bench --trace`
        self.samples_compute = whole_trace

    def complete(self, name: str, category: str, start: float, end: float, **args) -> None:
        if category == "read" and name.startswith("pread"):
            self.spans.append((start, end, int(args.get("cold", 0))))  # append is thread-safe
        if self.whole_trace:
            super().complete(name, category, start, end, **args)

    def instant(self, name: str, category: str, **args) -> None:
        if self.whole_trace:
            super().instant(name, category, **args)

    def counter(self, name: str, **values: float) -> None:
        if self.whole_trace:
            super().counter(name, **values)

    def achieved(self, disk_bytes: int | None) -> dict:
        """`read_mib_per_s` with its parts `read_disk_mib` and `read_busy_ms`, and the reads' cold
        MiB by mincore; empty when nothing came from disk."""
        busy = 0.0
        reach = -float("inf")
        for start, end, _ in sorted(self.spans):
            if end > reach:
                busy += end - max(start, reach)
                reach = end
        cold = sum(c for _, _, c in self.spans)
        read = cold if disk_bytes is None else disk_bytes
        if not read or busy <= 0:
            return {}
        return {
            "read_disk_mib": read / 2**20,
            "read_cold_mib": cold / 2**20,
            "read_busy_ms": busy * 1e3,
            "read_mib_per_s": read / 2**20 / busy,
        }


def disk_read_bytes() -> int | None:
    """Bytes this process (all its threads) has caused to be read from storage; None off Linux."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _spawn(
    spec: dict, cgroups: list[MemoryCgroup | ReadLimitCgroup], timeout_s: float
) -> tuple[int, str, str]:
    def join() -> None:  # in the child, before exec; the memory group first (v2 nests in it)
        for group in cgroups:
            group.join()

    command = [sys.executable, "-m", "engine.measure.bench", json.dumps(spec)]
    if spec.get("ranks", 1) > 1:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            code = run_ranks_here(spec["ranks"], command, out, err, timeout_s)
            if code == -1:
                raise subprocess.TimeoutExpired(command, timeout_s)
            out.seek(0), err.seek(0)
            return code, out.read(), err.read()
    process = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        preexec_fn=join if cgroups else None,
    )
    return process.returncode, process.stdout, process.stderr


# -- the orchestrator -------------------------------------------------------------------------------


def rotation(arms: list[str], round_index: int) -> list[str]:
    """The arms in the order of round `round_index`: shifted by one each round."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]


def _evict_and_check(shards: list[Path]) -> float:
    """Evict every shard's pages; return the resident share left (mincore), which must be ~0."""
    total = resident = 0
    for shard in shards:
        evict_file(shard)
        residency = FileResidency(shard)
        resident += residency.resident_bytes(0, residency.size)
        total += residency.size
        residency.close()
    return resident / total if total else 0.0


def _warm(shards: list[Path]) -> None:
    for shard in shards:
        with open(shard, "rb") as f:
            while f.read(16 << 20):
                pass


def run_bench(config: BenchConfig, progress=print, timeout_s: float = 3600) -> dict:
    check_arms(config.arms)
    greedy = any(drafted_mode(a) is not None for a in config.arms)
    shards = checkpoint_shards(Path(config.model))
    base = {
        "model": str(config.model),
        "k": config.k,
        "expert_cache_bytes": config.expert_cache_bytes,
        "expert_cache_auto": config.expert_cache_auto,
        "seed": config.seed,
        "temperature": config.temperature,
        "exact_kernels": config.exact_kernels,
        "page_cache_bytes": config.page_cache_bytes,
        "sync_cost_s": config.sync_cost_s,
        "adapter_dirs": [str(d) for d in config.adapter_dirs],
        "data_dir": str(config.data_dir) if config.data_dir else None,
    }
    if config.ram_limit_bytes is not None:  # fail before any work if the limit cannot be made
        MemoryCgroup.create(config.ram_limit_bytes, "edge0-bench-probe").remove()
    if config.read_limit_by not in READ_LIMITERS:
        raise Edge0Error(
            f"unknown read limiter {config.read_limit_by!r}: choose one of {', '.join(READ_LIMITERS)}"
        )
    devices = []
    if config.throttled:
        devices = sorted({block_device(shard) for shard in shards})
        ReadLimitCgroup.create(
            config.read_limit_bps, devices, f"edge0-bench-{os.getpid()}-probe"
        ).remove()

    # Arms that decode greedily need only the prompt's tokens from it.
    sampled_tokens = 1 if greedy else config.tokens
    progress(f"sampling {sampled_tokens} tokens once (on-demand, T={config.temperature}) ...")
    sample_spec = dict(
        base, mode="on-demand", sample=True, prompt=config.prompt, tokens=sampled_tokens
    )
    code, out, err = _spawn(sample_spec, [], timeout_s)
    if code != 0:
        raise Edge0Error(f"sampling the token sequence failed: {_last_line(err)}")
    sampled = json.loads(out)
    if not config.cold:
        _warm(shards)

    for arm, settings in settings_not_taken(config).items():
        progress(f"{arm} runs without {', '.join(settings)}")
    runs: list[ArmRun] = []
    for r in range(config.rounds):
        for arm in rotation(list(config.arms), r):
            run = ArmRun(arm, r, ok=False)
            spec = dict(
                base,
                mode=drafted_mode(arm) or arm,
                prompt_tokens=sampled["prompt_tokens"],
                forced_tokens=sampled["tokens"],
                greedy=greedy,
                tokens=config.tokens,
                draft="lookup" if drafted_mode(arm) else None,
            )
            if (streamed := compute_only_mode(arm, config.arms)) is not None:
                cgroups = []
                spec.update(
                    mode=streamed,
                    preload_experts=True,
                    expert_cache_bytes=1 << 60,
                    expert_cache_auto=False,
                    page_cache_bytes=None,
                )
            elif (ranked := ranked_arm(arm)) is not None:
                spec.update(mode=ranked[0], ranks=ranked[1])
                if config.cold:
                    run.evicted_check = _evict_and_check(shards)
                cgroups = []  # (the report says so: settings_not_taken)
            else:
                if arm in settings_not_taken(config):
                    spec["page_cache_bytes"] = None  # (the report says so)
                if config.paced:
                    spec["read_pace_bps"] = config.read_limit_bps
                if config.cold:
                    run.evicted_check = _evict_and_check(shards)
                cgroups = _arm_cgroups(config, devices, f"{arm}-{r}")
            if config.trace_dir is not None:
                spec["trace"] = str(config.trace_dir / f"{arm}-round{r + 1}.json")
            started = time.perf_counter()
            try:
                code, out, err = _spawn(spec, cgroups, timeout_s)
            except subprocess.TimeoutExpired:
                code, out, err = -1, "", f"timed out after {timeout_s:.0f} s"
            finally:
                for group in reversed(cgroups):  # a v2 read group nests in the memory group
                    if isinstance(group, MemoryCgroup):
                        run.cgroup_peak_bytes = group.peak_bytes()
                    else:
                        run.read_limit_rules = group.rules
                        run.device_read_bytes = group.read_bytes()
                    group.remove()
            if code == 0:
                payload = json.loads(out)
                run.ok, run.summary, run.step_ms = True, payload["summary"], payload["step_ms"]
                run.tokens = payload["tokens"] if greedy else []
                note = f"{run.summary['decode_tok_per_s']:.2f} tok/s"
            else:
                killed = code in (-9, 137)
                run.error = "killed (out of memory under the limit)" if killed else _last_line(err)
                note = f"FAILED: {run.error}"
            progress(
                f"[round {r + 1}/{config.rounds}] {arm:10s} {note}  ({time.perf_counter() - started:.0f} s)"
            )
            runs.append(run)
    return build_report(config, sampled, runs)


def _arm_cgroups(
    config: BenchConfig, devices: list[tuple[int, int]], name: str
) -> list[MemoryCgroup | ReadLimitCgroup]:
    """The groups one arm runs in: memory (--ram-limit), then reads (--read-limit)."""
    groups: list[MemoryCgroup | ReadLimitCgroup] = []
    name = f"edge0-bench-{os.getpid()}-{name}"
    try:
        if config.ram_limit_bytes is not None:
            groups.append(MemoryCgroup.create(config.ram_limit_bytes, name))
        if config.throttled:
            memory = groups[0] if groups and groups[0].version == 2 else None
            inside = memory.path if memory is not None else None
            groups.append(
                ReadLimitCgroup.create(config.read_limit_bps, devices, name + "-read", inside)
            )
    except BaseException:
        for group in groups:
            group.remove()
        raise
    return groups


def _last_line(text: str) -> str:
    """A child's last line of stderr, without its own `edge0: error: ` (the parent says it)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].removeprefix("edge0: error: ") if lines else "no output"


# -- the report -------------------------------------------------------------------------------------


def build_report(config: BenchConfig, sampled: dict, runs: list[ArmRun]) -> dict:
    arms = {}
    for arm in config.arms:
        ok = [r for r in runs if r.arm == arm and r.ok]
        failed = [r for r in runs if r.arm == arm and not r.ok]
        figures = {}
        for _, key, _ in FIGURES:
            values = [r.summary[key] for r in ok if key in r.summary]
            if values:
                figures[key] = {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
        arms[arm] = {
            "rounds_ok": len(ok),
            "rounds_failed": len(failed),
            "errors": sorted({r.error for r in failed}),
            "memory_needed_bytes": max((r.cgroup_peak_bytes for r in failed), default=0),
            "figures": figures,
            # What "peak RSS" covers: the replay ("request") where the arm's process could reset
            # the kernel's high-water mark as the replay began, else its whole life ("process").
            "peak_rss_scope": _peak_rss_scope(ok),
            "step_ms_median": _per_step_median([r.step_ms for r in ok]),
            "routed_by_layer": bench_reads_ahead.routed_by_layer([r.summary for r in ok]),
        }
    for arm, data in arms.items():
        data["ratios"] = {}
        for reference in ("on-demand", "resident"):
            ref = arms.get(reference, {}).get("figures", {})
            mine = data["figures"]
            if arm == reference or not ref or not mine:
                continue
            data["ratios"][f"tok_s_vs_{reference}"] = _ratio(mine, ref, "decode_tok_per_s")
            data["ratios"][f"blocked_vs_{reference}"] = _ratio(mine, ref, "median_blocked_ms")
            data["ratios"][f"peak_mlx_vs_{reference}"] = _ratio(mine, ref, "peak_mlx_mib")
    for arm, data in arms.items():
        if (ranked := ranked_arm(arm)) is not None:
            ok = [r for r in runs if r.arm == arm and r.ok]
            data["ranks"] = _rank_medians([r.summary.get("ranks", []) for r in ok])
            one = arms.get(ranked[0], {}).get("figures", {})
            if one and data["figures"]:
                data["ratios"]["tok_s_vs_one_process"] = _ratio(
                    data["figures"], one, "decode_tok_per_s"
                )
    for arm, data in arms.items():
        f = data["figures"]
        compute = _compute_only_step(arms, arm)
        if compute is None or arm not in STREAMED_MODES or "median_wall_ms" not in f:
            continue
        data["overlap"] = overlap_limit(f, compute)
    return {
        # As plain JSON data: paths as text, tuples as lists.
        "config": json.loads(json.dumps(asdict(config), default=str)),
        "prompt_tokens": len(sampled["prompt_tokens"]),
        "tokens": config.tokens if _same_tokens(runs) is not None else len(sampled["tokens"]),
        "arms": arms,
        "not_taken": settings_not_taken(config),
        "plan_check": plan_check(runs),
        "greedy_tokens_identical": _same_tokens(runs),
        "memory_wall": memory_wall(runs),
        "runs": [asdict(r) for r in runs],
    }


def _same_tokens(runs: list[ArmRun]) -> bool | None:
    """Whether every greedy run gave the same tokens (None: the arms replayed forced tokens)."""
    greedy = [tuple(r.tokens) for r in runs if r.ok and r.tokens]
    return len(set(greedy)) == 1 if greedy else None


def settings_not_taken(config: BenchConfig) -> dict[str, list[str]]:
    """Arm -> the run's settings it cannot take and runs without: the resident arm reads every
    expert into memory at load, so a page-cache budget has nothing to bound."""
    taken: dict[str, list[str]] = {}
    if config.page_cache_bytes is not None and "resident" in config.arms:
        taken["resident"] = ["the page-cache budget (every expert is resident)"]
    limits = [
        name
        for name, on in (
            ("--ram-limit", config.ram_limit_bytes is not None),
            ("--read-limit", config.throttled),
        )
        if on
    ]
    for arm in config.arms:
        if limits and ranked_arm(arm) is not None:
            taken[arm] = [f"{' and '.join(limits)} (ranks run in no cgroup yet)"]
    return taken


def memory_wall(runs: list[ArmRun]) -> dict:
    """Whether the streaming arms met a memory wall: the expert loads they made and the cold MiB
    (read from disk, by mincore) over all their runs."""
    streamed = [r for r in runs if r.ok and r.arm in STREAMED_MODES]
    loads = sum(r.summary.get("median_loads", 0.0) for r in streamed)
    cold = sum(r.summary.get("read_cold_mib", 0.0) for r in streamed)
    return {"runs": len(streamed), "loads_per_step": loads, "cold_mib": cold}


def _compute_only_step(arms: dict, mode: str) -> float | None:
    """The median step of `mode` with nothing to read: its own compute-only arm where the bench
    ran one, else the plain compute-only arm's."""
    for name in (f"{COMPUTE_ONLY}:{mode}", COMPUTE_ONLY):
        step = arms.get(name, {}).get("figures", {}).get("median_wall_ms")
        if step is not None:
            return step["median"]
    return None


def plan_check(runs: list[ArmRun]) -> dict:
    """Each completed run's true peak against the plan its process made before loading: the
    runs over the plan by more than `PLAN_SLACK`, and the largest ratio seen."""
    checked = [r for r in runs if r.ok and "peak_rss_vs_plan" in r.summary]
    over = [
        {
            "arm": r.arm,
            "round": r.round + 1,
            "peak_rss_mib": r.summary["peak_rss_mib"],
            "plan_mib": r.summary["plan_mib"],
        }
        for r in checked
        if r.summary["peak_rss_vs_plan"] > 1 + PLAN_SLACK
    ]
    largest = max((r.summary["peak_rss_vs_plan"] for r in checked), default=None)
    return {"slack": PLAN_SLACK, "runs": len(checked), "largest_ratio": largest, "over": over}


def _peak_rss_scope(runs: list[ArmRun]) -> str | None:
    scopes = {r.summary.get("peak_rss_scope") for r in runs} - {None}
    if not scopes:
        return None
    return scopes.pop() if len(scopes) == 1 else "process"  # mixed: the wider one holds for all


def overlap_limit(figures: dict, compute_ms: float) -> dict:
    """How close a streamed arm's step is to the best that overlapping reads with compute allows:
    max(the compute-only step, the cold MiB a step reads / the read bandwidth achieved)."""
    step = figures["median_wall_ms"]["median"]
    cold_mib = figures.get("median_mib_read", {}).get("median", 0.0) * figures.get(
        "median_cold_fraction", {}
    ).get("median", 0.0)
    bandwidth = figures.get("read_mib_per_s", {}).get("median")
    read_ms = cold_mib / bandwidth * 1e3 if bandwidth else 0.0
    limit = max(compute_ms, read_ms)
    blocked = figures.get("median_blocked_ms", {}).get("median", 0.0)
    return {
        "compute_ms": compute_ms,
        "read_ms": read_ms,
        "limit_ms": limit,
        "step_vs_limit": step / limit if limit else None,
        "blocked_share": blocked / step if step else None,
    }


def _ratio(mine: dict, ref: dict, key: str) -> float | None:
    if key not in mine or key not in ref or not ref[key]["median"]:
        return None
    return mine[key]["median"] / ref[key]["median"]


def _rank_medians(rounds: list[list[dict]]) -> list[dict]:
    """Each rank's figures (a summary's "ranks"), the median over rounds."""
    by_rank: dict[int, list[dict]] = {}
    for ranks in rounds:
        for row in ranks:
            by_rank.setdefault(int(row["rank"]), []).append(row)
    return [
        {"rank": rank, **{k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "rank"}}
        for rank, rows in sorted(by_rank.items())
    ]


def _per_step_median(series: list[list[float]]) -> list[float]:
    if not series:
        return []
    length = min(len(s) for s in series)
    return [statistics.median(s[i] for s in series) for i in range(length)]


if __name__ == "__main__":  # the child process of one arm
    from ..runtime.open_file_limit import fit_mlx_lm_to_the_open_file_limit

    fit_mlx_lm_to_the_open_file_limit()
    try:
        payload = run_arm(json.loads(sys.argv[1]))
        if payload is not None:  # (None: a rank other than 0)
            print(json.dumps(payload))
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        sys.exit(2)

"""`edge0 bench`: arms in their own processes, rotated, replaying one token sequence, with limits
(memory, and disk reads)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from edge0_tui.cli import main
from engine import Edge0Error
from engine.checkpoint.index import checkpoint_shards
from engine.measure.bench import ArmRun, BenchConfig, ReadSpans, plan_check, run_bench
from engine.measure.bench_markdown import markdown, plan_note
from engine.measure.memory_cgroup import MemoryCgroup
from engine.measure.read_limit import ReadLimitCgroup, block_device, whole_disk


def test_rotated_arms_replay_the_same_tokens(checkpoint_dir, tmp_path, capsys):
    model = checkpoint_dir("qwen3_moe")
    out = tmp_path / "report.json"
    args = ["bench", str(model), "--arms", "resident,on-demand", "--rounds", "2", "--tokens", "8"]
    traces = tmp_path / "traces"
    assert main(args + ["--json", str(out), "--expert-cache", "60K", "--trace", str(traces)]) == 0
    printed = capsys.readouterr().out
    assert (
        "| resident |" in printed and "| on-demand |" in printed and "ms/step per decode" in printed
    )
    report = json.loads(out.read_text())
    order = [(r["round"], r["arm"]) for r in report["runs"]]
    assert order == [(0, "resident"), (0, "on-demand"), (1, "on-demand"), (1, "resident")]
    assert all(r["ok"] and r["summary"]["generated_tokens"] == 8 for r in report["runs"])
    on_demand = report["arms"]["on-demand"]
    assert on_demand["figures"]["median_loads"]["median"] > 0
    assert report["arms"]["resident"]["figures"]["median_loads"]["median"] == 0
    assert on_demand["ratios"]["tok_s_vs_resident"] > 0
    # Each arm's peak RSS is its process's high-water mark over the replay, said under the table.
    expected_scope = "request" if os.access("/proc/self/clear_refs", os.W_OK) else "process"
    assert on_demand["peak_rss_scope"] == expected_scope
    assert "peak RSS: the kernel's high-water mark" in printed
    for run in report["runs"]:
        assert run["summary"]["peak_rss_bytes"] >= run["summary"]["median_rss_bytes"] > 0
        # Each arm's plan, made before it loaded, beside the peak it reached (issue 31).
        summary = run["summary"]
        assert summary["plan_mib"] > 0
        assert summary["peak_rss_vs_plan"] == pytest.approx(
            summary["peak_rss_bytes"] / 2**20 / summary["plan_mib"]
        )
    assert report["plan_check"]["runs"] == 4
    assert "| plan MiB | peak RSS / plan |" in printed
    assert "within its memory plan + 10%" in printed or "Over the memory plan" in printed
    # --trace: a timeline per arm and round, and on Linux how long compute waited a step.
    assert sorted(p.name for p in traces.iterdir()) == [
        "on-demand-round1.json",
        "on-demand-round2.json",
        "resident-round1.json",
        "resident-round2.json",
    ]
    if sys.platform == "linux":
        assert "**Compute waits**" in printed
        waited = on_demand["figures"]["compute_waited_ms"]["median"]
        assert 0 < waited < on_demand["figures"]["median_wall_ms"]["max"]


def test_a_run_over_its_memory_plan_is_named_under_the_table():
    def run(arm: str, round_index: int, peak_mib: float, plan_mib: float) -> ArmRun:
        summary = {"peak_rss_mib": peak_mib, "plan_mib": plan_mib}
        summary["peak_rss_vs_plan"] = peak_mib / plan_mib
        return ArmRun(arm, round_index, ok=True, summary=summary)

    within = plan_check([run("on-demand", 0, 200, 300), run("prefetch", 0, 320, 300)])
    assert within["over"] == [] and within["largest_ratio"] == pytest.approx(320 / 300)
    over = plan_check([run("on-demand", 0, 200, 300), run("prefetch", 1, 340, 300)])
    assert over["over"] == [{"arm": "prefetch", "round": 2, "peak_rss_mib": 340, "plan_mib": 300}]
    assert "prefetch round 2: peak 340 MiB, plan 300 MiB" in plan_note(over)


def test_cold_evicts_and_memory_limit_failures_are_reported(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    # Far below what Python and MLX need: every arm is killed, and is reported as failed.
    config = BenchConfig(
        model, ["on-demand"], rounds=1, tokens=4, ram_limit_bytes=20 << 20, cold=True
    )
    report = run_bench(config, progress=lambda line: None)
    run = report["runs"][0]
    assert not run["ok"] and run["error"]
    assert run["evicted_check"] is not None and run["evicted_check"] < 0.01
    assert report["arms"]["on-demand"]["memory_needed_bytes"] > 0


def test_memory_cgroup_caps_usage():
    group = MemoryCgroup.create(64 << 20, "edge0-test-cgroup")
    try:
        limit_file = "memory.limit_in_bytes" if group.version == 1 else "memory.max"
        assert int((group.path / limit_file).read_text()) == 64 << 20
    finally:
        group.remove()
    assert not group.path.exists()


def test_read_limit_throttles_each_arm_and_reports_the_achieved_bandwidth(checkpoint_dir):
    model = checkpoint_dir("qwen3_moe")
    limit = 4 << 20
    # With a memory limit too: each arm's process joins both groups.
    config = BenchConfig(
        model,
        ["on-demand", "resident"],
        rounds=1,
        tokens=4,
        cold=True,
        read_limit_bps=limit,
        ram_limit_bytes=4 << 30,
    )
    shard = checkpoint_shards(model)[0]
    try:
        major, minor = block_device(shard)
        ReadLimitCgroup.create(limit, [(major, minor)], f"edge0-test-{os.getpid()}").remove()
    except Edge0Error as refusal:  # no writable blkio / io controller here: the flag is refused
        assert str(refusal).startswith("cannot throttle reads for --read-limit: ")
        with pytest.raises(Edge0Error, match="^cannot throttle reads for --read-limit: "):
            run_bench(config, progress=lambda line: None)
        return
    report = run_bench(config, progress=lambda line: None)
    for run in report["runs"]:
        assert run["ok"]
        # Read back from the kernel's throttle file: the checkpoint's disk, at the limit.
        [rule] = run["read_limit_rules"]
        assert rule.split()[0] == f"{major}:{minor}"
        assert rule.split()[1] in (str(limit), f"rbps={limit}")  # cgroup v1 / v2
        assert run["device_read_bytes"] > 0  # cold: the arm's process read the disk
        assert run["cgroup_peak_bytes"] > 0  # and it was charged to its memory group
    figures = report["arms"]["on-demand"]["figures"]
    assert figures["read_mib_per_s"]["median"] > 0 and figures["read_disk_mib"]["median"] > 0
    assert "read_mib_per_s" not in report["arms"]["resident"]["figures"]  # no expert reads
    table = markdown(report)
    assert "read limit 4.00 MiB/s" in table and "| on-demand | " in table.split("**Reads**")[1]
    assert "| resident | - (no expert reads from disk) |" in table


def test_read_limit_refusals_say_why_in_one_line(monkeypatch, tmp_path, checkpoint_dir, capsys):
    from engine.measure import read_limit

    monkeypatch.setattr(read_limit, "mounts", lambda: [])
    with pytest.raises(Edge0Error) as refused:
        ReadLimitCgroup.create(1 << 20, [(254, 0)], "edge0-test-none")
    assert str(refused.value) == (
        "cannot throttle reads for --read-limit: no cgroup blkio (v1) or io (v2) controller is "
        "mounted"
    )
    monkeypatch.setattr(read_limit.sys, "platform", "darwin")
    with pytest.raises(Edge0Error, match="needs Linux cgroups .*; this is darwin"):
        ReadLimitCgroup.create(1 << 20, [(254, 0)], "edge0-test-none")
    monkeypatch.undo()
    with pytest.raises(Edge0Error, match="without a block device .*0:"):
        whole_disk(0, 45, "/dev/shm/model")
    model = checkpoint_dir("qwen3_moe")
    with pytest.raises(SystemExit) as exited:  # refused as its argument is parsed
        main(["bench", str(model), "--read-limit", "0", "--rounds", "1"])
    assert exited.value.code == 2
    assert "--read-limit: 0 must be at least 1 byte" in capsys.readouterr().err


def test_a_partition_is_throttled_on_its_disk(tmp_path):
    """blkio refuses rules for partitions: sysfs leads from a partition to its whole disk."""
    disk = tmp_path / "devices" / "virtual" / "block" / "sda"
    (disk / "sda1").mkdir(parents=True)
    (disk / "dev").write_text("8:0\n")
    (disk / "sda1" / "partition").write_text("1\n")
    (disk / "sda1" / "dev").write_text("8:1\n")
    links = tmp_path / "dev" / "block"
    links.mkdir(parents=True)
    (links / "8:1").symlink_to(disk / "sda1")
    (links / "8:0").symlink_to(disk)
    assert whole_disk(8, 1, "model", tmp_path) == (8, 0)
    assert whole_disk(8, 0, "model", tmp_path) == (8, 0)


def test_achieved_bandwidth_counts_overlapping_reads_once():
    spans = ReadSpans()
    spans.complete("pread 1.3", "read", 10.0, 10.5, bytes=2 << 20, cold=1 << 20)
    spans.complete("pread 1.4", "read", 10.2, 10.7, bytes=2 << 20, cold=1 << 20)  # overlaps
    spans.complete("pread 2.1", "read", 11.0, 11.3, bytes=2 << 20, cold=1 << 20)
    spans.complete("pread 2.2", "read", 12.0, 12.5, bytes=2 << 20, cold=0)  # from the page cache
    spans.complete("to arrays 1.3", "read", 10.5, 10.6)  # not a read: not counted
    spans.complete("blocked 1.3", "blocked", 10.0, 14.0)
    achieved = spans.achieved(disk_bytes=6 << 20)  # readahead: more than mincore saw
    assert achieved["read_busy_ms"] == pytest.approx(1500.0)  # 0.7 s + 0.3 s + 0.5 s
    assert achieved["read_mib_per_s"] == pytest.approx(4.0)
    assert achieved["read_cold_mib"] == pytest.approx(3.0)
    assert spans.achieved(disk_bytes=None)["read_mib_per_s"] == pytest.approx(2.0)  # mincore
    assert spans.achieved(disk_bytes=0) == {}  # warm: nothing came from disk
    assert ReadSpans().achieved(disk_bytes=1 << 20) == {}


def test_paced_reads_move_cold_bytes_at_the_limit_one_device_for_every_thread():
    """Two threads reading at once share one simulated device: 2 x 1 MiB of cold bytes at
    8 MiB/s take >= 0.25 s together; page-cache bytes are not paced."""
    import threading
    import time

    from engine.experts.read_pacing import ReadPacer

    pacer = ReadPacer(8 << 20)
    start = time.perf_counter()
    threads = [
        threading.Thread(target=pacer.pace, args=(1 << 20, time.perf_counter())) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.perf_counter() - start >= 0.25 - 1e-3
    before = time.perf_counter()
    pacer.pace(0, before)  # warm: at once
    assert time.perf_counter() - before < 0.05
    with pytest.raises(ValueError):
        ReadPacer(0)


def test_read_limit_by_pacing_limits_the_streaming_arms_on_any_os(checkpoint_dir, tmp_path):
    """The pacing limiter needs no cgroup: each streaming arm's reads get at most the limit
    (achieved cold bandwidth over read-busy time), and the report says how it was limited."""
    model = checkpoint_dir("qwen3_moe")
    limit = 2 << 20
    config = BenchConfig(
        model,
        ["on-demand"],
        rounds=1,
        tokens=4,
        cold=True,
        expert_cache_bytes=64 << 10,
        read_limit_bps=limit,
        read_limit_by="pacing",
    )
    report = run_bench(config, progress=lambda line: None)
    [run] = report["runs"]
    assert run["ok"] and run["read_limit_rules"] == []  # no kernel throttle was made
    summary = run["summary"]
    assert summary["read_cold_mib"] > 0
    cold_mib_per_s = summary["read_cold_mib"] / (summary["read_busy_ms"] / 1e3)
    assert cold_mib_per_s <= limit / 2**20 * 1.05
    assert "(paced in the readers)" in markdown(report)
    with pytest.raises(Edge0Error, match="unknown read limiter"):
        run_bench(BenchConfig(model, ["on-demand"], read_limit_by="tc"), lambda line: None)


def test_a_run_without_a_wall_says_so_and_each_mode_runs_compute_only(
    checkpoint_dir, capsys, tmp_path
):
    # A copy of its own, warm: tests beside it (another worker) evict the shared checkpoint's
    # expert pages (page-cache budgets, --cold), which would make this run's reads cold.
    model = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    args = ["bench", str(model), "--arms", "on-demand,prefetch,compute-only:prefetch"]
    args += ["--rounds", "1", "--tokens", "6", "--expert-cache", "1G", "--page-cache", "off"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    # Warm and a cache that holds every expert: nothing is read cold.
    assert "**No memory wall in this run**" in printed
    assert "- prefetch: " in printed and "against on-demand with nothing to read" in printed
    # compute-only:prefetch is prefetch with every expert in memory: the overlap limit of the
    # prefetch arm is its own mode's compute, and on-demand (no compute-only arm of its own, no
    # plain compute-only arm) has none.
    assert "| compute-only:prefetch |" in printed
    overlap = printed.split("**Overlap limit**")[1].split("**")[0]
    assert "| prefetch |" in overlap and "| on-demand |" not in overlap


def test_compute_only_arms_name_their_mode():
    from engine.measure.bench_arms import compute_only_mode

    assert compute_only_mode("compute-only", ["on-demand", "compute-only"]) == "on-demand"
    assert compute_only_mode("compute-only", ["prerouter", "compute-only"]) == "prerouter"
    assert compute_only_mode("compute-only:prefetch") == "prefetch"
    assert compute_only_mode("compute-only:resident") is None
    assert compute_only_mode("on-demand") is None
    with pytest.raises(Edge0Error, match="compute-only:MODE"):
        run_bench(BenchConfig(Path("unused"), ["compute-only:bogus"]), progress=lambda line: None)


def test_a_wall_by_page_cache_budget_is_cold(checkpoint_dir, tmp_path):
    # --page-cache: the streaming arms' expert pages are held to a budget, so reads go cold even
    # on a warm machine (how the app makes its wall on the demo).
    model = checkpoint_dir("qwen3_moe")
    config = BenchConfig(
        model,
        ["on-demand", "resident"],
        rounds=1,
        tokens=6,
        expert_cache_bytes=60 << 10,
        page_cache_bytes=64 << 10,
    )
    said = []
    report = run_bench(config, progress=said.append)
    assert report["memory_wall"]["cold_mib"] > 0
    assert "No memory wall" not in markdown(report)
    # The resident arm cannot take a page-cache budget: it runs without it, and says so (it is
    # the baseline every ratio needs).
    assert all(run["ok"] for run in report["runs"])
    assert "tok_s_vs_resident" in report["arms"]["on-demand"]["ratios"]
    without = "resident ran without the page-cache budget (every expert is resident)."
    assert without in markdown(report)
    assert "resident runs without the page-cache budget (every expert is resident)" in said


def test_a_failed_arm_makes_the_exit_status_non_zero(checkpoint_dir, capsys):
    """The table is printed with what ran; the status says it is not whole (prerouter has no
    heads on this model: that arm fails)."""
    model = checkpoint_dir("qwen3_moe")
    code = main(["bench", str(model), "--arms", "on-demand,prerouter", "--rounds", "1",
                 "--tokens", "4"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1
    assert "| on-demand |" in out
    assert "1 of 2 arm runs failed" in err


def test_a_drafting_arm_decodes_greedily_as_the_plain_arm_does(checkpoint_dir):
    """`MODE+lookup` arms (speculative decoding): every arm then decodes greedily (not a forced
    replay), and the report says whether every run gave the same tokens."""
    from engine.measure.bench import _same_tokens, run_arm
    from engine.measure.bench_arms import drafted_mode

    assert drafted_mode("on-demand+lookup") == "on-demand" and drafted_mode("on-demand") is None
    assert drafted_mode("prerouter+lookup") is None  # refused: see runtime/speculative.py
    spec = {
        "model": str(checkpoint_dir("qwen3_moe")),
        "mode": "on-demand",
        "expert_cache_bytes": 60_000,
        "k": None,
        "adapter_dirs": [],
        "data_dir": None,
        "prompt_tokens": [5, 9, 13, 5, 9, 13, 5, 9],
        "forced_tokens": [1],
        "greedy": True,
        "tokens": 10,
    }
    runs = []
    for draft in (None, "lookup"):
        payload = run_arm(dict(spec, draft=draft))
        assert len(payload["tokens"]) == 10
        runs.append(ArmRun("on-demand", 0, True, payload["summary"], tokens=payload["tokens"]))
    assert _same_tokens(runs) is True
    runs[1].tokens = [t + 1 for t in runs[1].tokens]
    assert _same_tokens(runs) is False
    with pytest.raises(Edge0Error, match=r"MODE\+lookup"):
        run_bench(BenchConfig(model=Path(spec["model"]), arms=["prerouter+lookup"]))

"""`edge0 bench`: arms in their own processes, rotated, replaying one token sequence, with limits."""

from __future__ import annotations

import json

from edge0_tui.cli import main
from engine.measure.bench import BenchConfig, run_bench
from engine.measure.memory_cgroup import MemoryCgroup


def test_rotated_arms_replay_the_same_tokens(checkpoint_dir, tmp_path, capsys):
    model = checkpoint_dir("qwen3_moe")
    out = tmp_path / "report.json"
    args = ["bench", str(model), "--arms", "resident,on-demand", "--rounds", "2", "--tokens", "8"]
    assert main(args + ["--json", str(out), "--expert-cache", "60K"]) == 0
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

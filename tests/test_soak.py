"""A long conversation leaves memory, threads and open files flat (a short soak; `edge0 soak`
runs the full 2,000 steps)."""

from __future__ import annotations

import json

from cli_runner import run_process


def test_short_soak_is_flat(checkpoint_dir):
    # In a process of its own: RSS, MLX's active memory, threads and files are the process's, and
    # the test suite's process has other tests' threads and garbage coming and going (a drift of
    # 5-9% was measured there, none alone).
    model = checkpoint_dir("qwen3_moe")
    out = run_process(
        "soak", str(model), "--turns", "8", "--steps", "160", "--expert-cache", "60000", "--json"
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["decode_steps"] == 160
    assert report["thread_growth"] == 0 and report["open_file_growth"] == 0
    assert abs(report["mlx_active_without_kv_drift"]) < 0.05, report
    assert abs(report["rss_drift"]) < 0.05, report
    assert report["end"]["kv_cache_bytes"] > report["after_warmup"]["kv_cache_bytes"]
    # The whole soak's peaks: the kernel's high-water mark covers every turn's and the RSS now.
    assert report["peak_rss_scope"] == "process" and report["peak_mlx_bytes"] > 0
    assert report["peak_rss_bytes"] >= max(
        report["end"]["rss_bytes"], report["end"]["peak_rss_bytes"]
    )

"""A long conversation leaves memory, threads and open files flat (a short soak; `edge0 soak`
runs the full 2,000 steps)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.measure.soak import soak


def test_short_soak_is_flat(checkpoint_dir):
    config = EngineConfig(mode="on-demand", expert_cache_bytes=60_000)
    report = soak(checkpoint_dir("qwen3_moe"), config, turns=8, steps=160, progress=lambda _: None)
    assert report["decode_steps"] == 160
    assert report["thread_growth"] == 0 and report["open_file_growth"] == 0
    assert abs(report["mlx_active_without_kv_drift"]) < 0.05
    assert abs(report["rss_drift"]) < 0.05
    assert report["end"]["kv_cache_bytes"] > report["after_warmup"]["kv_cache_bytes"]

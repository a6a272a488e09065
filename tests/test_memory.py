"""Streaming keeps MLX memory small: on-demand with a 10% expert cache against resident mlx-lm."""

from __future__ import annotations

import json
import subprocess
import sys

from engine.config import EngineConfig
from engine.runtime.generation import Engine


def _peak_mlx_bytes(model_dir, *arms: list[str]) -> list[int]:
    """Each arm in its own process (MLX's peak counter and allocator cache are per process); the
    processes run at the same time."""
    processes = []
    for args in arms:
        command = [sys.executable, "-m", "edge0_tui.cli", "generate", str(model_dir)]
        command += ["--prompt", "The memory wall", "--max-tokens", "16", "--json", *args]
        processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [process.communicate(timeout=300) for process in processes]
    peaks = []
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr.decode()
        peaks.append(json.loads(stdout)["summary"]["peak_mlx_bytes"])
    return peaks


def test_on_demand_peak_is_a_fraction_of_resident(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3_moe", "small")
    engine = Engine(model_dir, EngineConfig(mode="resident"))
    expert_bytes = engine.loaded.index.expert_nbytes
    engine.close()

    budget = expert_bytes // 10
    # --exact: both arms on the 4-bit kernels, resident as stock mlx-lm. The dense prefill path's
    # one fp32 expert at a time is bounded in tests/test_prefill_fast.py.
    resident, streaming = _peak_mlx_bytes(
        model_dir,
        ["--mode", "resident", "--exact"],
        ["--mode", "on-demand", "--expert-cache", str(budget), "--exact"],
    )
    print(
        f"\nexpert bytes {expert_bytes / 2**20:.1f} MiB; peak MLX: resident "
        f"{resident / 2**20:.1f} MiB, on-demand with a {budget / 2**20:.1f} MiB cache "
        f"{streaming / 2**20:.1f} MiB ({streaming / resident:.0%})"
    )
    assert streaming < 0.35 * resident


def test_page_cache_probe_stays_under_its_share(checkpoint_dir):
    from engine.config import GenerationConfig

    engine = Engine(
        checkpoint_dir("qwen3_moe", "small"), EngineConfig(page_cache_sample_share=0.02)
    )
    try:
        result = engine.generate([5, 6, 7], GenerationConfig(max_tokens=40))
        wall_s = sum(s.wall_ms for s in result.steps) / 1e3
        assert engine.memory.probe_seconds > 0
        # The first probe is unconditional; after it, probes take at most 2% of the time.
        one_probe = engine.memory.last_probe_seconds
        assert engine.memory.probe_seconds <= 0.02 * wall_s + 2 * one_probe
        assert max(s.page_cache_expert_bytes for s in result.steps) > 0
    finally:
        engine.close()

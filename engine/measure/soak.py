"""`edge0 soak`: a long conversation, to show that memory, threads and open files stay flat.

Runs `turns` chat turns of `steps // turns` decode steps each (end-of-sequence ignored, so the
step count is exact), continuing one conversation, and compares MLX active
memory, process RSS, live threads and open file descriptors after the warm-up turns with the end.
"""

from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass

import mlx.core as mx

from ..config import EngineConfig, GenerationConfig
from ..runtime.generation import Engine
from ..runtime.metrics import process_lifetime_peaks, process_rss_bytes

WARMUP_TURNS = 2


@dataclass
class SoakPoint:
    turn: int
    steps: int
    mlx_active_bytes: int
    kv_cache_bytes: int  # grows with the conversation by design; the rest must not
    rss_bytes: int  # resident after the turn (a sample)
    peak_rss_bytes: int  # the kernel's high-water mark over the turn's request (its summary's)
    threads: int
    open_files: int

    @property
    def mlx_other_bytes(self) -> int:
        return self.mlx_active_bytes - self.kv_cache_bytes


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # macOS
        return len(os.listdir("/dev/fd"))


def _point(engine: Engine, turn: int, steps: int, peak_rss_bytes: int) -> SoakPoint:
    # A leak is memory still reachable: garbage that the collector has not freed yet (ours, or
    # another object's in a long-lived process such as the test suite's) is not one.
    gc.collect()
    return SoakPoint(
        turn,
        steps,
        mx.get_active_memory(),
        engine.kv_cache_bytes(),
        process_rss_bytes(),
        peak_rss_bytes,
        threading.active_count(),
        _open_files(),
    )


def soak(
    model_dir,
    config: EngineConfig,
    turns: int = 20,
    steps: int = 2000,
    progress=print,
    fresh: bool = False,
) -> dict:
    """With `fresh`, every turn starts a new conversation of the same shape: the KV cache no longer
    grows, so any growth left in memory would be a leak."""
    per_turn = max(1, steps // turns) + 1  # the first token of a reply comes from the prefill
    points = []
    done = 0
    with Engine(model_dir, config) as engine:
        history: list[dict] = []
        for turn in range(1, turns + 1):
            if fresh:
                history = []
            history.append({"role": "user", "content": f"Tell me more, part {turn}."})
            prompt = engine.encode_chat(history)
            if len(prompt) + per_turn > engine.context_limit:
                history = history[-1:]  # keep within the context: start the conversation afresh
                prompt = engine.encode_chat(history)
            gen = GenerationConfig(
                per_turn, temperature=0.8, top_p=0.95, seed=turn, ignore_eos=True
            )
            result = engine.generate(prompt, gen)
            done += sum(1 for s in result.steps if s.phase == "decode")
            history.append({"role": "assistant", "content": result.text})
            points.append(_point(engine, turn, done, result.summary["peak_rss_bytes"]))
            progress(
                f"turn {turn:2d}: {done:5d} decode steps, MLX active {points[-1].mlx_active_bytes / 2**20:.1f} MiB "
                f"(KV cache {points[-1].kv_cache_bytes / 2**20:.1f}), "
                f"RSS {points[-1].rss_bytes / 2**20:.1f} MiB (peak of the turn "
                f"{points[-1].peak_rss_bytes / 2**20:.1f}), {points[-1].threads} threads, "
                f"{points[-1].open_files} open files"
            )
    start, end = points[min(WARMUP_TURNS, len(points)) - 1], points[-1]
    return {
        # The whole soak's peaks (the model's load included): `peak_mlx_bytes`, `peak_rss_bytes`
        # (the kernel's high-water mark, not a maximum of the points) and their scope.
        **process_lifetime_peaks(),
        "decode_steps": done,
        "after_warmup": start.__dict__,
        "end": end.__dict__,
        "mlx_active_drift": end.mlx_active_bytes / start.mlx_active_bytes - 1,
        "mlx_active_without_kv_drift": end.mlx_other_bytes / start.mlx_other_bytes - 1,
        "rss_drift": end.rss_bytes / start.rss_bytes - 1,
        "thread_growth": end.threads - start.threads,
        "open_file_growth": end.open_files - start.open_files,
    }

"""The doctor's slot-write check: reads landing in slot banks while the device computes change no
logit.

The stress run is prefetch mode with every guess read ahead (the lookahead's, and the heads' where
the model has them) on the reader threads, into slots of the MLX banks, while the layers already
submitted compute (`mx.async_eval` at decode), with an expert cache of one routed set a layer and
one expert more: experts are evicted and read again every step. The reference is on-demand with
one reader thread and the same cache: a layer's experts are read only once its router has
synchronised every layer before it, so no read lands while compute that could see it runs. Both runs are fed the same random tokens (teacher forcing) for a few hundred steps, and
every step's logits must be bit for bit the same. This is the check Metal needs most: unified
memory, command buffers in flight while the readers write.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import EngineConfig, GenerationConfig
from ..runtime.generation import Engine
from .doctor_checks import NO_FAULTS, Check, Faults, fail, median, ok
from .doctor_exactness import PROMPT

TITLE = "slot writes under compute"


def _run(model_dir: Path, config: EngineConfig, forced: list[int], faults: Faults):
    """Every step's logits (float32, on the host) and the decode steps' metrics."""
    logits: list[np.ndarray] = []
    with Engine(model_dir, config) as engine:
        if faults.racy_slot_write:
            _write_into_slots_in_use(engine)
        gen = GenerationConfig(max_tokens=len(forced))
        reply = engine.stream(engine.encode(PROMPT), gen, forced_tokens=forced, keep_logits=True)
        for token in reply:
            logits.append(np.array(token.logits.astype(mx.float32)))
        result = reply.result
    return np.stack(logits), [s for s in result.steps if s.phase == "decode"]


def _write_into_slots_in_use(engine: Engine) -> None:
    """Faults.racy_slot_write: what a race would do. Once a layer has its slots (and before its
    product is computed), the first slot is overwritten, as a read landing in a slot that a queued
    layer still reads."""
    store = engine.store
    fetch = store.fetch

    def fetch_then_overwrite(layer: int, experts: list[int]) -> list[int]:
        slots = fetch(layer, experts)
        for view in store.pool.views(layer, slots[0]).values():
            view[...] = 0
        return slots

    store.fetch = fetch_then_overwrite


def check_slot_writes(
    model_dir: Path, steps: int, budget: int, faults: Faults = NO_FAULTS
) -> Check:
    with Engine(model_dir, EngineConfig(mode="on-demand", expert_cache_bytes=budget)) as engine:
        vocab = engine.vocab_size  # the logits' width: every id below it has an embedding
    forced = np.random.default_rng(0).integers(0, vocab, steps).tolist()
    calm_config = EngineConfig(mode="on-demand", expert_cache_bytes=budget, reader_threads=1)
    reference, calm = _run(model_dir, calm_config, forced, NO_FAULTS)
    stress_config = EngineConfig(
        mode="prefetch", expert_cache_bytes=budget, prefetch_min_expert_bytes=0
    )
    stressed, busy = _run(model_dir, stress_config, forced, faults)
    # A step computes in what the one-reader run took less its wait for reads (the verdict).
    compute_ms = median([s.wall_ms - s.blocked_ms for s in calm])
    ahead = sum(s.lookahead_issued + s.prefetch_issued for s in busy)
    evicting = sum(s.loads > 0 for s in busy)
    what = (
        f"{steps} steps, {ahead} experts read ahead by {stress_config.reader_threads} reader "
        f"threads, experts read in {evicting} of {len(busy)} steps"
    )
    figures = {"compute_ms": compute_ms, "steps": steps, "read_ahead": ahead}
    differs = [i for i in range(steps) if not np.array_equal(stressed[i], reference[i])]
    if differs:
        first = differs[0]
        largest = float(np.abs(stressed[first] - reference[first]).max())
        return fail(
            "slots",
            TITLE,
            f"logits differ in {len(differs)} of {steps} steps, first at step {first} (by up to "
            f"{largest:.3g}) ({what})",
            **figures,
        )
    if ahead == 0:
        return fail("slots", TITLE, f"nothing was read ahead: no write ran under compute ({what})")
    return ok("slots", TITLE, f"every step's logits bit-identical ({what})", **figures)

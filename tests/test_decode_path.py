"""The decode step as one readable path: which engine files one step visits, and who calls them.

A newcomer follows a decode step through six files (`STORY`). Every other engine file the step
enters is a one-idea helper with one owner among them (`HELPERS`): its callers are that owner,
the owner's other helpers, or the model's forward (mlx-lm's modules, which the decoder runs and
the engine's blocks plug into). A new file entering the step, or a helper called from across the
house, fails here: place it in the tables (and in the module docstring of runtime/decode.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine import parse_size
from engine.config import EngineConfig, GenerationConfig
from engine.runtime.generation import Engine

ENGINE = Path(__file__).resolve().parents[1] / "engine"
DEMO = ENGINE.parent / "assets" / "demo"
MODEL = "the model's forward"  # frames outside the engine: mlx-lm's modules

# The step's story: what decides, in the order a step reaches it.
STORY = {
    "runtime/decode.py": "the step: build the forward, read once, start the next step's reads",
    "routing/moe_block.py": "one MoE layer: route, find the experts' slots, compute, combine",
    "routing/state.py": "the heads' predictions: the routing of their consumer layers",
    "experts/store.py": "where each expert is: held, pooled or read, and what is read ahead",
    "experts/switch_glu.py": "the experts' compute over the slot bank",
    "runtime/sampling.py": "the token",
}
# Each helper, with the story file that owns it.
HELPERS = {
    "runtime/generation.py": "runtime/decode.py",  # the engine: K and mode switches asked for
    "runtime/metrics.py": "runtime/decode.py",  # the step's figures
    "runtime/numerics.py": "runtime/decode.py",  # the guard in the model's layers
    "adapters/lora.py": "runtime/decode.py",  # the adapter's delta in the model's layers
    "host_reads.py": "runtime/decode.py",  # the one counted place a value comes to the host
    "trace.py": "runtime/decode.py",  # spans, written from anywhere
    "routing/functions.py": "routing/moe_block.py",  # top-k and renormalising
    "routing/prerouter.py": "routing/state.py",  # the heads' math
    "routing/lookahead.py": "experts/store.py",  # guesses of the next layer, read ahead
    "experts/pool.py": "experts/store.py",  # the slots and what they hold
    "experts/eviction.py": "experts/store.py",  # the pool's policy
    "experts/slot_bank.py": "experts/store.py",  # the pool's arrays
    "experts/reads.py": "experts/store.py",  # reads from disk
    "experts/heat.py": "experts/store.py",  # the panel's picture
    "experts/ledger.py": "experts/store.py",  # reads ahead and their scores
    "experts/page_cache.py": "experts/store.py",  # the OS cache's share of reads
}
# Calls a helper may take from outside its owner's family, and why.
ALSO_CALLED = {
    "trace.py": set(STORY) | set(HELPERS),  # instrumentation
    "host_reads.py": {"experts/store.py"},  # a layer routed by its own router reads it back
    "experts/page_cache.py": {"runtime/metrics.py"},  # the panel's page-cache figure
    "routing/lookahead.py": {"runtime/decode.py"},  # the next step's first layer is guessed there
    "routing/functions.py": {"routing/state.py", "routing/lookahead.py"},  # the same top-k
    # The heads and the lookahead run a layer's router on their inputs.
    "routing/moe_block.py": {"routing/state.py", "routing/lookahead.py"},
}


def _engine_file(frame) -> str | None:
    name = frame.f_code.co_filename
    return str(Path(name).relative_to(ENGINE)) if name.startswith(str(ENGINE)) else None


def _calls_in_one_decode_step(engine: Engine) -> dict[str, set[str]]:
    """Engine file -> the engine files (or the model's forward) that called into it, over the
    third decode step of a greedy reply."""
    calls: dict[str, set[str]] = {}

    def profile(frame, event, arg) -> None:
        if event != "call" or (callee := _engine_file(frame)) is None:
            return
        callers = calls.setdefault(callee, set())
        caller = frame.f_back
        while caller is not None and _engine_file(caller) is None:
            if "mlx_lm" in caller.f_code.co_filename:
                callers.add(MODEL)
                return
            caller = caller.f_back
        if caller is not None and _engine_file(caller) != callee:
            callers.add(_engine_file(caller))

    prompt = engine.encode("Write a short story about a lighthouse keeper.", chat=True)
    tokens = iter(engine.stream(prompt, GenerationConfig(max_tokens=6, temperature=0.0)))
    for _ in range(3):
        next(tokens)
    sys.setprofile(profile)
    try:
        next(tokens)
    finally:
        sys.setprofile(None)
    for _ in tokens:
        pass
    return calls


def _family(file: str) -> set[str]:
    """A story file and its helpers."""
    owner = HELPERS.get(file, file)
    return {owner, *(f for f, o in HELPERS.items() if o == owner)}


@pytest.mark.parametrize(
    "mode, k, cache",
    [("resident", None, None), ("on-demand", None, "4M"), ("prefetch", None, "4M")]
    + [("prerouter", 4, "4M"), ("prerouter", 4, "64M")],
)
def test_a_decode_step_stays_in_its_story_and_their_helpers(mode, k, cache):
    assert len(STORY) == 6
    config = EngineConfig(mode=mode, k=k)
    if cache is not None:
        config = EngineConfig(mode=mode, k=k, expert_cache_bytes=parse_size(cache))
    with Engine(DEMO, config) as engine:
        calls = _calls_in_one_decode_step(engine)
    unplaced = set(calls) - set(STORY) - set(HELPERS)
    assert not unplaced, f"files a decode step visits that have no place in the story: {unplaced}"
    assert "runtime/decode.py" in calls and "runtime/sampling.py" in calls
    if mode != "resident":
        assert {"routing/moe_block.py", "experts/store.py", "experts/switch_glu.py"} <= set(calls)
    for file, callers in calls.items():
        if file == "runtime/decode.py":
            continue  # the step itself, called by the reply
        allowed = _family(file) | ALSO_CALLED.get(file, set()) | {MODEL}
        if file in STORY:
            allowed |= set(STORY)  # the story calls down itself
        assert callers <= allowed, f"{file} is called from {callers - allowed}"

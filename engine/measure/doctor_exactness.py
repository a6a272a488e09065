"""The doctor's exactness checks: the engine's exact modes give the oracle's tokens on this machine.

- on-demand = resident: greedy tokens, the expert cache one routed set a layer and one expert more
  so that decode reads experts every step (the parity suite's setting, tests/test_parity.py), on the
  model and on tiny synthetic checkpoints of three other families written to a temp folder;
- prefetch = on-demand, with every guess read ahead (however small the experts);
- prerouter routes every consumer layer by its heads' prediction, with 0 routed experts dropped;
- the fast prefill (dense fp32 products for experts with enough rows, on a CPU with a fast BLAS)
  within its tested bound of the exact kernels: at most 1e-4 of each position's largest logit
  apart, the same greedy token at every position (tests/test_prefill_fast.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import EngineConfig, GenerationConfig, format_bytes
from ..errors import Edge0Error
from ..runtime.blas import dense_prefill_rows
from ..runtime.generation import Engine, GenerationResult
from .doctor_checks import NO_FAULTS, Check, Faults, fail, ok, skipped
from .evaluate import engine_logits

# Long enough for two prefill chunks of 16 (whole-layer reads) and a last token on its own.
PROMPT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is "
    "the sun. Arise, fair sun, and kill the envious moon."
)
# As the parity suite runs it: chunks of 16, today's kernels, whole layers where they fit.
EXACT = {"prefill_chunk": 16, "exact_kernels": True, "whole_layer_prefill": True}
# The fast prefill's tested bound (tests/test_prefill_fast.py: measured ~1e-6).
PREFILL_BOUND = 1e-4
# The position at which a fault replaces a token.
FAULT_AT = 5


def greedy(tokens: int) -> GenerationConfig:
    # Past EOS: a random model may end early, and the runs compare every token.
    return GenerationConfig(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def evicting_budget(model_dir: Path) -> int:
    """An expert cache of one routed set a layer and one expert more: experts are evicted and
    read again every step. Reads the checkpoint's headers and builds the model (no weights)."""
    with Engine(model_dir, EngineConfig(mode="on-demand", refuse_over_plan=False)) as engine:
        one = max(engine.store.resident_expert_nbytes(n) for n in engine.store.index.layers)
        return (engine.loaded.top_k + 1) * one


def _generate(model_dir: Path, tokens: int, **config) -> tuple[GenerationResult, Engine]:
    with Engine(model_dir, EngineConfig(**{**EXACT, **config})) as engine:
        result = engine.generate(engine.encode(PROMPT), greedy(tokens))
    return result, engine


def _first_difference(got: list[int], want: list[int]) -> str | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i} is {a}, the reference's {b}"
    if len(got) != len(want):
        return f"{len(got)} tokens, the reference {len(want)}"
    return None


def _with_fault(tokens: list[int], on: bool) -> list[int]:
    if on and len(tokens) > FAULT_AT:
        tokens = list(tokens)
        tokens[FAULT_AT] ^= 1  # another token id
    return tokens


def check_on_demand(
    model_dir: Path, name: str, tokens: int, budget: int, faults: Faults = NO_FAULTS
) -> Check:
    """On-demand with an evicting cache gives resident mode's greedy tokens."""
    title = f"on-demand = resident ({name})"
    try:
        resident, _ = _generate(model_dir, tokens, mode="resident")
    except Edge0Error as e:  # a model too big to hold whole: the synthetic ones still run
        return skipped("exactness", title, f"resident mode cannot run here: {e}")
    streamed, engine = _generate(model_dir, tokens, mode="on-demand", expert_cache_bytes=budget)
    got = _with_fault(streamed.tokens, faults.wrong_token)
    decode = [s for s in streamed.steps if s.phase == "decode"]
    reading = sum(s.loads > 0 for s in decode)
    # What a token reads when every routed expert is cold: K experts a MoE layer (the verdict).
    layers = engine.loaded.index.layers.values()
    figures = {
        "tokens": got,
        "cold_bytes_per_token": engine.k * sum(n.expert_nbytes for n in layers),
        # ... and what it computes through besides them (edge0 info's speed estimate)
        "resident_bytes": engine.memory_plan.resident_bytes,
    }
    difference = _first_difference(got, resident.tokens)
    cache = (
        f"a {format_bytes(budget)} expert cache read experts in {reading} of {len(decode)} steps"
    )
    if difference:
        return fail("exactness", title, f"{difference} ({cache})", **figures)
    return ok(
        "exactness", title, f"{len(got)} of {len(got)} greedy tokens equal; {cache}", **figures
    )


def check_family(folder: Path, family: str, tokens: int) -> Check:
    """The same on a tiny synthetic checkpoint of `family`, written into `folder`."""
    from ..train.synth import write_synthetic_checkpoint

    model_dir = write_synthetic_checkpoint(folder / family, family, "tiny")
    check = check_on_demand(model_dir, f"synthetic {family}", tokens, evicting_budget(model_dir))
    return Check(check.group, check.name, check.status, check.detail)


def check_prefetch(
    model_dir: Path,
    on_demand_tokens: list[int] | None,
    tokens: int,
    budget: int,
    faults: Faults = NO_FAULTS,
) -> Check:
    """Prefetch, every guess read ahead on the reader threads, gives on-demand's tokens."""
    title = "prefetch = on-demand"
    if on_demand_tokens is None:  # on-demand did not run (resident could not): run it here
        on_demand_tokens = _generate(
            model_dir, tokens, mode="on-demand", expert_cache_bytes=budget
        )[0].tokens
    result, _ = _generate(
        model_dir, tokens, mode="prefetch", expert_cache_bytes=budget, prefetch_min_expert_bytes=0
    )
    got = _with_fault(result.tokens, faults.prefetch_wrong_token)
    decode = [s for s in result.steps if s.phase == "decode"]
    ahead = sum(s.lookahead_issued + s.prefetch_issued for s in decode)
    reads = f"{ahead} experts read ahead in {len(decode)} steps"
    difference = _first_difference(got, on_demand_tokens)
    if difference:
        return fail("exactness", title, f"{difference} ({reads})")
    if ahead == 0:
        return fail("exactness", title, "nothing was read ahead: prefetch was not exercised")
    return ok("exactness", title, f"{len(got)} of {len(got)} tokens equal; {reads}")


def check_prerouter(model_dir: Path, tokens: int, budget: int, faults: Faults = NO_FAULTS) -> Check:
    """Every decode step routes each consumer layer by its heads' prediction (read a step ahead),
    and no routed expert was missing from what the prediction staged."""
    title = "prerouter routes by its prediction"
    with Engine(model_dir, EngineConfig(mode="on-demand", expert_cache_bytes=budget)) as engine:
        if "prerouter" not in engine.modes():
            return skipped(
                "exactness",
                title,
                "no prerouter heads for this model: `edge0 train heads` makes them",
            )
        engine.request_mode("prerouter")
        engine.apply_requests()
        if faults.misroute:
            _misroute_one_layer(engine)
        result = engine.generate(engine.encode(PROMPT), greedy(tokens))
        consumers = len(engine.routing.heads.consumers)
    decode = [s for s in result.steps if s.phase == "decode"]
    dropped = sum(s.dropped for s in result.steps)
    unpredicted = sum(s.predicted != consumers for s in decode)
    what = f"K={engine.k}, {consumers} consumer layers, {len(decode)} steps"
    if dropped or unpredicted:
        return fail(
            "exactness",
            title,
            f"{dropped} routed experts dropped, {unpredicted} steps not routed by the prediction "
            f"({what})",
        )
    return ok("exactness", title, f"every step, 0 dropped ({what})")


def _misroute_one_layer(engine: Engine) -> None:
    """Faults.misroute: the first consumer layer routes by the prediction's experts shifted by
    one, which its reads ahead did not stage."""
    routing = engine.routing
    first = engine.routing.heads.consumers[0]
    prediction_for = routing.prediction_for

    def shifted(layer: int):
        prediction = prediction_for(layer)
        if prediction is None or layer != first:
            return prediction
        host, indices, weights = prediction
        experts = engine.loaded.num_experts
        shifted = None if host is None else (host + 1) % experts
        return shifted, (indices + 1) % experts, weights

    routing.prediction_for = shifted


def check_fast_prefill(model_dir: Path, faults: Faults = NO_FAULTS) -> Check:
    """The fast prefill's logits over the prompt within PREFILL_BOUND of the exact kernels'."""
    title = "fast prefill within its bound"
    if dense_prefill_rows(EngineConfig()) is None:
        return skipped(
            "exactness",
            title,
            "prefill keeps the exact 4-bit kernels here (a GPU, or no fast BLAS in this process)",
        )
    logits = {}
    for exact in (True, False):
        config = EngineConfig(mode="on-demand", exact_kernels=exact, prefill_chunk=64)
        with Engine(model_dir, config) as engine:
            prompt = mx.array([engine.encode(PROMPT)])
            logits[exact] = np.array(engine_logits(engine, prompt)[0].astype(mx.float32))
    exact, fast = logits[True], logits[False]
    scale = np.abs(exact).max(axis=-1)
    if faults.prefill_drift:
        fast = fast.copy()
        fast[-1, 0] += faults.prefill_drift * scale[-1]
    relative = float((np.abs(fast - exact).max(axis=-1) / scale).max())
    same = int((fast.argmax(-1) == exact.argmax(-1)).sum())
    detail = (
        f"largest difference {relative:.1e} of a position's largest logit (bound "
        f"{PREFILL_BOUND:.0e}), greedy token equal at {same} of {len(exact)} positions"
    )
    if relative > PREFILL_BOUND or same != len(exact):
        return fail("exactness", title, detail, relative=relative)
    return ok("exactness", title, detail, relative=relative)

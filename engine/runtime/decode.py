"""One reply, step by step: each forward is built and queued on the device, then read once.

A step, top to bottom (`Decoder.build`, then `Decoder.finish`):
1. Requested K and mode switches apply (`Engine.apply_requests`); the store and the routing
   state begin the step. Where the lookahead guesses the first MoE layer, its reads were
   started at the end of the previous step.
2. The model's forward is built (mlx-lm's own modules). Each MoE layer (`routing/moe_block.py`)
   routes: by the previous step's prediction (prerouter consumers), or by its own router. Its
   experts' slots come from the expert store: a held layer maps its routing to slots on the
   device; any other layer waits only on reads from disk, except that a layer routed by its own
   router reads that routing back (one wait on the device, exact modes). Each layer is queued
   on the device as soon as it is built (`mx.async_eval`).
3. The token is sampled on the device; the prerouter heads and the lookahead's guess of the next
   step's first layer are built into the same graph.
4. One host read (`engine/host_reads.py`) brings back the token, the numerical guard's count, the
   heads' predictions, the guess, and the held layers' routing (for the counters).
5. The next step's reads ahead start, in the order it needs them (the first layer's guess, then
   the predicted layers), and the step's metrics are made.
Where the next step needs nothing from the host (every layer held: no read, no routing read
back; or resident mode), it is built before this step's token is read, as mlx-lm's
`generate_step` does: the device never waits for the host between steps.

With a drafter (`GenerationConfig.draft`, runtime/speculative.py) each decode step is a verify
step: its forward runs [last token, drafts] (each MoE layer reads the union of the positions'
missing experts once), the verifier picks the kept drafts and the next token on the device, the
step's one host read brings them back with the rest, and the KV cache drops the rejected
drafts. Such steps are never built ahead: the next one's drafts follow from this one's tokens.

The step in six files: this one, `routing/moe_block.py` (a MoE layer), `routing/state.py` (the
heads' predictions), `experts/store.py` (where each expert is), `experts/switch_glu.py` (the
experts' compute) and `sampling.py`. Every other file a step enters is a helper of one of them
(tests/test_decode_path.py keeps the table).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from ..experts.counters import LoadCounters
from ..routing.lookahead import Guess
from ..routing.state import Predictions, RoutingCounters
from .metrics import StepMetrics, merged
from .sampling import Sampler, TokenLogprobs
from .speculative import Speculation

if TYPE_CHECKING:
    from .generation import Engine

GUESSING_MODES = ("prefetch", "prerouter")  # the modes whose lookahead reads guesses ahead


@dataclass
class GeneratedToken:
    """One token of a reply, as `Engine.stream` yields it."""

    token: int
    step: StepMetrics  # the forward that gave it
    logprobs: TokenLogprobs | None = None  # when the reply asks for them
    logits: mx.array | None = None  # evaluated, when asked for (`keep_logits`)


@dataclass
class GenerationResult:
    """A whole reply: its tokens and text, each forward's metrics, and their summary."""

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    steps: list[StepMetrics]
    summary: dict = field(default_factory=dict)
    stopped_by: str = "max_tokens"  # "eos", "max_tokens" or "cancelled"
    # One per token, when GenerationConfig.logprobs asks for them.
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class Reply:
    """A reply being made (`Engine.stream`): iterate it for its tokens as they come; once it is
    done, `result` is the whole `GenerationResult` (None while tokens are still coming, or when
    the caller stopped iterating early)."""

    def __init__(self, tokens: Generator[GeneratedToken, None, object]) -> None:
        self._tokens = tokens
        self.result = None

    def __iter__(self) -> Iterator[GeneratedToken]:
        self.result = yield from self._tokens


@dataclass
class Step:
    """One forward, built and queued on the device until its values are read (`finish`)."""

    phase: str  # "prefill" (up to the first token) or "decode"
    tokens: int
    started: float
    pool_step: int = 0
    logits: mx.array | None = None  # the last position's (one-token forwards); a verify step's all
    sampled: list[mx.array] = field(default_factory=list)  # the sampler's token (and logprobs)
    repaired: mx.array | None = None  # hidden values the numerical guard repaired
    predictions: Predictions | None = None  # the heads' routing of the next step
    guess: Guess | None = None  # the lookahead's guess of the next step's first MoE layer
    wait: list = field(default_factory=list)  # evaluated in the step's read, not read (a cache)
    rows_sampled: list[int] = field(default_factory=list)  # a batch step: each row's sampled arrays
    # Held layers' routing, on the device: (layer, indices), read with the token.
    device_routing: list[tuple[int, mx.array]] = field(default_factory=list)
    routing_counters: RoutingCounters | None = None
    counters: LoadCounters | None = None  # the store's, when its step ended at the build

    def to_read(self) -> dict[str, mx.array]:
        """What the step's one read brings to the host, by name: the sampler's arrays, the
        guard's count, the heads' predictions, the next step's first-layer guess, and each held
        layer's routing."""
        values = {f"sampled {i}": array for i, array in enumerate(self.sampled)}
        if self.repaired is not None:
            values["repaired"] = self.repaired
        if self.predictions is not None:
            values["predictions"] = self.predictions.indices
        if self.guess is not None:
            values["guess"] = self.guess.indices
        for layer, indices in self.device_routing:
            values[f"routed {layer}"] = indices
        return values

    def device_values(self) -> list:
        """Everything the step computes, to queue on the device at once."""
        logits = [] if self.logits is None else [self.logits]
        return [*self.to_read().values(), *self.wait, *logits]


class Decoder:
    """Runs one reply on an engine: its prefill, then its decode steps (module docstring). Owns
    the reply's step state; the engine owns the model, the store and the routing state."""

    def __init__(
        self,
        engine: Engine,
        cache: list,
        sampler: Sampler | None,
        forced: list[int] | None,
        keep_logits: bool = False,
        speculation: Speculation | None = None,
    ) -> None:
        self.engine = engine
        # Drafts are verified against sampled tokens (forced ones are known, not sampled).
        self.speculation = speculation if forced is None and not keep_logits else None
        self.cache = cache
        self.sampler = sampler if forced is None else None  # forced tokens are fed, not sampled
        self.forced = forced
        self.keep_logits = keep_logits
        # Requested K and mode switches apply at this decoder's steps (a batch's wait for it
        # to end: its members' rows share one profile).
        self.switches = True
        self.steps: list[StepMetrics] = []
        self.stopped_by = "max_tokens"  # "eos", "max_tokens" or "cancelled"
        # The last token was fed to the KV cache (a step was built ahead of its read).
        self.cache_holds_last = False
        self._first_guessed = False  # the next step's first layer was guessed and read ahead
        self._last_read_end = 0.0

    def run(
        self,
        prompt_tokens: list[int],
        reused: int,
        max_tokens: int,
        eos: set[int],
        should_stop: Callable[[], bool] | None,
    ) -> Iterator[GeneratedToken]:
        """Prefill the prompt past its `reused` tokens, then yield each token until an `eos` token,
        `max_tokens`, or `should_stop` (asked before each prefill chunk and after each token)."""
        engine, forced = self.engine, self.forced
        for _ in self.prefill(prompt_tokens, reused, should_stop):
            pass
        if self.stopped_by == "cancelled":
            return
        given = 0  # tokens given so far: the step being finished gives token `given`
        step = self.build(mx.array(prompt_tokens[-1:]), "prefill", self._next_input(0))
        while True:
            ahead = None
            if self.pipelined and given + 1 < max_tokens:
                following = self._token_of(step, given)
                ahead = self.build(following, "decode", self._next_input(given + 1))
            values = self.finish(step)
            if step.phase == "prefill":
                engine.last_prefill = merged(self.steps)  # the prompt's forwards, for the panels
            token = forced[given] if forced else self.sampler.finish(values)
            if self.sampler is not None:
                self.steps[-1].mask_ms = self.sampler.take_mask_ms()
            given += 1
            logprobs = self.sampler.last if self.sampler is not None else None
            logits = step.logits if self.keep_logits else None
            yield GeneratedToken(token, self.steps[-1], logprobs, logits)
            if token in eos or (self.sampler is not None and self.sampler.done):
                self.stopped_by = "eos"  # or the grammar is complete and allows nothing more
            elif given >= max_tokens:
                pass
            elif should_stop is not None and should_stop():
                self.stopped_by = "cancelled"
            elif self.speculation is not None:
                context = [*prompt_tokens, token]
                yield from self._speculate(context, given, max_tokens, eos, should_stop)
                return
            else:
                step = ahead or self.build(mx.array([token]), "decode", self._next_input(given))
                continue
            self.cache_holds_last = ahead is not None  # it fed this last token already
            return

    def prefill(
        self, prompt_tokens: list[int], reused: int, should_stop: Callable[[], bool] | None
    ) -> Iterator[None]:
        """The prompt past its `reused` tokens, all but its last, a chunk a forward, yielding
        after each (a batch runs its members' chunks between its steps). `should_stop` is asked
        before each chunk: a long prompt is many forwards, and a caller gone meanwhile (a client
        that disconnected) frees the engine now, not after the whole prefill ("cancelled")."""
        chunk = self.engine.config.prefill_chunk
        body = prompt_tokens[reused:-1]
        for start in range(0, len(body), chunk):
            if should_stop is not None and should_stop():
                self.stopped_by = "cancelled"
                return
            last_chunk = start + chunk >= len(body)
            tokens = mx.array(body[start : start + chunk])
            after = prompt_tokens[-1] if last_chunk else None
            self.finish(self.build(tokens, "prefill", next_input=after, flush=last_chunk))
            yield

    @property
    def pipelined(self) -> bool:
        """Whether a step can be built before the previous one's values are read: nothing in it
        waits for the host (every expert is held: no read, no routing read back; no grammar,
        whose mask for a token needs the token before it)."""
        if self.sampler is not None and self.sampler.constrained:
            return False
        if self.speculation is not None:
            return False
        store = self.engine.store
        if store is not None and store.share is not None:
            # Ranks must sum in one order: a step built ahead would queue its layers' sums
            # before the stop that ranks agree on after each token (runtime/follow.py).
            return False
        return store is None or store.every_layer_held

    def build(
        self,
        tokens: mx.array,
        phase: str,
        next_input: int | None = None,
        flush: bool = True,
        seen: list[int] | None = None,
        draft: list[int] | None = None,
    ) -> Step:
        """Build one forward and queue it on the device. A one-token forward samples its token
        (on the device); `flush` runs the prerouter heads for the next step; `next_input` is the
        next step's input where the host knows it (a prompt's or a forced token; else the
        sampled one), from which the next step's first MoE layer is guessed. With `draft`, a
        verify step: `tokens` is `seen`'s last token and the drafts, and the verifier picks
        the kept drafts and the next token from every position's logits."""
        engine = self.engine
        if self.switches:
            engine.apply_requests()
        routing, store, lookahead = engine.routing, engine.store, engine.lookahead
        one = tokens.size == 1
        step = self._begin(phase, tokens.size)
        guessing = lookahead is not None and engine.mode in GUESSING_MODES
        if guessing and one:
            lookahead.active = True
            self._look_ahead_at_first_layer(tokens)
        if draft:
            self._first_guessed = False  # a guess of a one-token step's layer is no use here
        out = engine.model(tokens[None], cache=self.cache)
        step.repaired = engine.guard.take() if engine.guard is not None else None
        following = None  # the next step's input, on the device
        if draft is not None:
            step.logits = out[0]
            with engine.tracer.span("verify", "step"):
                kept, picked = self.speculation.verify(step.logits, seen, draft)
            step.sampled = [kept, picked]
            following = picked[kept].reshape(1)
        elif one:
            step.logits = out[:, -1, :]
            if self.sampler is not None:
                with engine.tracer.span("sample", "step"):
                    step.sampled = self.sampler(step.logits)
        else:
            step.wait = [c.state for c in self.cache]  # a prefill chunk: only the cache is kept
        if store is not None:
            step.device_routing = store.device_routing()
        if flush and not draft and routing is not None and routing.heads is not None:
            # (After drafts, the heads would predict from a position that may be rejected.)
            step.predictions = routing.flush()
        if lookahead is not None:
            lookahead.end_step()
            lookahead.active = False
            if following is None and step.sampled:
                following = step.sampled[0]
            if following is None and next_input is not None:
                following = mx.array([next_input])
            if guessing and following is not None:
                step.guess = lookahead.guess_first(following)
        mx.async_eval(step.device_values())
        if self.pipelined and store is not None:
            # Nothing of this step can be read or evicted any more: its accounting ends now,
            # before the next step is built over it.
            step.counters = store.end_step()
        return step

    def build_rows(self, tokens: mx.array, samplers: list[Sampler]) -> Step:
        """A batch step (runtime/batch.py): one forward over every row's last token ([B, 1],
        over the batch's KV caches), each row sampled by its own sampler. A consumer layer routes
        each row by that row's prediction (prerouter), any other by its own router; the heads
        predict every row's next step, the lookahead guesses the union of the rows' experts (the
        next step's first layer included). No switch applies (`switches`)."""
        engine = self.engine
        routing, store, lookahead = engine.routing, engine.store, engine.lookahead
        step = self._begin("decode", tokens.size)
        guessing = lookahead is not None and engine.mode in GUESSING_MODES
        if guessing:
            lookahead.active = True
            self._look_ahead_at_first_layer(tokens)
        out = engine.model(tokens[:, None], cache=self.cache)
        step.repaired = engine.guard.take() if engine.guard is not None else None
        step.logits = out[:, -1, :]
        with engine.tracer.span("sample", "step"):
            for row, sampler in enumerate(samplers):
                sampled = sampler(step.logits[row : row + 1])
                step.sampled.extend(sampled)
                step.rows_sampled.append(len(sampled))
        if store is not None:
            step.device_routing = store.device_routing()
        if routing is not None and routing.heads is not None:
            step.predictions = routing.flush()
        if lookahead is not None:
            lookahead.end_step()
            lookahead.active = False
            if guessing:
                starts = [sum(step.rows_sampled[:row]) for row in range(len(samplers))]
                following = mx.concatenate([step.sampled[i].reshape(-1) for i in starts])
                step.guess = lookahead.guess_first(following)
        mx.async_eval(step.device_values())
        return step

    def _begin(self, phase: str, positions: int) -> Step:
        """A forward's step: the routing state's and the store's step start with it."""
        engine = self.engine
        step = Step(phase, positions, time.perf_counter())
        if engine.routing is not None:
            step.routing_counters = engine.routing.begin_step()
        if engine.store is not None:
            engine.store.begin_step()
            step.pool_step = engine.store.pool.step
        return step

    def finish(self, step: Step) -> list:
        """Read the step's values in one wait; count the held layers' routing; start the next
        step's reads ahead; keep the step's metrics. Returns the sampler's values."""
        engine = self.engine
        store, tracer = engine.store, engine.tracer
        wanted = step.to_read()
        with tracer.span("evaluate", "compute"):  # the compute left once the graph is built
            also = step.wait + ([step.logits] if self.keep_logits else [])
            why = "the step's token and what the next one needs"
            host = dict(zip(wanted, engine.host_reads.read(list(wanted.values()), why, also)))
        staged = time.perf_counter()
        if store is not None:
            held = [(layer, host[f"routed {layer}"]) for layer, _ in step.device_routing]
            # Into the step's counters, and the heat picture of the step the store is in (this
            # one; the next where it was built ahead: the picture then lags a step).
            store.settle(step.counters or store.counters, held, step.pool_step)
        counters = step.counters
        if counters is None:
            counters = store.end_step() if store is not None else LoadCounters()
        # The next step's reads, in the order it needs them: its first MoE layer's guess, then
        # the predicted layers (the readers take the earliest layer's read first).
        if step.guess is not None:
            step.guess.host = host["guess"]
            store.look_ahead(step.guess.layer, step.guess.likely, next_step=True)
            self._first_guessed = True
        if step.predictions is not None:
            predicted = engine.routing.settle(step.predictions, host["predictions"])
            for layer, experts in sorted(predicted.items()):
                store.stage(layer, experts)
        end = time.perf_counter()
        # A step's time runs from the later of its build's start and the previous step's read:
        # steps built ahead overlap, and their times add up to the reply's.
        wall_ms = (end - max(step.started, self._last_read_end)) * 1e3
        self._last_read_end = end
        syncs, reasons = engine.host_reads.take()
        tracer.complete(
            f"{step.phase} step", "step", step.started, end, tokens=step.tokens, host_syncs=syncs
        )
        self.steps.append(
            StepMetrics.build(
                step.phase,
                step.tokens,
                wall_ms,
                counters,
                engine.memory.snapshot(),
                store.pool.resident_bytes if store is not None else 0,
                step.routing_counters,
                engine.mode,
                engine.k,
                int(host["repaired"]) if "repaired" in host else 0,
                (end - staged) * 1e3 if step.predictions is not None else 0.0,
                syncs,
                reasons,
            )
        )
        if step.phase == "decode" and store is not None:
            metrics = self.steps[-1]
            metrics.experts_union = counters.hits + counters.loads
            metrics.experts_summed = step.tokens * engine.k * len(engine.loaded.index.layers)
        return [host[f"sampled {i}"] for i in range(len(step.sampled))]

    def _speculate(
        self,
        context: list[int],
        given: int,
        max_tokens: int,
        eos: set[int],
        should_stop: Callable[[], bool] | None,
    ) -> Iterator[GeneratedToken]:
        """The reply's decode steps as verify steps, from `context` (the prompt and the `given`
        tokens so far; the KV cache holds all but its last): each yields the drafts it kept and
        one token more, until `run`'s ends."""
        speculation = self.speculation
        while True:
            draft = speculation.draft(context, max_tokens - given - 1, self.cache)
            if self.engine.pending[1] == "prerouter":  # switched to it during the reply
                draft = []  # (its heads predict each step from the one before: see `build`)
            step = self.build(mx.array([context[-1], *draft]), "decode", seen=context, draft=draft)
            values = self.finish(step)
            kept = int(values[0].reshape(-1)[0])
            tokens = values[1].reshape(-1)[: kept + 1].tolist()
            if len(draft) > kept:
                trim_prompt_cache(self.cache, len(draft) - kept)  # the rejected drafts
            speculation.length.update(len(draft), kept)
            metrics = self.steps[-1]
            metrics.drafted, metrics.accepted, metrics.given = len(draft), kept, len(tokens)
            for i, token in enumerate(tokens):
                context.append(token)
                given += 1
                yield GeneratedToken(token, metrics)
                if token in eos:
                    self.stopped_by = "eos"
                elif given >= max_tokens:
                    pass
                elif should_stop is not None and should_stop():
                    self.stopped_by = "cancelled"
                else:
                    continue
                # The cache holds every token given but the last: the kept drafts after this
                # token go.
                if i < kept:
                    trim_prompt_cache(self.cache, kept - i)
                metrics.given = i + 1
                return

    def _look_ahead_at_first_layer(self, tokens: mx.array) -> None:
        """Read ahead the first MoE layer's guessed experts before the forward starts: no layer
        before it in the token can guess it (routing/lookahead.py). The previous step built the
        guess from this input, read it with its token and started its reads; a step without
        one (the first of a reply whose prompt needed no prefill chunk) reads it now."""
        engine = self.engine
        guessed, self._first_guessed = self._first_guessed, False
        guess = None if guessed else engine.lookahead.guess_first(tokens)
        if guess is None:
            return
        with engine.tracer.span("lookahead first layer", "prerouter"):
            guess.host = engine.host_reads.read([guess.indices], "the first layer's guess")[0]
        engine.store.look_ahead(guess.layer, guess.likely)

    def _token_of(self, step: Step, position: int) -> mx.array:
        """Token `position`, which `step` gives, still on the device where it was sampled."""
        return mx.array(self.forced[position : position + 1]) if self.forced else step.sampled[0]

    def _next_input(self, position: int) -> int | None:
        """The input of the step after the one that gives token `position`, where the host knows
        it in advance (a forced token): that step's first layer is guessed from it."""
        forced = self.forced
        return forced[position] if forced and position + 1 < len(forced) else None

"""Per-request routing state shared by every `RoutedMoE` block.

It holds the routing width K, the predictions this step's consumer layers route by, and what the
owner layers executed (their MoE input at the last position, their routed experts at the last two
positions) for the head flush that makes the next step's predictions.

Decode step 1 (the forward on the last prompt token) already routes by predictions when the prompt
has at least two tokens: the flush after the last prefill chunk predicts from the last prefill
position, exactly as at any decode step. A one-token prompt routes step 1 with the true routers.
Every request starts from `reset()`: nothing of the previous request steers the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..trace import NO_TRACE, Tracer
from .functions import route
from .prerouter import PrerouterHeads, head_features


@dataclass
class RoutingCounters:
    predicted: int = 0  # consumer layers routed by a prediction this step
    dropped: int = 0  # routed experts that were not in the staged set (must stay 0)
    shadow_hits: int = 0  # with the shadow router: predicted experts the true router also chose
    shadow_total: int = 0
    prefetch_hits: int = 0  # prefetch mode: routed experts of consumer layers that were predicted
    prefetch_routed: int = 0  # prefetch mode: routed experts of consumer layers


class ReadsAhead(Protocol):
    """Where predictions go (the expert store): reads for the next step, and the layers known
    computed, whose experts may then go."""

    def stage(self, layer: int, experts: list[int]) -> None: ...
    def layer_computed(self, layer: int) -> None: ...


class RoutingState:
    def __init__(
        self,
        k: int,
        experts: int,
        blocks: dict,
        float_dtype: mx.Dtype | None,
        reads_ahead: ReadsAhead,
        tracer: Tracer = NO_TRACE,
    ) -> None:
        self.k = k
        self.experts = experts
        self.blocks = blocks  # layer -> RoutedMoE
        self.float_dtype = float_dtype
        self.reads_ahead = reads_ahead
        self.tracer = tracer
        self.heads: PrerouterHeads | None = None
        self.route_by_predictions = True
        self.shadow_router = False
        self.counters = RoutingCounters()
        # Set by the engine for one-token forwards that end with a flush: run every owner's head
        # as (self-routed owners) or right after (owners routed by a prediction) its layer
        # executes, and stage each prediction's reads then instead of at the flush. A queued
        # head read back also tells `reads_ahead` that its layer has computed (the stream runs
        # in order): that layer's experts may go.
        self.early_heads = False
        self.reset()

    def reset(self) -> None:
        """Forget all prediction state (a new request, or new heads / K)."""
        self._predictions: dict[int, tuple[np.ndarray, mx.array]] = {}
        self._staged: dict[int, frozenset[int]] = {}
        # The next step's predictions, filled by early heads during this step and by the flush.
        self._next: dict[int, tuple[np.ndarray, mx.array]] = {}
        self._owner_x: dict[int, mx.array] = {}
        self._owner_now: dict[int, np.ndarray] = {}
        self._owner_before: dict[int, np.ndarray | None] = {}
        # Heads queued behind their layer, not yet read back: (owners, inds, weights).
        self._queued: list[tuple[list[int], mx.array, mx.array]] = []

    def set_heads(self, heads: PrerouterHeads | None, route_by_predictions: bool = True) -> None:
        """Heads whose every owner has a consumer, its next MoE layer (see `keep_owners`). With
        `route_by_predictions` False (prefetch mode) the predictions are only read ahead: every
        layer routes by its own router."""
        self.heads = heads
        self.route_by_predictions = route_by_predictions
        self._owners = set(heads.owners) if heads is not None else set()
        consumers = set(heads.consumers) if heads is not None else set()
        # Owners that route by their own router: their routing is on the host as soon as they
        # run, so their heads run right then (see `executed`), a whole step before the flush.
        # In prefetch mode that is every owner.
        self._early_owners = self._owners - consumers if route_by_predictions else self._owners
        # Owners that route by a prediction: their routing is on the host before they run, but
        # their MoE input is a lazy array the forward has only queued. Their heads are queued
        # right behind the layer (`mx.async_eval`) and read back when the next layer runs, so
        # the reads they start get a whole step too, and the engine thread never waits for a
        # layer it could build the next one's graph under.
        self._queued_owners = self._owners & consumers if route_by_predictions else set()
        self.reset()

    def begin_step(self) -> RoutingCounters:
        self.counters = RoutingCounters()
        return self.counters

    # -- called by the blocks during the forward ---------------------------------------------------

    def prediction_for(self, layer: int) -> tuple[np.ndarray, mx.array] | None:
        return self._predictions.get(layer) if self.route_by_predictions else None

    def executed(self, layer: int, x: mx.array, routed: np.ndarray) -> None:
        if not self.route_by_predictions and layer in self._staged:
            chosen = set(routed.reshape(-1).tolist())
            self.counters.prefetch_hits += len(chosen & self._staged[layer])
            self.counters.prefetch_routed += len(chosen)
        if self.early_heads:
            # The head queued behind the layer before this one has run by now (or nearly).
            self._read_back_queued()
        if layer not in self._owners:
            return
        per_token = routed.reshape(-1, routed.shape[-1])
        before = per_token[-2] if len(per_token) >= 2 else self._owner_now.get(layer)
        self._owner_before[layer] = before
        self._owner_now[layer] = per_token[-1]
        self._owner_x[layer] = x.reshape(-1, x.shape[-1])[-1]
        if not self.early_heads:
            return
        if layer in self._early_owners:
            with self.tracer.span(f"early head {layer}", "prerouter"):
                inds, weights = self._head_graph([layer])
                mx.eval(inds, weights)
            self._hand_over([layer], inds, weights)
        elif layer in self._queued_owners:
            inds, weights = self._head_graph([layer])
            mx.async_eval(inds, weights)
            self._queued.append(([layer], inds, weights))

    def _read_back_queued(self) -> None:
        for owners, inds, weights in self._queued:
            with self.tracer.span(f"early head {owners[0]}", "prerouter"):
                mx.eval(inds, weights)
            for owner in owners:
                self.reads_ahead.layer_computed(owner)
            self._hand_over(owners, inds, weights)
        self._queued = []

    def _hand_over(self, owners: list[int], inds: mx.array, weights: mx.array) -> None:
        """Store a head's predictions for the next step and start their reads."""
        predicted = self._store_predictions(owners, inds, weights)
        for consumer, experts in predicted.items():
            self.reads_ahead.stage(consumer, experts.tolist())

    def consumed(self, block, x: mx.array, routed: np.ndarray) -> None:
        self.counters.predicted += 1
        staged = self._staged.get(block.layer, frozenset())
        self.counters.dropped += len(set(routed.reshape(-1).tolist()) - staged)
        if self.shadow_router:
            logits = block.gate_logits(x)
            true, _ = route(logits, block.routing_spec, self.k, block.expert_bias())
            true_set = set(np.array(true).reshape(-1).tolist())
            self.counters.shadow_hits += len(true_set & set(routed.reshape(-1).tolist()))
            self.counters.shadow_total += len(true_set)

    # -- the head flush, once per step --------------------------------------------------------------

    def flush(self) -> dict[int, np.ndarray]:
        """Run every head not run early this step; the predictions route the next step. Returns
        consumer -> experts for every consumer (early ones included)."""
        heads = self.heads
        if heads is None or any(o not in self._owner_x for o in heads.owners):
            self._predictions, self._staged, self._next = {}, {}, {}
            self._queued = []
            return {}
        self._read_back_queued()
        done = {o for o, c in zip(heads.owners, heads.consumers) if c in self._next}
        remaining = [o for o in heads.owners if o not in done]
        if remaining:  # in prefetch mode every head ran early
            inds, weights = self._head_graph(remaining)
            mx.eval(inds, weights)
            self._store_predictions(remaining, inds, weights)
        self._predictions, self._next = self._next, {}
        self._staged = {layer: frozenset(p[0].tolist()) for layer, p in self._predictions.items()}
        return {layer: p[0] for layer, p in self._predictions.items()}

    def _head_graph(self, owners: list[int]) -> tuple[mx.array, mx.array]:
        """The (lazy) routing the heads of `owners` predict for their consumers: indices and
        weights, one row per owner (contiguous runs of the stacked heads at once)."""
        heads = self.heads
        unknown = np.full(self.k, -1)  # no token before the request's first
        rows = [heads.owners.index(o) for o in owners]
        logits = []
        for first, last in _runs(rows):
            run = heads.owners[first : last + 1]
            x = mx.stack([self._owner_x[o] for o in run]).astype(heads.fc1.dtype)
            now = mx.array(np.stack([self._owner_now[o] for o in run]))
            before = [self._owner_before[o] for o in run]
            before = mx.array(np.stack([unknown if b is None else b for b in before]))
            features = head_features(x, now, before, self.experts)
            logits.append(heads(features, first, last + 1))
        logits = mx.concatenate(logits) if len(logits) > 1 else logits[0]
        consumers = [self.blocks[heads.consumers[i]] for i in rows]
        biases = [c.expert_bias() for c in consumers]
        bias = mx.stack(biases) if all(b is not None for b in biases) else None
        if self.float_dtype is not None:
            logits = logits.astype(self.float_dtype)
        return route(logits, consumers[0].routing_spec, self.k, bias)

    def _store_predictions(
        self, owners: list[int], inds: mx.array, weights: mx.array
    ) -> dict[int, np.ndarray]:
        """Keep evaluated head outputs as the next step's predictions. Returns consumer -> experts."""
        heads = self.heads
        host = np.array(inds)
        predicted = {}
        for i, owner in enumerate(owners):
            consumer = heads.consumers[heads.owners.index(owner)]
            self._next[consumer] = (host[i], weights[i])
            predicted[consumer] = host[i]
        return predicted


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices as (first, last) runs of consecutive rows: [0, 1, 2, 5] -> (0, 2), (5, 5)."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and row == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], row)
        else:
            runs.append((row, row))
    return runs

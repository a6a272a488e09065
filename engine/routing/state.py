"""Per-request routing state shared by every `RoutedMoE` block.

It holds the routing width K, the predictions this step's consumer layers route by, and what the
owner layers executed (their MoE input at the last position, their routed experts at the last two
positions) for the heads that make the next step's predictions. All of it has a row per sequence
in the forward: one for a reply, a batch's rows for a batch (runtime/batch.py), which keeps each
member's rows (`RoutingRows`) while another member prefills, and joins or drops them.

The heads run on the device, in the step's own graph: `flush` builds them once the forward is
built, and the engine reads their predicted experts back with the step's token, in the step's one
host read (`settle`). The consumer layers of the next step route by those predictions: a consumer
held in the expert cache by the device array itself, any other by the experts the host read,
whose reads ahead the engine started right after that read. No step waits on the device for a
prediction.

Decode step 1 (the forward on the last prompt token) already routes by predictions when the prompt
has at least two tokens: the flush after the last prefill chunk predicts from the last prefill
position, exactly as at any decode step. A one-token prompt routes step 1 with the true routers.
Every request starts from `reset()`: nothing of the previous request steers the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..host_reads import HostReads
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


@dataclass
class Predictions:
    """One step's head outputs: the next step's routing of `consumers`, for each sequence."""

    consumers: list[int]
    indices: mx.array  # [n consumers, rows, K], on the device
    weights: mx.array  # [n consumers, rows, K]
    host: np.ndarray | None = None  # the indices once read with the step's token

    def row(self, layer: int) -> int | None:
        return self.consumers.index(layer) if layer in self.consumers else None

    def joined(self, other: Predictions) -> Predictions:
        """These sequences' predictions, then `other`'s (both read already)."""
        return Predictions(
            self.consumers,
            mx.concatenate([self.indices, other.indices], axis=1),
            mx.concatenate([self.weights, other.weights], axis=1),
            np.concatenate([self.host, other.host], axis=1),
        )

    def kept(self, rows: list[int]) -> Predictions:
        index = mx.array(rows, dtype=mx.int32)
        return Predictions(
            self.consumers, self.indices[:, index], self.weights[:, index], self.host[:, rows]
        )


@dataclass
class RoutingRows:
    """What `RoutingState` holds of some sequences between steps: the predictions their next
    step routes by, and their owner layers' last inputs and routings (`[rows, ...]` each)."""

    predictions: Predictions | None
    owner_x: dict[int, mx.array]
    owner_now: dict[int, mx.array]
    owner_before: dict[int, mx.array]

    def joined(self, other: RoutingRows) -> RoutingRows:
        """These sequences, then `other`'s: a batch and a member that joins it."""
        if not self.owner_x:
            return other
        both = self.predictions is not None and other.predictions is not None
        return RoutingRows(
            self.predictions.joined(other.predictions) if both else None,
            _joined(self.owner_x, other.owner_x),
            _joined(self.owner_now, other.owner_now),
            _joined(self.owner_before, other.owner_before),
        )

    def kept(self, rows: list[int]) -> RoutingRows:
        """Only the sequences at `rows` (a batch whose other members left)."""
        index = mx.array(rows, dtype=mx.int32)
        return RoutingRows(
            self.predictions.kept(rows) if self.predictions is not None else None,
            {layer: a[index] for layer, a in self.owner_x.items()},
            {layer: a[index] for layer, a in self.owner_now.items()},
            {layer: a[index] for layer, a in self.owner_before.items()},
        )


def _joined(a: dict[int, mx.array], b: dict[int, mx.array]) -> dict[int, mx.array]:
    return {layer: mx.concatenate([a[layer], b[layer]]) for layer in a if layer in b}


class RoutingState:
    def __init__(
        self,
        k: int,
        experts: int,
        blocks: dict,
        float_dtype: mx.Dtype | None,
        host_reads: HostReads,
        tracer: Tracer = NO_TRACE,
    ) -> None:
        self.k = k
        self.experts = experts
        self.blocks = blocks  # layer -> RoutedMoE
        self.float_dtype = float_dtype
        self.host_reads = host_reads
        self.tracer = tracer
        self.heads: PrerouterHeads | None = None
        self.route_by_predictions = True
        self.shadow_router = False
        self.counters = RoutingCounters()
        self.reset()

    def reset(self) -> None:
        """Forget all prediction state (a new request, or new heads / K)."""
        self._predictions: Predictions | None = None  # what this step's consumers route by
        # Each owner layer's MoE input at its sequences' last position, and its routed experts
        # there and at the position before (minus one where there was none), `[rows, ...]`.
        self._owner_x: dict[int, mx.array] = {}
        self._owner_now: dict[int, mx.array] = {}
        self._owner_before: dict[int, mx.array] = {}

    def take_rows(self) -> RoutingRows:
        """Everything held of the sequences in the forward, which the state then forgets."""
        rows = RoutingRows(self._predictions, self._owner_x, self._owner_now, self._owner_before)
        self.reset()
        return rows

    def put_rows(self, rows: RoutingRows | None) -> None:
        """Hold `rows` as the sequences of the next forward (None: none held)."""
        self.reset()
        if rows is not None:
            self._predictions = rows.predictions
            self._owner_x, self._owner_now = rows.owner_x, rows.owner_now
            self._owner_before = rows.owner_before

    def set_heads(self, heads: PrerouterHeads | None, route_by_predictions: bool = True) -> None:
        """Heads whose every owner has a consumer, its next MoE layer (see `keep_owners`). With
        `route_by_predictions` False (prefetch mode) the predictions are only read ahead: every
        layer routes by its own router."""
        self.heads = heads
        self.route_by_predictions = route_by_predictions
        self._owners = set(heads.owners) if heads is not None else set()
        self.reset()

    def begin_step(self) -> RoutingCounters:
        self.counters = RoutingCounters()
        return self.counters

    # -- called by the blocks during the forward ---------------------------------------------------

    def prediction_for(self, layer: int) -> tuple[np.ndarray | None, mx.array, mx.array] | None:
        """`layer`'s routing by the previous step's heads: (experts on the host, None until read;
        the same on the device; their weights). None where the layer routes by its own router."""
        predictions = self._predictions if self.route_by_predictions else None
        row = predictions.row(layer) if predictions is not None else None
        if row is None:
            return None
        host = predictions.host[row] if predictions.host is not None else None
        return host, predictions.indices[row], predictions.weights[row]

    def executed(self, layer: int, x: mx.array, routed: np.ndarray | mx.array) -> None:
        """`layer` ran with `routed` (on the host, or on the device for a held layer)."""
        on_host = isinstance(routed, np.ndarray)
        staged = self._staged(layer) if not self.route_by_predictions and on_host else None
        if staged is not None:
            chosen = set(routed.reshape(-1).tolist())
            self.counters.prefetch_hits += len(chosen & staged)
            self.counters.prefetch_routed += len(chosen)
        if layer not in self._owners:
            return
        # [rows, positions, ...]: a sequence a row (the forward's batch dimension; a family
        # whose block sees the tokens flattened runs one sequence).
        rows = x.shape[0] if x.ndim >= 3 else 1
        routed = (mx.array(routed) if on_host else routed).astype(mx.int32)
        routed = routed.reshape(rows, -1, routed.shape[-1])
        now = routed[:, -1]
        if routed.shape[1] >= 2:
            before = routed[:, -2]
        else:
            before = self._owner_now.get(layer, mx.full(now.shape, -1, mx.int32))
        self._owner_before[layer] = before
        self._owner_now[layer] = now
        self._owner_x[layer] = x.reshape(rows, -1, x.shape[-1])[:, -1]

    def consumed(self, block, x: mx.array, indices: mx.array, routed: np.ndarray | None) -> None:
        """A consumer layer routed by its prediction: `indices` on the device, `routed` the same
        on the host (None when it was not read: a held layer, whose every expert is resident, so
        none can be dropped)."""
        self.counters.predicted += 1
        if routed is not None:
            staged = self._staged(block.layer) or frozenset()
            self.counters.dropped += len(set(routed.reshape(-1).tolist()) - staged)
        if self.shadow_router:  # a diagnostic: it costs a host read a layer
            logits = block.gate_logits(x)
            true, _ = route(logits, block.routing_spec, self.k, block.expert_bias())
            true_host, predicted_host = self.host_reads.read(
                [true, indices], "the shadow router (a diagnostic)"
            )
            true_set = set(true_host.reshape(-1).tolist())
            self.counters.shadow_hits += len(true_set & set(predicted_host.reshape(-1).tolist()))
            self.counters.shadow_total += len(true_set)

    # -- the heads, once per step -------------------------------------------------------------------

    def flush(self) -> Predictions | None:
        """Build every head into the step's graph; the next step's consumers route by what they
        predict. Returns the predictions (on the device) for the engine to read with the step's
        token and `settle`; None when no head can run (an owner has not executed)."""
        heads = self.heads
        if heads is None or any(o not in self._owner_x for o in heads.owners):
            self._predictions = None
            return None
        with self.tracer.span("head flush", "prerouter"):
            indices, weights = self._head_graph()
        self._predictions = Predictions(list(heads.consumers), indices, weights)
        return self._predictions

    def settle(self, predictions: Predictions, host: np.ndarray) -> dict[int, list[int]]:
        """The predictions' experts, read: kept for the consumers (and their `dropped` check).
        Returns consumer -> experts, the reads the next step needs."""
        predictions.host = host
        return {
            layer: list(dict.fromkeys(host[i].reshape(-1).tolist()))  # the rows' union
            for i, layer in enumerate(predictions.consumers)
        }

    def _staged(self, layer: int) -> frozenset[int] | None:
        """The experts the heads predicted for `layer` this step, as read (None: no prediction,
        or not read yet)."""
        predictions = self._predictions
        row = predictions.row(layer) if predictions is not None else None
        if row is None or predictions.host is None:
            return None
        return frozenset(predictions.host[row].reshape(-1).tolist())

    def _head_graph(self) -> tuple[mx.array, mx.array]:
        """The (lazy) routing every head predicts for its consumer: indices and weights
        `[owners, rows, K]`, the stacked heads run at once over every sequence's row."""
        heads = self.heads
        owners = heads.owners
        x = mx.stack([self._owner_x[o] for o in owners]).astype(heads.fc1.dtype)
        now = mx.stack([self._owner_now[o] for o in owners])
        before = mx.stack([self._owner_before[o] for o in owners])
        logits = heads(head_features(x, now, before, self.experts), 0, len(owners))
        consumers = [self.blocks[layer] for layer in heads.consumers]
        biases = [c.expert_bias() for c in consumers]
        bias = mx.stack(biases)[:, None] if all(b is not None for b in biases) else None
        if self.float_dtype is not None:
            logits = logits.astype(self.float_dtype)
        return route(logits, consumers[0].routing_spec, self.k, bias)

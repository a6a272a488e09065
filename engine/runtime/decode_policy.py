"""How one (mode, K) profile decodes: decided once, when the profile is applied.

Every choice a mode makes about a decode step is here, in one immutable value, instead of as
flags set on the routing state, the expert store, the pool and the lookahead one by one:
`decode_policy` decides them from the mode, K, the profile's heads and what the expert cache
holds; `apply` hands each one to the object that acts on it. A K or mode switch makes a new
policy; nothing else changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..experts.store import ExpertStore
from ..routing.lookahead import Lookahead
from ..routing.prerouter import PrerouterHeads
from ..routing.state import RoutingState


@dataclass(frozen=True)
class DecodePolicy:
    mode: str
    k: int
    # The profile's heads: the routing of their consumer layers in prerouter mode; in prefetch
    # mode only reads ahead, where the experts are big enough for one to pay.
    heads: PrerouterHeads | None
    route_by_predictions: bool  # prerouter: each consumer layer routes by its prediction
    predicted: frozenset[int]  # those consumer layers
    # Layers whose every expert stays in the cache: routed on the device, never read back.
    held: frozenset[int]
    kept: frozenset[int]  # layers evicted last: their misses block the forward (prerouter)
    lookahead_reads: bool  # the lookahead's guesses are read ahead (else only scored)
    gate_head_reads: bool  # prefetch reads a head's predictions only where it beats the lookahead
    reader_core: bool  # reader threads on a core of their own (prerouter, where it reads ahead)

    @property
    def not_guessed(self) -> frozenset[int]:
        """Layers the lookahead does not guess: routed by a prediction, or held whole."""
        return self.predicted | self.held


def decode_policy(
    mode: str,
    k: int,
    heads: PrerouterHeads | None,
    moe_layers: set[int],
    store: ExpertStore,
    reads_pay: bool,
    lookahead: bool,
) -> DecodePolicy:
    """The policy of `mode` at width `k`. `reads_pay`: the experts are big enough for a read
    ahead to pay (prefetch reads nothing ahead otherwise); `lookahead`: the engine has one."""
    route_by_predictions = mode == "prerouter"
    predicted = frozenset(heads.consumers) if heads is not None and route_by_predictions else None
    self_routed = frozenset(moe_layers - predicted) if predicted else frozenset()
    held = frozenset(_layers_to_hold(store, k, moe_layers, self_routed))
    return DecodePolicy(
        mode=mode,
        k=k,
        heads=heads,
        route_by_predictions=route_by_predictions,
        predicted=predicted or frozenset(),
        held=held,
        kept=self_routed,
        lookahead_reads=reads_pay or mode != "prefetch",
        gate_head_reads=mode == "prefetch" and lookahead,
        # Only where something is read: with every layer held, pinning would only split the
        # engine thread from the compute for nothing.
        reader_core=mode == "prerouter" and held != moe_layers,
    )


def _layers_to_hold(store: ExpertStore, k: int, every: set[int], self_routed: frozenset[int]):
    """Every layer when the cache holds every expert (the model fits: a step never waits on the
    host), else the layers that route by their own router in prerouter mode, where the cache
    also keeps a routed set of each other layer (their routing would otherwise be read back
    each step), else none."""
    if store.can_hold(every, k):
        return every
    if self_routed and store.can_hold(set(self_routed), k):
        return self_routed
    return ()


def apply(
    policy: DecodePolicy, routing: RoutingState, store: ExpertStore, lookahead: Lookahead | None
) -> None:
    """Make the routing state, the store (and its pool) and the lookahead decode by `policy`."""
    routing.k = policy.k
    routing.set_heads(policy.heads, route_by_predictions=policy.route_by_predictions)
    store.pool.keep_layers(policy.kept)
    store.hold_layers(set(policy.held))
    store.lookahead_reads = policy.lookahead_reads
    store.ledger.gated = policy.gate_head_reads
    store.ledger.gate.reset()  # what the old heads, K or mode measured says nothing of the new
    store.use_reader_core(policy.reader_core)
    if lookahead is not None:
        lookahead.k = policy.k
        lookahead.skip = policy.not_guessed

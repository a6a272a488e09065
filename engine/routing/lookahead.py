"""Exact lookahead: guess the next MoE layer's routing a layer early, and read its experts ahead.

At decode, when MoE layer N routes, its input residual `h` (before layer N's post-attention norm)
is known. The next MoE layer's own router, applied to `h` normed with *that* layer's post-attention
norm, guesses which experts it will route to: the guess misses only what layer N's experts and
layer N+1's attention add to the residual. The guessed experts that are not resident are read
while layer N computes and layer N+1 runs its attention. Layer N+1 still routes with its true
router, so the output never depends on a guess: a wrong guess costs a read, never a token.

The first MoE layer has no layer before it in the token: its guess is its router over the normed
token embedding, made at step start (its lead is the first attention).

Measured on the bundled demo (teacher-forced text, K=8), recall@K of the guess per consumer layer:
from the embedding for layer 0, 0.87; from layer N's MoE input for layer N+1, 0.38 / 0.74 / 0.84 /
0.82 / 0.77. The residual *after* layer N guesses better (0.73-0.85) but is known only once layer
N's experts have computed, which leaves a guess almost no lead at decode
(docs/notebook/2026-12-exact-lookahead.md).

The guess is taken from the routing the layer itself uses (`routing.functions.route`, with its
correction bias and groups) where the engine routes; for a family whose own block routes, from
the top K of its gate's logits. Nothing here changes what any layer computes.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .functions import route

# A guess: (a layer's input residual, K) -> the consumer's K guessed experts (lazy indices). A
# guess names K experts, no more: reading the next best too read more bytes with no more reads in
# time, and on a paced disk prefetch ran slower with them (docs/notebook/
# 2026-12-memory-lookahead-training.md, "The paced disk, and guesses K wide").
Guesser = Callable[[mx.array, int], mx.array]


class Lookahead:
    """Records each MoE layer's input residual during a one-token forward and turns it into the
    next MoE layer's guessed experts. `active` is set per step by the engine."""

    def __init__(
        self, guessers: dict[int, Guesser], embed: nn.Module | None, k: int, experts: int
    ) -> None:
        self.layers = sorted(guessers)
        self.experts = experts
        self._guessers = guessers
        self._next = dict(zip(self.layers, self.layers[1:]))
        self._embed = embed
        self.k = k
        self.active = False
        self.skip: frozenset[int] = frozenset()  # layers routed by a prediction: not guessed
        self._inputs: dict[int, mx.array] = {}

    def record(self, layer: int, h: mx.array) -> None:
        """Layer `layer`'s MoE input residual, before its norm (called by the norm)."""
        if self.active:
            self._inputs[layer] = h

    def guess_after(self, layer: int) -> Guess | None:
        """The next MoE layer's guess from `layer`'s input; None when inactive, last, or nothing
        was recorded."""
        following = self._next.get(layer)
        h = self._inputs.pop(layer, None)
        if not self.active or following is None or h is None or following in self.skip:
            return None
        return self._guess(following, h)

    def guess_first(self, token: mx.array) -> Guess | None:
        """The first MoE layer's guess from a token's embedding (`token` may still be computing:
        the engine builds the next step's guess into this step's graph and reads it with the
        token). None when that layer is not guessed."""
        if self._embed is None or not self.layers or self.layers[0] in self.skip:
            return None
        return self._guess(self.layers[0], self._embed(token.reshape(1, -1)))

    def _guess(self, layer: int, h: mx.array) -> Guess:
        return Guess(layer, self._guessers[layer](h, min(self.k, self.experts)))

    def end_step(self) -> None:
        self._inputs.clear()


class Guess:
    """A layer's guessed experts: `indices` on the device until the reader of the step's values
    sets `host` (read with something the host waits for anyway), then `likely` (its top K, each
    once)."""

    def __init__(self, layer: int, indices: mx.array) -> None:
        self.layer = layer
        self.indices = indices
        self.host: np.ndarray | None = None

    @property
    def likely(self) -> list[int]:
        return list(dict.fromkeys(self.host.reshape(-1).tolist()))


def attach_lookahead(model: nn.Module, sites, blocks: dict, k: int) -> Lookahead | None:
    """Build the lookahead for a loaded model and hook its norms. `sites` are the MoE layers
    (`checkpoint.families.MoESite`), `blocks` the engine-routed blocks by layer (empty for a
    family whose own block routes). None when a layer has no post-attention norm to record
    from, or its router cannot be applied on its own."""
    guessers: dict[int, Guesser] = {}
    norms = {}
    for site in sites:
        norm = site.decoder_layer.get("post_attention_layernorm")
        if not isinstance(norm, nn.Module):
            return None
        plain_norm = _unhooked(norm)
        block = blocks.get(site.layer)
        router = _engine_router(block) if block is not None else _gate_top_k(site.parent)
        if router is None:
            return None
        guessers[site.layer] = _guesser(plain_norm, router)
        norms[site.layer] = norm
    experts = min(site.switch.gate_proj.weight.shape[0] for site in sites)
    lookahead = Lookahead(guessers, _embedding(model), k, experts)
    for layer, norm in norms.items():
        _hook(norm, layer, lookahead)
    return lookahead


def _guesser(norm: Callable[[mx.array], mx.array], router) -> Guesser:
    def guess(h: mx.array, k: int) -> mx.array:
        return router(norm(h).reshape(-1, h.shape[-1]), k)

    return guess


def _engine_router(block) -> Callable[[mx.array, int], mx.array]:
    """The layer's own routing function: the K experts it would route `x` to, bias and groups
    included."""

    def indices(x: mx.array, k: int) -> mx.array:
        logits, spec, bias = block.gate_logits(x), block.routing_spec, block.expert_bias()
        return route(logits, spec, k, bias)[0]

    return indices


def _gate_top_k(parent: nn.Module) -> Callable[[mx.array, int], mx.array] | None:
    """A family whose own block routes: the top k of its `gate` linear layer's logits (the set
    softmax or sigmoid top-k routes to, without biases or groups), if it has one."""
    gate = parent.get("gate") if isinstance(parent, nn.Module) else None
    if not isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
        return None

    def indices(x: mx.array, k: int) -> mx.array:
        return mx.argpartition(-gate(x), kth=k - 1, axis=-1)[..., :k]

    return indices


def _embedding(model: nn.Module) -> nn.Module | None:
    """The token embedding (`embed_tokens`) the first layer reads, if the model names one."""
    for path, module in model.named_modules():
        if path.split(".")[-1] == "embed_tokens":
            return module
    return None


def _unhooked(norm: nn.Module) -> Callable[[mx.array], mx.array]:
    """`norm` applied without recording (a guess applies the consumer's norm to another input)."""
    forward = type(norm).__call__
    return lambda x: forward(norm, x)


_recording_classes: dict[type, type] = {}


def _hook(norm: nn.Module, layer: int, lookahead: Lookahead) -> None:
    """Make `norm` hand its input to `lookahead` before norming it. The class is swapped for a
    subclass (module paths and parameters stay as they are), as `runtime.numerics` does."""
    cls = type(norm)
    if cls not in _recording_classes:

        def __call__(self, x, *args, **kwargs):
            self._lookahead.record(self._lookahead_layer, x)
            return cls.__call__(self, x, *args, **kwargs)

        _recording_classes[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    norm.__class__ = _recording_classes[cls]
    # Plain attributes set through object: nn.Module would keep them as parameters.
    object.__setattr__(norm, "_lookahead", lookahead)
    object.__setattr__(norm, "_lookahead_layer", layer)

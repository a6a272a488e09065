"""Layer-major passes: many batches through one decoder layer, then the next.

Evaluation and training push many windows of text through the model. Token-major (a forward per
batch) reads every MoE layer's routed experts once per batch: on a model that does not fit in
memory, a held-out text of a few thousand tokens reads the experts dozens of times over. A
layer-major pass runs every batch of the pass through layer 1, then every batch through layer 2,
and so on, while the expert store keeps the layer it is on (`ExpertStore.layer_pass`): each
layer's experts are read about once a pass, and the next layer's read runs while this one
computes.

The family's own forward is never rewritten. Its decoder layers are swapped, in the model's own
list, for taps (`_Tap`), and the forward runs twice per batch around the layer-major loop:
1. **record**: the taps keep the first layer's input (the embedded tokens) and the arguments the
   forward gives each layer (masks, caches) and hand their input on unchanged;
2. the layers themselves, a layer at a time over every batch, each output evaluated;
3. **replay**: the last tap returns the batch's final hidden state, the others their input, so the
   forward's own final norm and output head give the logits (nothing before is computed: the
   logits do not depend on it).

A batch's values equal its token-major forward's: the same layers run on the same inputs with
the same arguments; only the order between batches changes. Per-batch state the layers share
(the student's routing plan: predictions from an owner layer to its consumer) is switched with
`enter` and kept with `leave`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from ..experts.store import ExpertStore
    from .memory_plan import MemoryPlan


# A pass keeps every batch's hidden state between layers (float32): at most this many bytes of
# them, so a long text is several passes.
PASS_HIDDEN_BYTES = 256 << 20


def pass_budget(plan: MemoryPlan) -> int:
    """The bytes a pass's hidden states may take within the memory plan: its KV-cache term (a
    pass's forwards keep no KV cache) and what the plan leaves under its limit, at most
    PASS_HIDDEN_BYTES."""
    room = PASS_HIDDEN_BYTES
    if plan.limit_bytes is not None:
        room = max(0, plan.limit_bytes - plan.total_bytes)
    return min(PASS_HIDDEN_BYTES, plan.kv_cache_bytes + room)


def windows_per_pass(window_tokens: int, hidden: int, budget_bytes: int) -> int:
    """How many windows of `window_tokens` one pass holds in `budget_bytes` (at least one)."""
    return max(1, budget_bytes // (window_tokens * hidden * 4))


def decoder_layer_list(model: nn.Module) -> list:
    """The list the model keeps its decoder layers in (`model.layers` may be a fresh slice of it
    each time, as mlx-lm's pipeline models give it), so that an entry set there is called."""
    layers = model.layers
    for _, module in model.named_modules():
        for value in module.values():
            if isinstance(value, list) and value and value[0] is layers[0]:
                return value
    raise RuntimeError("cannot find the model's list of decoder layers")


class _Tap:
    """Stands in a decoder layer's place in the model's list for one pass. Not an `nn.Module`:
    never in the parameter tree."""

    def __init__(self, index: int, layer: nn.Module, run: _Pass) -> None:
        self.index, self.layer, self.run = index, layer, run

    def __getattr__(self, name: str):
        return getattr(self.layer, name)  # what the model's loop asks of a layer (`is_linear`)

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self.run.at_layer(self.index, x, args, kwargs)


class _Pass:
    """One pass's batches: their inputs, each layer's arguments, and their hidden states."""

    def __init__(self, batches: int, layers: int) -> None:
        self.mode = "record"
        self.batch = 0  # the batch the forward now runs
        self.layers = layers
        self.hidden: list[mx.array | None] = [None] * batches
        self.arguments: list[list[tuple[tuple, dict] | None]] = [
            [None] * layers for _ in range(batches)
        ]

    def at_layer(self, index: int, x: mx.array, args: tuple, kwargs: dict) -> mx.array:
        b = self.batch
        if self.mode == "record":
            if index == 0:
                self.hidden[b] = x
            self.arguments[b][index] = (args, kwargs)
            return x
        return self.hidden[b] if index == self.layers - 1 else x


def layer_major(
    model: nn.Module,
    batches: Sequence[mx.array],
    forward: Callable[[mx.array], mx.array],
    score: Callable[[int, mx.array], None] | None,
    store: ExpertStore | None = None,
    enter: Callable[[int], None] | None = None,
    leave: Callable[[int], list[mx.array]] | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> None:
    """`score(b, logits)` with each batch's `forward(batch)` (its logits), computed a decoder
    layer at a time over all `batches` (`score` None: no logits, the layers only). `forward`
    must call `model`'s decoder layers once each, in order. `enter(b)` switches to batch b's
    per-batch state before any of its layers runs; `leave(b)` keeps it and returns what of it to
    evaluate with the layer's output; `after_layer(index)` runs once a layer has run every
    batch."""
    layers = decoder_layer_list(model)
    originals = list(layers)
    run = _Pass(len(batches), len(originals))
    switch = enter or (lambda b: None)
    if store is not None:
        store.begin_step()
    try:
        with store.layer_pass() if store is not None else contextlib.nullcontext():
            with _tapped(layers, originals, run):  # 1. record
                for b, batch in enumerate(batches):
                    run.batch = b
                    switch(b)
                    forward(batch)  # lazy: only what the taps kept is ever computed
                    if any(a is None for a in run.arguments[b]):
                        raise RuntimeError("the model did not call every decoder layer")
            for index, layer in enumerate(originals):  # 2. the layers, each over every batch
                for b in range(len(batches)):
                    switch(b)
                    args, kwargs = run.arguments[b][index]
                    run.hidden[b] = layer(run.hidden[b], *args, **kwargs)
                    mx.eval(run.hidden[b], *(leave(b) if leave is not None else ()))
                if store is not None:
                    store.layer_computed(index)
                if after_layer is not None:
                    after_layer(index)
            if score is None:
                return
            run.mode = "replay"
            with _tapped(layers, originals, run):  # 3. the logits, a batch's at a time
                for b, batch in enumerate(batches):
                    run.batch = b
                    switch(b)
                    logits = forward(batch)
                    mx.eval(logits)
                    run.hidden[b] = None
                    score(b, logits)
    finally:
        if store is not None:
            store.end_step()


@contextlib.contextmanager
def _tapped(layers: list, originals: list, run: _Pass):
    layers[:] = [_Tap(i, layer, run) for i, layer in enumerate(originals)]
    try:
        yield
    finally:
        layers[:] = originals

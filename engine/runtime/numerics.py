"""The numerical guard: a non-finite hidden state is repaired per layer, and counted.

A NaN or an overflow in one layer's output would otherwise spread through every later layer and
turn the logits into NaN (the reference implementation saw fp16 runs collapse into repeating token
0). After every decoder layer the guard replaces NaN with 0 and clips to +-`limit` (by default the
largest finite value of the dtype, which leaves every finite value untouched). The number of
repaired values is kept as a lazy array and read once per step, with the token.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class HiddenGuard:
    def __init__(self, limit: float | None = None) -> None:
        self.limit = limit
        self._counts: list[mx.array] = []

    def __call__(self, h: mx.array) -> mx.array:
        limit = self.limit if self.limit is not None else mx.finfo(h.dtype).max
        bad = mx.isnan(h) | (mx.abs(h) > limit)
        self._counts.append(bad.sum())
        return mx.where(mx.isnan(h), mx.array(0, h.dtype), mx.clip(h, -limit, limit))

    def take(self) -> mx.array | None:
        """Values repaired since the last call, on the device (None: no layer ran): the engine
        reads it with the step's token, in the same wait."""
        counts, self._counts = self._counts, []
        return mx.stack(counts).sum() if counts else None


def guard_layers(layers: list[nn.Module], guard: HiddenGuard) -> None:
    """Make every decoder layer pass its output through `guard`.

    Each layer's class is swapped for a subclass whose `__call__` wraps the original: module paths,
    parameters and the model's own forward loop stay exactly as they are.
    """
    subclasses: dict[type, type] = {}
    for layer in layers:
        cls = type(layer)
        if cls not in subclasses:
            subclasses[cls] = _guarded_subclass(cls, guard)
        layer.__class__ = subclasses[cls]


def _guarded_subclass(cls: type, guard: HiddenGuard) -> type:
    """`cls` whose output passes through `guard` (held by the subclass, not by each layer)."""

    def __call__(self, *args, **kwargs):
        return guard(cls.__call__(self, *args, **kwargs))

    return type(f"Guarded{cls.__name__}", (cls,), {"__call__": __call__})

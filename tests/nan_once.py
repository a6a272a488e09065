"""A fault for the numerical guard's tests: a module whose output turns NaN once."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class NaNOnce(nn.Module):
    """Wraps an attention module; on the chosen call its output becomes NaN."""

    def __init__(self, inner: nn.Module, poison_call: int) -> None:
        super().__init__()
        self.inner = inner
        self._calls = 0
        self._poison_call = poison_call

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self._calls += 1
        if self._calls == self._poison_call:
            out = out * mx.array(float("nan"))
        return out

"""The expert heat picture: for every MoE layer, what each routed expert did in the latest step.

The store tells `ExpertHeat` what happens as it happens (a hit, a read ahead issued, a read the
forward waited for and whether its bytes came from disk), at the cost of a dict entry per routed
expert. A `HeatPicture` is built only when asked (the app asks a few times a second, never per
step): three uint8/bool arrays of layers x experts, 144 KB for 94 layers of 512 experts.

"How often used lately" is a count that decays by half every `HALF_LIFE_STEPS` one-token forwards
(decode steps and a prompt's last token). A prefill chunk routes its tokens to most experts of
every layer, so counting it would show every expert hot after any long prompt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from itertools import chain
from typing import ClassVar

import numpy as np

from .eviction import ExpertKey

HALF_LIFE_STEPS = 16


class ExpertEvent(IntEnum):
    """What an expert did in a step. A larger value wins where a view shows several experts in
    one cell: a read the forward waited for is the news."""

    NONE = 0  # neither routed nor read ahead
    AHEAD_UNUSED = 1  # read ahead for this step; the layer did not route to it
    HIT = 2  # routed, already in the expert cache
    AHEAD_USED = 3  # routed, read ahead (by the heads' prediction or the lookahead's guess)
    READ_WARM = 4  # routed, read when the layer needed it, from the OS page cache
    READ_COLD = 5  # routed, read when the layer needed it, from disk (cold bytes)


# eq=False: pictures compare by identity (a new one is a new step), never array by array.
@dataclass(frozen=True, eq=False)
class HeatPicture:
    """One step's picture, rows by MoE layer. Arrays are `[len(layers), max(experts)]`; a row's
    cells from its layer's expert count on are padding (NONE, not pooled, 0)."""

    layers: tuple[int, ...]  # the MoE layers' numbers in the model, in order
    experts: tuple[int, ...]  # routed experts per layer
    events: np.ndarray  # uint8 ExpertEvent of the step
    pooled: np.ndarray  # bool: in the expert cache when the picture was taken
    use: np.ndarray  # uint8: share of recent one-token steps that routed it, 255 = every one
    step: int  # the expert pool's step count at that step
    counted_steps: int  # one-token steps counted into `use` since the engine loaded
    blocked_ms: float  # the step's time waiting for expert bytes
    half_life_steps: ClassVar[int] = HALF_LIFE_STEPS  # of the decay behind `use`

    def counts(self) -> np.ndarray:
        """`[layers, len(ExpertEvent)]`: how many experts of each layer had each event."""
        return np.stack([(self.events == e).sum(axis=1) for e in ExpertEvent], axis=1)

    def routed(self, row: int) -> set[int]:
        """The experts layer row `row` routed to in the step."""
        return set(np.flatnonzero(self.events[row] >= ExpertEvent.HIT).tolist())

    def in_pool(self, row: int) -> set[int]:
        return set(np.flatnonzero(self.pooled[row]).tolist())


class ExpertHeat:
    """The running record behind `HeatPicture`, fed by the store on the engine's thread."""

    def __init__(self, experts_per_layer: dict[int, int]) -> None:
        self.layers = tuple(sorted(experts_per_layer))
        self.experts = tuple(experts_per_layer[layer] for layer in self.layers)
        self._row = {layer: row for row, layer in enumerate(self.layers)}
        shape = (len(self.layers), max(self.experts, default=0))
        self._decay = np.float32(0.5 ** (1 / HALF_LIFE_STEPS))
        self._uses = np.zeros(shape, np.float32)  # decayed count of steps that routed each
        self.step = 0
        self.counted_steps = 0
        self._events: dict[ExpertKey, ExpertEvent] = {}  # this step's
        self._ahead: dict[int, set[ExpertKey]] = {}  # reads ahead issued, by the step they serve
        # (row, experts) routed by this one-token step's layers
        self._routed: list[tuple[int, list[int]]] = []

    def begin_step(self, step: int) -> None:
        """Step `step` starts: the last step's events go; reads ahead issued for it are its."""
        self.step = step
        self._events = dict.fromkeys(self._ahead.pop(step, ()), ExpertEvent.AHEAD_UNUSED)
        self._ahead = {s: keys for s, keys in self._ahead.items() if s > step}
        self._routed = []

    def end_step(self) -> None:
        """Count a one-token step's routing into the decaying use counts (once: the store may
        end a step twice)."""
        if not self._routed:
            return
        self._uses *= self._decay
        sizes = [len(experts) for _, experts in self._routed]
        rows = np.repeat([row for row, _ in self._routed], sizes)
        experts = np.fromiter(chain.from_iterable(e for _, e in self._routed), np.intp, sum(sizes))
        self._uses[rows, experts] += 1.0  # (a layer routes each expert once)
        self.counted_steps += 1
        self._routed = []

    def read_ahead(self, key: ExpertKey, step: int) -> None:
        """A read of `key` was issued ahead for step `step` (this one or a later one)."""
        if step <= self.step:
            self._events.setdefault(key, ExpertEvent.AHEAD_UNUSED)
        else:
            self._ahead.setdefault(step, set()).add(key)

    def forget_reads_ahead(self) -> None:
        """Reads ahead for later steps were dropped (a new request, a pool started again)."""
        self._ahead.clear()

    def used(self, key: ExpertKey, event: ExpertEvent) -> None:
        """A layer of this step computes with `key`, which came as `event` says."""
        self._events[key] = event

    def routed(self, layer: int, experts: Iterable[int]) -> None:
        """A one-token forward's `layer` routed to `experts` (counted at the step's end)."""
        self._routed.append((self._row[layer], list(experts)))

    def picture(self, pooled: np.ndarray, blocked_ms: float = 0.0) -> HeatPicture:
        """The latest step's picture, with `pooled` the experts in the cache now (a bool mask
        of the picture's shape, which the caller gives up: `ExpertPool.resident_mask`)."""
        shape = self._uses.shape
        if pooled.shape != shape:
            raise ValueError(f"a pool mask of {pooled.shape} for a picture of {shape}")
        events = np.zeros(shape, np.uint8)
        if self._events:
            keys = list(self._events)
            rows = [self._row[layer] for layer, _ in keys]
            events[rows, [e for _, e in keys]] = list(self._events.values())
        in_pool = pooled
        # Over the weights of the steps counted so far (1 / (1 - decay) once there are many):
        # an expert routed by every one of them has a share of 1 from the first step on.
        weights = (1 - self._decay**self.counted_steps) / (1 - self._decay)
        share = self._uses / weights if self.counted_steps else self._uses
        use = np.clip(np.rint(share * 255), 0, 255).astype(np.uint8)
        for array in (events, in_pool, use):  # read on another thread: never changed after
            array.flags.writeable = False
        return HeatPicture(
            self.layers,
            self.experts,
            events,
            in_pool,
            use,
            self.step,
            self.counted_steps,
            blocked_ms,
        )

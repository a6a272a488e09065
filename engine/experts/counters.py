"""What the expert store counts: a step's reads, hits, reads ahead and waits, and by layer where
each routed expert came from (the step's metrics and the bench's tables are built from these)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class LayerRouted:
    """Where one layer's routed experts came from in a step (or summed over steps), and how well
    the lookahead guessed them."""

    resident: int = 0  # already in the expert cache
    heads: int = 0  # read ahead by the prerouter heads' prediction
    lookahead: int = 0  # read ahead by the lookahead's guess
    missed: int = 0  # read when the layer needed them (the forward waited)
    guessed_right: int = 0  # routed experts the lookahead had guessed
    guessed_of: int = 0  # routed experts of steps in which the lookahead guessed this layer

    def add(self, other: LayerRouted) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def sum_layer_routed(tables: Iterable[dict]) -> dict[int, LayerRouted]:
    """Per-layer tables of `LayerRouted` fields (a step's `routed_by_layer`, a summary's; other
    keys, such as a recall, ignored; layers as ints or, after JSON, text), summed by layer."""
    totals: dict[int, LayerRouted] = {}
    for table in tables:
        for layer, row in table.items():
            counts = {k: v for k, v in row.items() if k in LayerRouted.__dataclass_fields__}
            totals.setdefault(int(layer), LayerRouted()).add(LayerRouted(**counts))
    return dict(sorted(totals.items()))


@dataclass
class LoadCounters:
    """What the expert store did during one step."""

    loads: int = 0  # experts read from the checkpoint
    hits: int = 0  # routed experts found resident
    bytes_read: int = 0
    cold_bytes: int = 0  # of bytes_read, those not in the page cache before the read
    read_ms: float = 0.0  # sum of per-read wall times (reads overlap on the reader threads)
    blocked_ms: float = 0.0  # time the forward waited for expert bytes
    whole_layer_reads: int = 0
    whole_layer_bytes: int = 0  # bytes read as whole layers (prefill), outside the cache budget
    transient_peak_bytes: int = 0  # most whole-layer buffer bytes held at once
    prefetch_issued: int = 0  # expert reads issued ahead for this step (prerouter)
    prefetch_in_time: int = 0  # of those, already read when the layer needed them
    prefetch_late: int = 0  # of those, still being read when the layer needed them (blocked)
    prefetch_given_up: int = 0  # reads ahead dropped to make room for a layer's misses
    page_cache_evicted_bytes: int = 0  # expert bytes dropped from the page cache (its budget)
    lookahead_issued: int = 0  # expert reads issued ahead by the lookahead's guesses
    lookahead_in_time: int = 0  # of those, already read when the layer needed them
    lookahead_late: int = 0  # of those, still being read when the layer needed them (blocked)
    lookahead_dropped: int = 0  # reads ahead the layer did not route to, dropped when it routed
    heads_not_read: int = 0  # predicted experts not read ahead: the heads name them less
    # precisely than the lookahead (prefetch mode, the gate in `ledger.py`)
    layers: dict[int, LayerRouted] = field(default_factory=dict)  # by layer, decode and prefill

"""A page-cache budget for the checkpoint's routed experts: a memory wall on any machine.

A small checkpoint fits in the OS page cache whole: after the first prompt's prefill every expert
read is a page-cache hit, and the cold-page panel shows nothing cold although the experts are
"on SSD".
With a budget, edge0 keeps at most that many of the checkpoint's expert bytes in the page cache:

- Linux: the engine remembers which experts it read, in order, and drops the pages of the least
  recently read ones beyond the budget with `posix_fadvise(POSIX_FADV_DONTNEED)`. At start it drops
  the shards' pages, so the wall starts cold. Only expert tensors are dropped; attention, norms and
  embeddings are resident in MLX memory anyway.
- macOS has no per-range eviction: reads open the shards with `F_NOCACHE` instead (see
  `ExpertReader`), so every expert read comes from the SSD, whatever the budget.

The engine's own count can only over-estimate what is cached (the kernel may drop pages earlier on
its own); the panels measure the real figure with mincore.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from ..checkpoint.index import CheckpointIndex
from .page_cache import PAGE_SIZE

# posix_fadvise exists on Linux (and some BSDs); macOS has none.
CAN_EVICT_RANGES = hasattr(os, "posix_fadvise")

ExpertKey = tuple[int, int]  # (layer, expert)


class PageCacheBudget:
    """Keeps at most `budget_bytes` of expert bytes in the page cache, least recently read out."""

    def __init__(self, index: CheckpointIndex, budget_bytes: int) -> None:
        self.index = index
        self.budget_bytes = budget_bytes
        self._fds: dict[Path, int] = {}
        self._recent: OrderedDict[ExpertKey, int] = OrderedDict()  # oldest first -> bytes
        self._held = 0
        if CAN_EVICT_RANGES:
            self._fds = {shard: os.open(shard, os.O_RDONLY) for shard in index.shards}

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.enforce()

    def evict_all(self) -> None:
        """Drop every page of the shards (the wall starts cold); nothing counts as held after it.

        Whole files, not the expert ranges: a file just written (a download, a copy) sits in the
        page cache in large folios, and the kernel drops only folios wholly inside a range, so
        range by range most of it stayed (measured on a copied tiny model's experts). The resident weights are in MLX memory by now, their pages are not needed.
        Pages that reads bring back later are small and leave range by range."""
        for fd in self._fds.values():
            os.fsync(fd)  # dirty pages (a checkpoint just written or downloaded) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._recent.clear()
        self._held = 0

    def note_read(self, layer: int, expert: int | None) -> None:
        """An expert (or, with `expert` None, the whole layer) was just read: its pages are the
        most recently used."""
        layer_experts = self.index.layers[layer]
        experts = range(layer_experts.num_experts) if expert is None else (expert,)
        for e in experts:
            key = (layer, e)
            if key in self._recent:
                self._recent.move_to_end(key)
            else:
                nbytes = sum(_page_span(off, n)[1] for _, off, n in self._ranges(layer, e))
                self._recent[key] = nbytes
                self._held += nbytes

    def enforce(self) -> int:
        """Drop the least recently read experts' pages until the rest fits; returns bytes dropped."""
        dropped = 0
        while self._held > self.budget_bytes and self._recent:
            (layer, expert), nbytes = self._recent.popitem(last=False)
            self._held -= nbytes
            for file, offset, length in self._ranges(layer, expert):
                self._drop(file, offset, length)
            dropped += nbytes
        return dropped

    def _ranges(self, layer: int, expert: int) -> list[tuple[Path, int, int]]:
        return [
            (t.entry.file, t.entry.offset + expert * t.expert_nbytes, t.expert_nbytes)
            for t in self.index.layers[layer].tensors
        ]

    def _drop(self, file: Path, offset: int, length: int) -> None:
        if CAN_EVICT_RANGES:
            os.posix_fadvise(self._fds[file], *_page_span(offset, length), os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _page_span(offset: int, length: int) -> tuple[int, int]:
    """(start, length) of the whole pages a byte range touches. The page cache holds pages: an
    expert's small scale and bias tensors each keep a whole page in it, so that is what the
    budget counts, and what eviction drops (the kernel keeps a page only partly inside a range).
    A neighbour sharing an edge page reads that page cold next time, as it would on a real wall."""
    start = offset // PAGE_SIZE * PAGE_SIZE
    end = -(-(offset + length) // PAGE_SIZE) * PAGE_SIZE
    return start, end - start

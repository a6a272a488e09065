"""A rank's share of the routed experts: expert parallelism over MLX's distributed layer.

Several processes (two Macs, or two processes on one machine) each run the whole model but own
only a share of every MoE layer's routed experts: expert `e` belongs to rank `e % size`. Each rank
reads, caches and computes only its own; attention, norms, routers, shared experts, the heads and
any LoRA are the same on every rank, so every rank routes identically and no routing is sent.

In a layer, the store reads and the layer computes this rank's experts only: another rank's
rows of the routing point at slot 0, and their outputs are zeroed (`combined`). One `all_sum`
per MoE layer then gives every rank every routed expert's output:
each value is one rank's plus zeros, so the sum is exact, and the family's weighted sum that
follows runs on the same values, in the same order, as in one process. The ranks' tokens are the
one process's, bit for bit. The sum carries the layer's per-expert outputs, K times the bytes of
the combined output, so that it stays exact.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import Edge0Error
from ..host_reads import HostReads


@dataclass(frozen=True)
class ExpertShare:
    rank: int
    size: int
    group: object = field(default=None, compare=False, repr=False)  # mx.distributed.Group
    # The engine's one counted place for host reads: the ranks' messages are read through it.
    host_reads: HostReads = field(default_factory=HostReads, compare=False, repr=False)

    @classmethod
    def joined(cls, host_reads: HostReads) -> ExpertShare:
        """This process's share in the distributed group it was launched in (`mlx.launch`, or
        the MLX_RANK / MLX_HOSTFILE environment of the ring backend)."""
        try:
            group = mx.distributed.init(strict=True)
        except Exception as e:  # MLX raises RuntimeError or ValueError, by backend
            raise Edge0Error(
                f"cannot join the distributed group ({e}); start the ranks with --hosts"
            ) from None
        return cls(group.rank(), group.size(), group, host_reads)

    def own(self, experts: Iterable[int]) -> list[int]:
        """The experts of `experts` this rank owns, in their order."""
        return [e for e in experts if e % self.size == self.rank]

    def combined(self, y: mx.array, indices: mx.array) -> mx.array:
        """Every routed expert's output `y` ([..., K, H]) on every rank: this rank's own, the
        others' zeroed, summed over the ranks."""
        mine = (indices % self.size == self.rank)[..., None]
        return mx.distributed.all_sum(mx.where(mine, y, mx.zeros_like(y)), group=self.group)

    def time_sum(self, shape: tuple[int, ...], dtype: mx.Dtype | None, repeats: int) -> float:
        """The median ms of one sum of `shape` over the ranks, each evaluated on its own (every
        rank must run this at once)."""
        y = mx.ones(shape, dtype=dtype or mx.bfloat16)  # (None: the checkpoint's, bf16 here)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.host_reads.wait(mx.distributed.all_sum(y, group=self.group), "a timed sum")
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    def by_rank(self, figures: dict[str, float]) -> list[dict[str, float]]:
        """`figures` of every rank, by rank: one exchange (at the end of a reply, never per step)."""
        names = sorted(figures)
        mine = mx.array([[figures[name] for name in names]], dtype=mx.float32)
        gathered = mx.distributed.all_gather(mine, group=self.group)
        every = self.host_reads.read([gathered], "the ranks' figures of a reply")[0].tolist()
        return [{"rank": r, **dict(zip(names, row))} for r, row in enumerate(every)]

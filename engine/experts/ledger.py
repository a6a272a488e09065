"""The ledger of reads ahead: what each source expected of each (step, layer), and how it scored.

Two sources name experts before a layer routes: the prerouter heads (a step ahead) and the exact
lookahead (a layer ahead, or the first layer from the token). The store records each expectation
here as it pins and reads for it (`expect`, `count_issued`), and when the layer routes, the
ledger scores every source that expected it (`routed`) and forgets the entry. Keyed by the pool's
step, so an expectation for the next step and one for this step never mix, and nothing is
rotated between steps.

The gate: which layers' head predictions prefetch reads ahead, beside the lookahead's guesses.

In prefetch mode every layer routes by its own router, so a head's prediction is only a read
ahead: the experts it names that the layer then does not route to are bytes the disk read for
nothing, on the bandwidth the misses and the lookahead's reads need. The lookahead guesses the
same layer a layer early and is read ahead anyway. A head is worth its reads where it names
experts at least as precisely as the lookahead does for that layer: then its reads waste no
more than the lookahead's and start a token earlier. Where it is less precise, its wrong reads
cost more than its token of lead buys: on two walls at K=8, heads less precise than the
lookahead made prefetch read more bytes and run slower than without heads (their reads also held
the cache room the first layer's guesses needed); with this gate it ran as fast as without heads
(docs/notebook/2026-12-memory-lookahead-training.md, "Heads and the lookahead together").

So each layer's hit rates are counted as the step routes: the heads' (share of their predicted
experts the layer routed to) and the lookahead's (share of its guess). A layer's predictions are
read ahead until both have been scored over `MIN_SCORED` predicted experts, and from then on only
while the heads' rate is at least the lookahead's. Predicted experts already in the cache are
still kept for the step either way (that costs no read).
"""

from __future__ import annotations

from dataclasses import dataclass

# Predicted experts each source must have had scored on a layer before its heads can be turned
# off there: 2 decode steps at K=8, 4 at K=4. Short, because until then a poor head's reads cost
# bytes at every step (a longer wait spent a good part of a short reply reading poor heads); a
# decision made on too few is re-made every step as the counts grow.
MIN_SCORED = 16


@dataclass
class HitCount:
    right: int = 0  # predicted experts the layer routed to
    named: int = 0  # predicted experts

    def add(self, predicted: set[int], routed: set[int]) -> None:
        self.right += len(predicted & routed)
        self.named += len(predicted)

    @property
    def rate(self) -> float:
        return self.right / self.named if self.named else 0.0


class HeadReadGate:
    """Counts each layer's head and lookahead hits; says where the heads' predictions are read."""

    def __init__(self) -> None:
        self.heads: dict[int, HitCount] = {}
        self.lookahead: dict[int, HitCount] = {}

    def reset(self) -> None:
        """New heads, K or mode: what the old ones measured says nothing of the new."""
        self.heads.clear()
        self.lookahead.clear()

    def score(
        self, layer: int, heads: set[int] | None, guess: set[int] | None, routed: set[int]
    ) -> None:
        """`layer` routed to `routed`; `heads` and `guess` are what each predicted (None: nothing)."""
        if heads is not None:
            self.heads.setdefault(layer, HitCount()).add(heads, routed)
        if guess is not None:
            self.lookahead.setdefault(layer, HitCount()).add(guess, routed)

    def reads(self, layer: int) -> bool:
        """Whether the heads' prediction for `layer` is read ahead."""
        heads, guess = self.heads.get(layer), self.lookahead.get(layer)
        if heads is None or guess is None or min(heads.named, guess.named) < MIN_SCORED:
            return True
        return heads.rate >= guess.rate


# What a source expected of a layer at a step: "heads" (the prerouter's prediction) or
# "lookahead" (the exact lookahead's guess) -> the experts it named.
Expected = dict[str, set[int]]


class ReadsAheadLedger:
    """Every source's expected experts by (step, layer), the reads each issued by step, and the
    head-read gate that their scores feed."""

    def __init__(self) -> None:
        self._expected: dict[tuple[int, int], Expected] = {}
        self._issued: dict[tuple[int, str], int] = {}
        self.gate = HeadReadGate()
        self.gated = False  # prefetch with the lookahead reading: heads read where they score

    def expect(self, step: int, layer: int, source: str, experts: list[int]) -> None:
        """`source` expects `layer` to route to `experts` at `step`."""
        self._expected.setdefault((step, layer), {})[source] = set(experts)

    def count_issued(self, step: int, source: str, reads: int) -> None:
        key = (step, source)
        self._issued[key] = self._issued.get(key, 0) + reads

    def issued(self, step: int, source: str) -> int:
        """Reads `source` issued ahead for `step`."""
        return self._issued.get((step, source), 0)

    def heads_read(self, layer: int) -> bool:
        """Whether the heads' prediction for `layer` is read ahead (the gate, where it is on)."""
        return not self.gated or self.gate.reads(layer)

    def routed(self, step: int, layer: int, experts: list[int]) -> set[int] | None:
        """`layer` routed to `experts` at `step`: every source that expected it is scored and the
        entry forgotten. Returns the lookahead's guess (None: it guessed nothing)."""
        expected = self._expected.pop((step, layer), {})
        guess = expected.get("lookahead")
        self.gate.score(layer, expected.get("heads"), guess, set(experts))
        return guess

    def begin(self, step: int) -> None:
        """`step` starts: what was expected of earlier steps is forgotten (layers that never
        routed by their own router)."""
        self._keep(lambda s: s >= step)

    def forget_after(self, step: int) -> None:
        """Expectations and reads of steps after `step` are void (a new request)."""
        self._keep(lambda s: s <= step)

    def _keep(self, wanted) -> None:
        """Keep the expectations and read counts of the steps `wanted(step)` says."""
        self._expected = {key: e for key, e in self._expected.items() if wanted(key[0])}
        self._issued = {key: n for key, n in self._issued.items() if wanted(key[0])}

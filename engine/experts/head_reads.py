"""Which layers' head predictions prefetch reads ahead, beside the lookahead's guesses.

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

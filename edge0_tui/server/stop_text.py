"""Stop sequences over a reply that grows token by token, in work linear in the reply.

The engine thread hands `StopText.update` the whole reply decoded so far after every token. A
naive filter searches that whole text for every stop sequence and tries every prefix length of
every sequence at its end: work per token that grows with the reply times the sequences' length
(a 1 M-character stop took seconds a token). Here each stop sequence is a Knuth-Morris-Pratt
matcher fed each character once: its state is the longest end of the reply that is a beginning
of the sequence, which is exactly what must be held back, and reaching the sequence's length is
a match. The work is proportional to the characters fed (amortized: at most two steps each).

The text before a trailing U+FFFD (a character whose last bytes have not been decoded yet) is
taken as settled: later tokens only add to it. The undecoded tail is fed once the reply ends.
"""

from __future__ import annotations


class _Matcher:
    """One stop sequence's Knuth-Morris-Pratt automaton over the characters fed so far."""

    def __init__(self, sequence: str) -> None:
        self.sequence = sequence
        self.fallback = _fallback(sequence)
        self.state = 0  # the longest end of the text fed that begins `sequence` (never all of it)
        self.found: int | None = None  # where its first occurrence starts
        self.steps = 0  # automaton steps taken: the work, which the tests bound

    def feed(self, char: str, at: int) -> None:
        sequence, state = self.sequence, self.state
        while state and sequence[state] != char:
            state = self.fallback[state - 1]
            self.steps += 1
        self.steps += 1
        if sequence[state] == char:
            state += 1
        if state == len(sequence):
            if self.found is None:
                self.found = at - state + 1
            state = self.fallback[state - 1]
        self.state = state


def _fallback(sequence: str) -> list[int]:
    """KMP's failure table: for each prefix, the length of its longest proper border."""
    table = [0] * len(sequence)
    border = 0
    for i in range(1, len(sequence)):
        while border and sequence[i] != sequence[border]:
            border = table[border - 1]
        if sequence[i] == sequence[border]:
            border += 1
        table[i] = border
    return table


class StopText:
    """The reply's text as it may be sent: cut at the first stop sequence, and holding back what
    could still become one (or a character whose last bytes have not been decoded yet)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.matchers = [_Matcher(s) for s in stop]
        self.fed = 0  # characters of the reply given to the matchers
        self.cut: int | None = None  # where the reply ends: the earliest stop sequence's start
        self.sent = 0  # characters already handed out

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    @property
    def steps(self) -> int:
        """The matchers' work so far (automaton steps)."""
        return sum(m.steps for m in self.matchers)

    def _feed(self, text: str, end: int) -> None:
        """Feed text[fed:end]; once a sequence matches, `cut` is the earliest start of any that
        matched in what was fed (one update may complete several)."""
        if not self.matchers:
            self.fed = max(self.fed, end)
            return
        for at in range(self.fed, end):
            char = text[at]
            for matcher in self.matchers:
                matcher.feed(char, at)
        self.fed = max(self.fed, end)
        starts = [m.found for m in self.matchers if m.found is not None]
        if starts:
            self.cut = min(starts)

    def _held(self) -> int:
        return max((m.state for m in self.matchers), default=0)

    def update(self, text: str) -> str:
        """The new text that may be sent, given the whole reply decoded so far."""
        if self.cut is None:
            settled = len(text.rstrip("\ufffd"))
            self._feed(text, settled)
            end = self.cut if self.cut is not None else settled - self._held()
        else:
            end = self.cut
        new = text[self.sent : end]
        self.sent = max(self.sent, end)
        return new

    def finish(self, text: str) -> str:
        """The rest of the reply once generation has ended."""
        if self.cut is None:
            self._feed(text, len(text))
        end = self.cut if self.cut is not None else len(text)
        new = text[self.sent : end]
        self.sent = max(self.sent, end)
        return new

"""Speculative decoding: drafted tokens verified in one forward over several positions.

A drafter guesses the tokens that follow the reply so far; the model runs [last token, drafts]
as one forward (the expert store reads the union of the positions' missing experts once), and
the verifier keeps the longest prefix of drafts the model agrees with, plus one token of its
own: every verify step gives at least one token, and up to all drafts and one more.

- Greedy: a draft is kept where it is the position's argmax, so the tokens are exactly the
  plain run's (as long as a forward over several positions computes each position as a forward
  of one does: tests/test_speculative.py bounds the difference).
- Sampled: standard speculative sampling (Leviathan et al.; Chen et al.), which keeps the
  sampler's distribution. A drafter here is deterministic (q is a point mass on the draft x), so
  x is kept with probability p(x), and on a reject the token is drawn from p with x removed,
  renormalised. p is the plain sampler's distribution at that position: the same logits
  processors (penalties over the reply so far, drafts before the position included, logit bias)
  and the same filters (top-p, min-p, top-k) and temperature as `sampling.Sampler`.

Drafters: `LookupDrafter` (prompt lookup: the tokens that followed the latest earlier occurrence
of the reply's last few tokens in the prompt and reply), with the draft length adapted to the
measured acceptance (`DraftLength`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from ..config import GenerationConfig
from ..errors import Edge0Error
from .sampling import logits_processors, sampling_filters

DRAFTERS = ("lookup",)


class Drafter(Protocol):
    """Guesses up to `limit` tokens to follow `context` (the prompt and the reply so far)."""

    def propose(self, context: Sequence[int], limit: int) -> list[int]: ...


class LookupDrafter:
    """Prompt lookup (n-gram): find the latest earlier place where the context's last `longest`
    tokens (else fewer, down to `shortest`) occurred, and propose the tokens that followed it.
    Free to run, and right where a reply repeats its context: edits, quotes, agents' tool
    arguments. The longest match wins: a short one recurs in many places, most of them wrong,
    and every drafted position costs the reads of its routed experts. One token alone is no
    match for the same reason."""

    def __init__(self, longest: int = 8, shortest: int = 2) -> None:
        self.longest = longest
        self.shortest = shortest

    def propose(self, context: Sequence[int], limit: int) -> list[int]:
        if limit < 1:
            return []
        context = list(context)
        end = len(context)
        for n in range(min(self.longest, end - 1), self.shortest - 1, -1):
            tail = context[end - n :]
            # The latest occurrence that is not the tail itself.
            for start in range(end - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + limit]
        return []


class DraftLength:
    """How many tokens to draft next, from the acceptance measured so far: doubled after a step
    that kept every draft (up to `maximum`), cut to one more than the drafts kept after a
    reject. Each draft position costs its routed experts' reads, so a drafter that is wrong
    drafts little."""

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.current = min(2, maximum)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.maximum, max(1, self.current * 2))
        else:
            self.current = max(1, accepted + 1)


def make_drafter(name: str) -> Drafter:
    if name == "lookup":
        return LookupDrafter()
    raise Edge0Error(f"draft={name!r} is not a drafter (choose {', '.join(DRAFTERS)})")


def check_draftable(gen: GenerationConfig, mode: str, cache: list) -> None:
    """Raise a one-line Edge0Error where a reply cannot be decoded speculatively."""
    if gen.draft is None:
        return
    if mode == "prerouter":
        raise Edge0Error(
            f"draft={gen.draft} does not run in prerouter mode: its routing of a position is predicted "
            "from the position before, which a forward over several drafted positions does not "
            "have yet (use on-demand or prefetch)"
        )
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(c).__name__ for c in cache if not _trimmable(c)})
        raise Edge0Error(
            f"draft={gen.draft} needs a KV cache that can drop rejected drafts; this model's "
            f"{', '.join(kinds)} cannot (linear attention keeps a recurrent state)"
        )
    if gen.constraint is not None:
        raise Edge0Error(
            f"draft={gen.draft} does not run with a grammar: each token's mask needs the last"
        )
    if gen.logprobs is not None:
        raise Edge0Error(f"draft={gen.draft} does not report logprobs: ask for one or the other")


def _trimmable(cache) -> bool:
    return hasattr(cache, "is_trimmable") and cache.is_trimmable()


def can_verify(cache: list, positions: int) -> bool:
    """Whether a forward of `positions` can be trimmed back afterwards: every cache can trim
    now, and a sliding-window cache will not wrap past its window during the forward."""
    for c in cache:
        if not _trimmable(c):
            return False
        window = getattr(c, "max_size", None)
        if window is not None and c.offset + positions > window:
            return False
    return True


class Verifier:
    """Picks a verify step's tokens on the device from its logits over [last, drafts]: the number
    of drafts kept and the tokens, of which the first kept + 1 are the reply's next ones."""

    def __init__(self, gen: GenerationConfig) -> None:
        self.temperature = gen.temperature
        self.processors = logits_processors(gen)
        self.context = gen.penalty_context
        self.filters = sampling_filters(gen)

    def __call__(
        self, logits: mx.array, seen: Sequence[int], draft: list[int]
    ) -> tuple[mx.array, mx.array]:
        """`logits` [positions, vocab]; `seen` the prompt and the reply so far (its last token
        is the forward's first input); `draft` the rest of the inputs."""
        rows = [self._logprobs(logits[i : i + 1], seen, draft[:i]) for i in range(len(draft) + 1)]
        logprobs = mx.concatenate(rows, axis=0)
        drafted = mx.array(draft, dtype=mx.int32)
        if self.temperature == 0:
            targets = mx.argmax(logprobs, axis=-1).astype(mx.int32)
            return kept_prefix(targets[: len(draft)] == drafted), targets
        for keep in self.filters:
            logprobs = keep(logprobs)
        probs = mx.softmax(logprobs * (1 / self.temperature), axis=-1)
        return speculative_tokens(probs, drafted)

    def _logprobs(self, row: mx.array, seen: Sequence[int], drafted: list[int]) -> mx.array:
        """One position's log-probabilities, as `Sampler` makes them for a one-token forward."""
        if self.processors:
            tokens = mx.array([*seen[-self.context :], *drafted][-self.context :], dtype=mx.int32)
            for process in self.processors:
                row = process(tokens, row)
        return row - mx.logsumexp(row, axis=-1, keepdims=True)


def kept_prefix(accepted: mx.array) -> mx.array:
    """How many leading entries of `accepted` [..., drafts] (booleans) are true."""
    if accepted.shape[-1] == 0:
        return mx.zeros(accepted.shape[:-1], dtype=mx.int32)
    return mx.cumprod(accepted.astype(mx.int32), axis=-1).sum(axis=-1)


def speculative_tokens(probs: mx.array, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Speculative sampling with a point-mass drafter, on the device. `probs` [..., d + 1, vocab]
    the target's distribution at each position, `draft` [..., d] the drafted tokens. Draft i is
    kept with probability p_i(draft_i) while every draft before it was kept; the first position
    not kept draws from p with its draft removed, renormalised (after d kept drafts: from p_d).
    Returns (kept [...], tokens [..., d + 1]): the reply's next tokens are tokens[: kept + 1]."""
    d = draft.shape[-1]
    vocab = probs.shape[-1]
    p_draft = mx.take_along_axis(probs[..., :d, :], draft[..., None], axis=-1)[..., 0]
    kept = kept_prefix(mx.random.uniform(shape=p_draft.shape) < p_draft)
    is_draft = mx.arange(vocab) == draft[..., None]  # [..., d, vocab]
    none = mx.zeros((*is_draft.shape[:-2], 1, vocab), dtype=mx.bool_)
    removed = mx.concatenate([is_draft, none], axis=-2)
    residual = mx.where(removed, 0.0, probs)
    drawn = mx.random.categorical(mx.log(residual), axis=-1).astype(mx.int32)
    padded = mx.concatenate([draft.astype(mx.int32), mx.zeros_like(drawn[..., :1])], axis=-1)
    position = mx.arange(d + 1)
    tokens = mx.where(position < kept[..., None], padded, drawn)
    return kept, tokens


class Speculation:
    """One reply's speculative decoding: its drafter, draft length and verifier."""

    def __init__(self, gen: GenerationConfig) -> None:
        self.drafter = make_drafter(gen.draft)
        self.length = DraftLength(gen.draft_max)
        self.verify = Verifier(gen)

    def draft(self, context: Sequence[int], room: int, cache: list) -> list[int]:
        """The tokens to verify after `context`: at most the current length and `room` (the
        tokens the reply may still give after this step's own), and none where the KV cache
        could not drop the rejected ones afterwards."""
        draft = self.drafter.propose(context, min(self.length.current, room))
        return draft if draft and can_verify(cache, len(draft) + 1) else []

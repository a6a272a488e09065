"""Continuous batching: several replies decode together, one forward a step for all of them.

A reply joins the batch after its own prefill, which runs a chunk at a time between the batch's
decode steps (a long prompt does not stall the replies already decoding). Each decode step is
one forward over every member's last token, as the rows of a [B, 1] input over mlx-lm's batch KV
caches (left-padded, `BatchKVCache.merge`): each MoE layer routes every row, and the expert
store reads the union of the rows' missing experts once. A member keeps its own sampler, stop
and cancel, and leaves as soon as it ends: its rows are filtered out of the caches.

A row is computed as a forward of one sequence would be: tests/test_batch.py checks the greedy
tokens of every member against the same replies run one at a time, in every mode. In prerouter
mode each row routes by its own sequence's predictions (the routing state keeps a row per
member, `RoutingRows`, set aside while another member prefills), so a batched reply has the
tokens it has alone, and the reads ahead are the union of the rows' predictions.

A seeded reply samples from a random key of its own (runtime/sampling.py): the same tokens in a
batch as alone. What a batch does not do (each member would need state of its own that one
forward does not keep apart): speculative drafts, reusing a previous turn's KV cache, and a K or
mode switch while it runs (one applies once it is empty). `Batch.join` refuses drafts; the
engine's plain `stream` runs such replies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..errors import Edge0Error
from ..routing.state import RoutingRows
from .decode import Decoder, GeneratedToken, GenerationResult
from .metrics import PEAK_SCOPE_PROCESS, StepMetrics, merged, process_peak_rss_bytes, summarize
from .sampling import Sampler

if TYPE_CHECKING:
    from ..config import GenerationConfig
    from .generation import Engine


@dataclass
class Member:
    """One reply in a batch: its prompt, sampler and stop, and what it has given so far."""

    prompt: list[int]
    gen: GenerationConfig
    should_stop: Callable[[], bool] | None
    sampler: Sampler
    eos: set[int]
    result: GenerationResult
    last: int | None = None  # the token the next step feeds (sampled, not yet in the cache)
    cache: list | None = None  # its own KV cache, from its prefill until it joins the batch's
    rows: RoutingRows | None = None  # its routing state, likewise (prerouter heads)
    done: bool = False

    @property
    def given(self) -> int:
        return len(self.result.tokens)


@dataclass
class BatchTokens:
    """What one `Batch.step` gave: each member's new token, and the members that ended."""

    tokens: list[tuple[Member, GeneratedToken]] = field(default_factory=list)
    ended: list[Member] = field(default_factory=list)


class Batch:
    """The replies decoding together on one engine (module docstring). Drive it with `step`
    until `busy` is false; `join` adds a reply at any step."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        if max_batch < 1:
            raise Edge0Error(f"max_batch={max_batch} must be at least 1")
        self.engine = engine
        # mlx-lm batches most KV caches (attention, linear attention, sliding windows); one it
        # cannot (llama4's chunked attention) decodes its replies one at a time here.
        self.rows_merge = all(hasattr(c, "merge") for c in make_prompt_cache(engine.model))
        self.max_batch = max_batch if self.rows_merge else 1
        self.members: list[Member] = []  # decoding, in the caches' row order
        self.joining: list[tuple[Member, Iterator[None]]] = []  # prefilling, first first
        self._decoder = Decoder(engine, [], None, None)  # the batch's steps, over its caches
        self._decoder.switches = False
        self.profile = engine.pending  # (K, mode): every member's

    @property
    def busy(self) -> bool:
        return bool(self.members or self.joining)

    @property
    def size(self) -> int:
        """Replies in the batch, decoding or prefilling."""
        return len(self.members) + len(self.joining)

    def join(
        self,
        prompt_tokens: list[int],
        gen: GenerationConfig | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Member:
        """Add a reply: its prefill starts at the next `step`. Raises Edge0Error for a request
        this model cannot serve, or one a batch cannot run (module docstring)."""
        engine = self.engine
        if self.busy and engine.pending != self.profile:
            raise Edge0Error("a K or mode switch is pending: it applies once the batch is empty")
        if not self.busy:
            engine.apply_requests()
            self.profile = (engine.k, engine.mode)
        if self.size >= self.max_batch:
            raise Edge0Error(
                f"the batch is full ({self.max_batch} replies: the memory plan counts that many "
                "KV caches, max_batch)"
            )
        gen = engine.checked_request(prompt_tokens, gen, None)
        if gen.draft is not None:
            raise Edge0Error(f"draft={gen.draft}: a batch verifies no drafts (run the reply alone)")
        eos = set() if gen.ignore_eos else set(engine.tokenizer.eos_token_ids)
        member = Member(
            list(prompt_tokens),
            gen,
            should_stop,
            Sampler(gen, prompt_tokens),
            eos,
            GenerationResult(list(prompt_tokens), [], "", []),
        )
        self.joining.append((member, self._prefill(member)))
        return member

    def step(self) -> BatchTokens:
        """One unit of work: the members asked whether to stop (after their caller has taken the
        last step's tokens, as a reply alone is asked), one decode step of those decoding, then
        a prefill chunk of the first reply joining (its first token where the chunk was its
        last: it decodes from the next step)."""
        out = BatchTokens()
        stopped = [i for i, m in enumerate(self.members) if m.should_stop and m.should_stop()]
        for i in stopped:
            self._end(self.members[i], "cancelled")
            out.ended.append(self.members[i])
        if stopped:
            self._drop_rows(stopped)
        if self.members:
            self._decode_step(out)
        if self.joining:
            member, chunks = self.joining[0]
            if next(chunks, "done") == "done":
                self.joining.pop(0)
                self._after_token(member, out, joined=True)
        return out

    def cancel_all(self) -> None:
        """End every reply now (their results say "cancelled")."""
        for member, _ in self.joining:
            self._end(member, "cancelled")
        for member in self.members:
            self._end(member, "cancelled")
        self.joining.clear()
        self.members.clear()
        self._decoder.cache = []
        if self.engine.routing is not None:
            self.engine.routing.reset()

    # -- a member's prefill ------------------------------------------------------------------------

    def _prefill(self, member: Member) -> Iterator[None]:
        """The member's prompt through its own KV cache, a chunk per `step`, then its first token
        (from the forward on the prompt's last token). Yields after each chunk; returns once the
        first token is in `member.last` (or the member was cancelled)."""
        engine = self.engine
        cache = make_prompt_cache(engine.model)
        decoder = Decoder(engine, cache, member.sampler, None)
        decoder.switches = False
        chunks = decoder.prefill(member.prompt, 0, member.should_stop)
        while True:
            with self._rows_of(member):
                if next(chunks, "done") == "done":
                    break
            yield
        if decoder.stopped_by == "cancelled":
            member.result.steps = decoder.steps
            self._end(member, "cancelled")
            return
        with self._rows_of(member):
            step = decoder.build(mx.array(member.prompt[-1:]), "prefill")
            member.last = member.sampler.finish(decoder.finish(step))
        member.result.steps = decoder.steps
        member.cache = cache
        engine.last_prefill = merged(decoder.steps)

    @contextmanager
    def _rows_of(self, member: Member) -> Iterator[None]:
        """The routing state holds `member`'s rows (its prefill) and the batch's again after."""
        routing = self.engine.routing
        if routing is None:
            yield
            return
        batch_rows = routing.take_rows()
        routing.put_rows(member.rows)
        try:
            yield
        finally:
            member.rows = routing.take_rows()
            routing.put_rows(batch_rows)

    def _add_rows(self, member: Member) -> None:
        """A prefilled member's cache and routing state become the batch's last row."""
        if not self.rows_merge:  # the only member: its own cache is the batch's
            rows = member.cache
        else:
            rows = [layer.merge([layer]) for layer in member.cache]
        if not self._decoder.cache:
            self._decoder.cache = rows
        else:
            for batch_layer, row in zip(self._decoder.cache, rows):
                batch_layer.extend(row)
        routing = self.engine.routing
        if routing is not None:
            routing.put_rows(routing.take_rows().joined(member.rows))

    # -- the batch's decode step -------------------------------------------------------------------

    def _decode_step(self, out: BatchTokens) -> None:
        members = list(self.members)
        inputs = mx.array([m.last for m in members], dtype=mx.int32)
        step = self._decoder.build_rows(inputs, [m.sampler for m in members])
        values = self._decoder.finish(step)
        metrics = self._decoder.steps[-1]
        for member, sampled in zip(members, _per_row(values, step.rows_sampled)):
            member.result.steps.append(metrics)
            member.last = member.sampler.finish(sampled)
            self._after_token(member, out)
        ended = [i for i, m in enumerate(members) if m.done]
        if ended:
            self._drop_rows(ended)

    def _after_token(self, member: Member, out: BatchTokens, joined: bool = False) -> None:
        """Give `member.last` to the reply; end the reply where it stops here, else keep it (a
        member that just joined starts decoding at the next step)."""
        if member.done:  # cancelled during its prefill
            out.ended.append(member)
            return
        token = member.last
        member.result.tokens.append(token)
        if member.sampler.last is not None:
            member.result.logprobs.append(member.sampler.last)
        out.tokens.append((member, GeneratedToken(token, member.result.steps[-1])))
        if token in member.eos or member.sampler.done:
            self._end(member, "eos")
        elif member.given >= member.gen.max_tokens:
            self._end(member, "max_tokens")
        elif joined:
            self._add_rows(member)
            member.cache = member.rows = None
            self.members.append(member)
            return
        member.cache = member.rows = None
        if member.done:
            out.ended.append(member)

    def _end(self, member: Member, why: str) -> None:
        member.done = True
        result = member.result
        result.stopped_by = why
        # A batch's replies share the process: its peaks are the process's, not a reply's.
        result.summary = summarize(
            result.steps,
            len(member.prompt),
            mx.get_peak_memory(),
            process_peak_rss_bytes(),
            PEAK_SCOPE_PROCESS,
        )
        result.summary["batch"] = batch_metrics(result.steps)
        result.text = self.engine.reply_text(result.tokens)
        if not result.tokens:
            result.summary["generated_tokens"] = 0

    def _drop_rows(self, ended: list[int]) -> None:
        keep = [i for i in range(len(self.members)) if i not in ended]
        self.members = [self.members[i] for i in keep]
        routing = self.engine.routing
        if not keep:
            self._decoder.cache = []
            if routing is not None:
                routing.reset()
            return
        rows = mx.array(keep, dtype=mx.int32)
        for layer in self._decoder.cache:
            layer.filter(rows)
        if routing is not None:
            routing.put_rows(routing.take_rows().kept(keep))


def _per_row(values: list, counts: list[int]) -> Iterator[list]:
    """The step's sampled values, split back into each row's sampler's."""
    start = 0
    for count in counts:
        yield values[start : start + count]
        start += count


def batch_metrics(steps: list[StepMetrics]) -> dict:
    """A batch's decode steps in figures: rows a step, the experts its layers used (the union of
    the rows') and what one row at a time would have used (their sum)."""
    rows = [s for s in steps if s.phase == "decode"]
    union = sum(s.experts_union for s in rows)
    summed = sum(s.experts_summed for s in rows)
    return {
        "steps": len(rows),
        "rows_per_step": sum(s.tokens for s in rows) / len(rows) if rows else 0.0,
        "experts_union": union,
        "experts_summed": summed,
        "reads_saved_fraction": 1 - union / summed if summed else 0.0,
    }

"""One reply's sampling: logits processors, then mlx-lm's sampler, with log-probabilities.

The processors are mlx-lm's own (`make_logits_processors`: logit bias, repetition, presence and
frequency penalties) and so is the sampler (`make_sampler`: temperature, top-p, min-p, top-k), so
every front end (the CLI, the app, the server) samples as mlx-lm does from one GenerationConfig.
Penalties look at the prompt and the reply so far, over the last `penalty_context` tokens, as in
mlx-lm's generate. Log-probabilities are those of the processed logits, before temperature.
A reply with a grammar (`GenerationConfig.constraint`, runtime/constraint.py) has every token the
grammar does not allow next set to -inf first, so processors and sampler only see allowed ones.
A reply with a seed draws from a random key of its own (split once a token), not MLX's global
generator: its tokens are the same whether it runs alone or as a row of a batch (runtime/batch.py),
whose replies sample side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from ..config import GenerationConfig


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the likeliest alternatives' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def logits_processors(gen: GenerationConfig) -> list:
    """mlx-lm's logits processors of `gen` (logit bias, penalties), each `(tokens, logits)`."""
    return make_logits_processors(
        logit_bias=gen.logit_bias or None,
        repetition_penalty=gen.repetition_penalty if gen.repetition_penalty != 1.0 else None,
        repetition_context_size=gen.penalty_context,
        presence_penalty=gen.presence_penalty or None,
        presence_context_size=gen.penalty_context,
        frequency_penalty=gen.frequency_penalty or None,
        frequency_context_size=gen.penalty_context,
    )


def sampling_filters(gen: GenerationConfig) -> list:
    """mlx-lm's sampler's filters of `gen`, in its order (top-p, min-p, top-k), each
    `logprobs -> logprobs`."""
    filters = []
    if 0 < gen.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, gen.top_p))
    if gen.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, gen.min_p, 1))
    if gen.top_k > 0:
        filters.append(lambda x: apply_top_k(x, gen.top_k))
    return filters


def keyed_sampler(gen: GenerationConfig):
    """mlx-lm's sampler chain (its filters, then a draw at the temperature), drawing with the
    key it is given: `(logprobs, key) -> token`."""
    filters = sampling_filters(gen)

    def sample(logprobs: mx.array, key: mx.array) -> mx.array:
        for keep in filters:
            logprobs = keep(logprobs)
        return mx.random.categorical(logprobs * (1 / gen.temperature), key=key)

    return sample


class Sampler:
    """Picks each token of one reply; call it with the last position's logits (1, vocab)."""

    def __init__(self, gen: GenerationConfig, prompt_tokens: list[int]) -> None:
        self._key = None
        if gen.seed is not None and gen.temperature != 0:
            self._key = mx.random.key(gen.seed)
            self._sample = keyed_sampler(gen)
        else:
            self._sample = make_sampler(
                gen.temperature, top_p=gen.top_p, min_p=gen.min_p, top_k=gen.top_k
            )
        self._processors = logits_processors(gen)
        # What the penalties look at (only kept when there are penalties), on the device: the
        # next step's graph can take a token the host has not read yet, as mlx-lm's does.
        self._seen = (
            mx.array(prompt_tokens[-gen.penalty_context :], dtype=mx.int32)
            if self._processors
            else None
        )
        self._context = gen.penalty_context
        self._top = gen.logprobs
        self._grammar = gen.constraint.start() if gen.constraint is not None else None
        self.last: TokenLogprobs | None = None  # the latest token's, when logprobs are asked for

    def __call__(self, logits: mx.array) -> list[mx.array]:
        """The token sampled from the last position's logits, on the device: `[token]`, and with
        log-probabilities asked for, its log-probability and the top ids and theirs. The engine
        reads them with the step's other values, then calls `finish`."""
        if self._grammar is not None:
            logits = self._grammar.apply(logits)
        if self._processors:
            for process in self._processors:
                logits = process(self._seen, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self._key is not None:
            self._key, key = mx.random.split(self._key)
            token = self._sample(logprobs, key).reshape(-1)
        else:
            token = self._sample(logprobs).reshape(-1)
        if self._seen is not None:
            self._seen = mx.concatenate([self._seen, token.astype(mx.int32)])[-self._context :]
        if self._top is None:
            return [token]
        logprobs = logprobs.reshape(-1)
        if not self._top:
            return [token, logprobs[token]]
        ids = mx.argsort(-logprobs)[: self._top]
        return [token, logprobs[token], ids, logprobs[ids]]

    def finish(self, values: list[np.ndarray]) -> int:
        """The sampled token from the host values of `__call__`'s arrays (and `last` with them)."""
        token = int(values[0].reshape(-1)[0])
        if self._top is not None:
            top = zip(values[2].tolist(), values[3].tolist(), strict=True) if self._top else ()
            self.last = TokenLogprobs(token, float(values[1].reshape(-1)[0]), tuple(top))
        if self._grammar is not None:
            self._grammar.advance(token)
        return token

    @property
    def constrained(self) -> bool:
        """Each token's mask needs the previous token on the host: no step is built ahead."""
        return self._grammar is not None

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: the reply ends (as at EOS)."""
        return self._grammar is not None and self._grammar.done

    def take_mask_ms(self) -> float:
        """Host milliseconds spent on grammar masks since the last call."""
        return self._grammar.take_mask_ms() if self._grammar is not None else 0.0

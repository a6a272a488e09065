"""One reply's sampling: logits processors, then mlx-lm's sampler, with log-probabilities.

The processors are mlx-lm's own (`make_logits_processors`: logit bias, repetition, presence and
frequency penalties) and so is the sampler (`make_sampler`: temperature, top-p, min-p, top-k), so
every front end (the CLI, the app, the server) samples as mlx-lm does from one GenerationConfig.
Penalties look at the prompt and the reply so far, over the last `penalty_context` tokens, as in
mlx-lm's generate. Log-probabilities are those of the processed logits, before temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from ..config import GenerationConfig


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the likeliest alternatives' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """Picks each token of one reply; call it with the last position's logits (1, vocab)."""

    def __init__(self, gen: GenerationConfig, prompt_tokens: list[int]) -> None:
        self._sample = make_sampler(
            gen.temperature, top_p=gen.top_p, min_p=gen.min_p, top_k=gen.top_k
        )
        self._processors = make_logits_processors(
            logit_bias=gen.logit_bias or None,
            repetition_penalty=gen.repetition_penalty if gen.repetition_penalty != 1.0 else None,
            repetition_context_size=gen.penalty_context,
            presence_penalty=gen.presence_penalty or None,
            presence_context_size=gen.penalty_context,
            frequency_penalty=gen.frequency_penalty or None,
            frequency_context_size=gen.penalty_context,
        )
        # What the penalties look at: only kept when there are penalties.
        self._seen = list(prompt_tokens[-gen.penalty_context :]) if self._processors else None
        self._context = gen.penalty_context
        self._top = gen.logprobs
        self.last: TokenLogprobs | None = None  # the latest token's, when logprobs are asked for

    def __call__(self, logits: mx.array) -> int:
        if self._processors:
            seen = mx.array(self._seen, dtype=mx.int32)
            for process in self._processors:
                logits = process(seen, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = int(self._sample(logprobs).item())
        if self._seen is not None:
            self._seen.append(token)
            del self._seen[: -self._context]
        if self._top is not None:
            self.last = self._logprobs_of(logprobs.reshape(-1), token)
        return token

    def _logprobs_of(self, logprobs: mx.array, token: int) -> TokenLogprobs:
        top: tuple[tuple[int, float], ...] = ()
        if self._top:
            ids = mx.argsort(-logprobs)[: self._top]
            top = tuple(zip(ids.tolist(), logprobs[ids].tolist(), strict=True))
        return TokenLogprobs(token, float(logprobs[token].item()), top)

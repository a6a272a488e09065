"""Data for phases 2 and 3 and `edge0 eval`: corpus tokens, prompts drawn from them, and
continuations sampled in a batch (any mlx-lm model) or one by one from the served engine."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ..config import GenerationConfig
from ..errors import Edge0Error
from ..runtime.generation import Engine


def sample(
    model: nn.Module,
    prompts: np.ndarray,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Continuations [B, max_tokens] of equal-length prompts [B, P], sampled in one batch with
    mlx-lm's KV caches (fixed length; cut them at EOS with `continuation_mask`)."""
    mx.random.seed(seed)
    sampler = make_sampler(temperature, top_p=top_p)
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    out = []
    for _ in range(max_tokens):
        token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        out.append(token)
        logits = model(token[:, None], cache=cache)[:, -1, :]
        mx.async_eval(logits)
    return np.array(mx.stack(out, axis=1))


def sample_served(
    engine: Engine,
    prompts: np.ndarray,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> list[list[int]]:
    """One continuation per prompt from the engine, the served model (prompt i samples with seed
    seed + i); a continuation ends early at EOS."""
    continuations = []
    for i, prompt in enumerate(prompts):
        gen = GenerationConfig(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + i
        )
        continuations.append(engine.generate(prompt.tolist(), gen).tokens)
    return continuations


def continuation_mask(continuations: np.ndarray, eos_ids) -> np.ndarray:
    """[B, C] bool: each continuation up to and including its first end-of-sequence token."""
    eos = np.isin(continuations, list(eos_ids))
    after = np.cumsum(eos, axis=1) - eos  # EOS tokens strictly before this position
    return after == 0


# A token is rarely longer than this many characters: `corpus_tokens` encodes only the first
# CHARS_PER_TOKEN x max_tokens characters of a text, and a reader need read no more.
CHARS_PER_TOKEN = 16


def corpus_tokens(tokenizer, text: str, max_tokens: int) -> np.ndarray:
    """The first `max_tokens` tokens of `text` (of its first CHARS_PER_TOKEN x `max_tokens`
    characters)."""
    text = text[: CHARS_PER_TOKEN * max_tokens]
    return np.array(tokenizer.encode(text)[:max_tokens], dtype=np.int64)


def draw_prompts(tokens: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`n` prompts [n, length]: windows of the corpus at random offsets."""
    if len(tokens) < length + 1:
        raise Edge0Error(f"the text is too short: {len(tokens)} tokens for prompts of {length}")
    starts = rng.integers(0, len(tokens) - length, size=n)
    return np.stack([tokens[s : s + length] for s in starts])


def masked_mean(values: mx.array, mask: mx.array) -> mx.array:
    mask = mask.astype(values.dtype)
    return (values * mask).sum() / mx.maximum(mask.sum(), 1.0)

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


# Text is encoded this many characters at a time: one encode of a long text holds far more than
# the text (a corpus of a few MB took hundreds of MiB more, past a training run's plan in a
# cgroup).
ENCODE_PIECE_CHARS = 1 << 16


def corpus_tokens(tokenizer, text: str, max_tokens: int) -> np.ndarray:
    """The first `max_tokens` tokens of `text` (of its first CHARS_PER_TOKEN x `max_tokens`
    characters), encoded a piece at a time: pieces end at a line break followed by a
    non-space character, where no token spans the cut; only the first piece has the
    tokenizer's special tokens."""
    text = text[: CHARS_PER_TOKEN * max_tokens]
    tokens: list[int] = []
    start = 0
    while start < len(text) and len(tokens) < max_tokens:
        end = _piece_end(text, start + ENCODE_PIECE_CHARS)
        piece = text[start:end]
        tokens += tokenizer.encode(piece) if start == 0 else _encode_plain(tokenizer, piece)
        start = end
    return np.array(tokens[:max_tokens], dtype=np.int64)


def _piece_end(text: str, at: int) -> int:
    """The first cut at or after `at`: just after a newline that a non-space character follows
    (the end of the text where there is none)."""
    if at >= len(text):
        return len(text)
    cut = at
    while (cut := text.find("\n", cut)) != -1:
        if cut + 1 < len(text) and not text[cut + 1].isspace():
            return cut + 1
        cut += 1
    return len(text)


def _encode_plain(tokenizer, text: str) -> list[int]:
    """`text`'s tokens without the special tokens an encode adds at the start (a BOS)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without the option adds none
        return list(tokenizer.encode(text))


def draw_prompts(tokens: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`n` prompts [n, length]: windows of the corpus at random offsets."""
    if len(tokens) < length + 1:
        raise Edge0Error(f"the text is too short: {len(tokens)} tokens for prompts of {length}")
    starts = rng.integers(0, len(tokens) - length, size=n)
    return np.stack([tokens[s : s + length] for s in starts])


def masked_mean(values: mx.array, mask: mx.array) -> mx.array:
    mask = mask.astype(values.dtype)
    return (values * mask).sum() / mx.maximum(mask.sum(), 1.0)

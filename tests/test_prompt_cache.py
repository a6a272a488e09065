"""A chat turn continues from the last reply's KV cache instead of prefilling the whole history."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, GenerationConfig
from engine.runtime.generation import Engine

GREEDY = GenerationConfig(max_tokens=12)
HYBRID = ("qwen3_next", "qwen3_5_moe")  # linear-attention state cannot be cut back


def _chat(engine: Engine) -> tuple[list[int], list[int], dict]:
    """Two turns through the chat template (the reply is decoded and re-encoded)."""
    history = [{"role": "user", "content": "tell me about lighthouses"}]
    first = engine.generate(engine.encode_chat(history), GREEDY)
    history += [
        {"role": "assistant", "content": engine.tokenizer.decode(first.tokens[:-1])},
        {"role": "user", "content": "and the keepers?"},
    ]
    prompt = engine.encode_chat(history)
    second = engine.generate(prompt, GREEDY)
    return prompt, second.tokens, second.summary


def _continuation(engine: Engine) -> tuple[list[int], list[int], dict]:
    """Two turns where the second prompt extends the first exactly (prompt + reply + more)."""
    prompt = [5, 6, 7, 8, 9]
    first = engine.generate(prompt, GREEDY)
    prompt = prompt + first.tokens + [11, 12, 13]
    second = engine.generate(prompt, GREEDY)
    return prompt, second.tokens, second.summary


def _both(model_dir, turns):
    with Engine(model_dir, EngineConfig(mode="on-demand")) as engine:
        reused = turns(engine)
    with Engine(model_dir, EngineConfig(mode="on-demand", reuse_prompt_cache=False)) as engine:
        full = turns(engine)
    assert full[2]["reused_prompt_tokens"] == 0
    return reused, full


# One family per kind of KV cache mlx-lm gives it: plain (Qwen3), hybrid with recurrent state
# (Qwen3-Next), sliding-window rotating (gpt-oss), chunked (Llama-4), latent attention (DeepSeek).
CACHE_FAMILIES = ("qwen3_moe", "qwen3_next", "gpt_oss", "llama4", "deepseek_v3")


@pytest.mark.parametrize("family", CACHE_FAMILIES)
def test_exact_continuation_reuses_the_cache(checkpoint_dir, family):
    (prompt, tokens, summary), (_, full_tokens, _) = _both(checkpoint_dir(family), _continuation)
    assert summary["reused_prompt_tokens"] == len(prompt) - 3 - 1  # all but the new tokens
    assert tokens == full_tokens


@pytest.mark.parametrize("family", CACHE_FAMILIES)
def test_chat_turn_reuses_the_common_prefix(checkpoint_dir, family):
    (prompt, tokens, summary), (_, full_tokens, _) = _both(checkpoint_dir(family), _chat)
    # Attention caches are cut back to the common prefix; a hybrid model's recurrent state is
    # reused only when re-encoding happened to reproduce the reply's tokens exactly.
    if family not in HYBRID:
        assert 0 < summary["reused_prompt_tokens"] < len(prompt)
    assert tokens == full_tokens


def test_no_reuse_across_k_or_unrelated_prompts(checkpoint_dir):
    with Engine(checkpoint_dir("qwen3_moe"), EngineConfig(mode="on-demand")) as engine:
        engine.generate([5, 6, 7, 8], GREEDY)
        assert engine.generate([9, 9, 9], GREEDY).summary["reused_prompt_tokens"] == 0
        engine.request_k(2)
        assert engine.generate([9, 9, 9, 4, 4], GREEDY).summary["reused_prompt_tokens"] == 0

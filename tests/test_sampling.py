"""Sampling options in the engine's sampler (engine/runtime/sampling.py) give mlx-lm's tokens.

The oracle is mlx-lm's own `generate_step` on the resident model with mlx-lm's processors and
sampler built from the same values; the engine runs the same checkpoint in resident mode.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load

from engine import Edge0Error
from engine.config import EngineConfig, GenerationConfig
from engine.runtime.generation import Engine

PROMPT = [11, 400, 97, 5, 300, 12]
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir):
    return checkpoint_dir("qwen3_moe")


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir, EngineConfig(mode="resident", exact_kernels=True)) as engine:
        yield engine


def oracle(model_dir, gen: GenerationConfig) -> tuple[list[int], list[float]]:
    """mlx-lm's tokens and each token's log-probability for `gen`'s sampling values."""
    model, _ = load(str(model_dir))
    model.set_dtype(mx.float32)  # as the engine computes on a CPU
    sampler = make_sampler(gen.temperature, top_p=gen.top_p, min_p=gen.min_p, top_k=gen.top_k)
    processors = make_logits_processors(
        logit_bias=gen.logit_bias or None,
        repetition_penalty=gen.repetition_penalty,
        repetition_context_size=gen.penalty_context,
        presence_penalty=gen.presence_penalty,
        presence_context_size=gen.penalty_context,
        frequency_penalty=gen.frequency_penalty,
        frequency_context_size=gen.penalty_context,
    )
    steps = generate_step(
        mx.array(PROMPT), model, max_tokens=TOKENS, sampler=sampler, logits_processors=processors
    )
    tokens, logprobs = [], []
    for token, probs in steps:
        tokens.append(int(token))
        logprobs.append(float(probs[int(token)].item()))
    return tokens, logprobs


CASES = {
    "repetition": dict(repetition_penalty=1.5, penalty_context=8),
    "presence and frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "logit bias": dict(logit_bias={11: 5.0, 97: -100.0}),
    "min_p": dict(min_p=0.2),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_greedy_with_penalties_and_bias_gives_mlx_lms_tokens(engine, model_dir, case):
    gen = GenerationConfig(max_tokens=TOKENS, ignore_eos=True, logprobs=3, **CASES[case])
    plain = engine.generate(PROMPT, GenerationConfig(max_tokens=TOKENS, logprobs=0))
    result = engine.generate(PROMPT, gen)
    want, want_logprobs = oracle(model_dir, gen)
    assert result.tokens == want
    if case != "min_p":  # the processed logits differ (min_p cuts in the sampler, after them)
        assert [t.logprob for t in result.logprobs] != [t.logprob for t in plain.logprobs]
    assert [t.token for t in result.logprobs] == want
    assert [t.logprob for t in result.logprobs] == pytest.approx(want_logprobs, abs=1e-3)
    for chosen in result.logprobs:  # greedy: the chosen token is the likeliest
        assert len(chosen.top) == 3 and chosen.top[0][0] == chosen.token
        assert [p for _, p in chosen.top] == sorted((p for _, p in chosen.top), reverse=True)


def test_a_banned_token_never_comes_and_a_forced_one_always_does(engine):
    plain = engine.generate(PROMPT, GenerationConfig(max_tokens=8, ignore_eos=True))
    banned = plain.tokens[0]
    gen = GenerationConfig(max_tokens=8, ignore_eos=True, logit_bias={banned: -100})
    assert banned not in engine.generate(PROMPT, gen).tokens
    forced = GenerationConfig(max_tokens=4, temperature=1.0, seed=1, logit_bias={42: 100})
    assert engine.generate(PROMPT, forced).tokens == [42] * 4


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
    ],
)
def test_sampling_values_are_checked_naming_the_field(fields, field):
    with pytest.raises(Edge0Error, match=rf"^{field}="):
        GenerationConfig(**fields)


def test_a_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(Edge0Error, match="^logit_bias=.*outside the vocabulary"):
        engine.generate(PROMPT, GenerationConfig(logit_bias={engine.vocab_size: 1.0}))

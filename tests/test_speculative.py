"""Speculative decoding (runtime/speculative.py): drafts verified in one forward, exactly.

Greedy tokens with `draft="lookup"` are the plain run's in every exact mode (resident, on-demand
with a cache that misses, prefetch), on the demo and three families whose KV caches trim (gpt_oss
with sliding windows); a verify step costs the host reads of a plain step (one for its tokens,
however many it verifies); and the speculative sampling rule keeps the sampler's distribution.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime.generation import Engine
from engine.runtime.speculative import DraftLength, LookupDrafter, Verifier, speculative_tokens

DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"


def _greedy(draft: str | None, **extra) -> GenerationConfig:
    return GenerationConfig(max_tokens=12, ignore_eos=True, draft=draft, **extra)


def _plain_and_drafted(engine: Engine, prompt: list[int], **extra):
    plain = engine.generate(prompt, _greedy(None, **extra))
    drafted = engine.generate(prompt, _greedy("lookup", **extra))
    return plain, drafted


def _verify_steps(result):
    return [s for s in result.steps if s.phase == "decode" and s.tokens > 1]


def test_greedy_drafted_tokens_are_the_plain_runs_on_the_demo_in_every_exact_mode():
    """On-demand with a cache that misses, then prefetch on the same engine, then resident: the
    same tokens with and without drafts; drafts were kept; a verify step read its routing once
    a layer and its tokens once, as a plain step does; its union is below the positions' sum."""
    with Engine(DEMO, EngineConfig(mode="on-demand", expert_cache_bytes=4 << 20)) as engine:
        prompt = engine.encode("a b c d a b c d a b")  # the demo goes on repeating: drafts kept
        plain, drafted = _plain_and_drafted(engine, prompt)
        assert drafted.tokens == plain.tokens
        assert sum(s.mib_read for s in plain.steps[1:]) > 0  # the cache misses
        verify = _verify_steps(drafted)
        assert verify and drafted.summary["draft"]["accepted"] > 0
        one_token = max(s.host_syncs for s in plain.steps if s.phase == "decode")
        assert max(s.host_syncs for s in verify) == one_token  # not one read per position
        reasons = [s.host_sync_reasons for s in verify]
        assert all(r["the step's token and what the next one needs"] == 1 for r in reasons)
        union = sum(s.experts_union for s in verify)
        assert 0 < union < sum(s.experts_summed for s in verify)  # reads saved
        steps = [s for s in drafted.steps if s.phase == "decode"]
        assert sum(s.given for s in steps) + 1 == len(drafted.tokens)
        assert all(s.given == s.accepted + 1 for s in steps[:-1])

        engine.request_mode("prefetch")
        drafted = engine.generate(prompt, _greedy("lookup"))
        assert drafted.tokens == plain.tokens and _verify_steps(drafted)

    with Engine(DEMO, EngineConfig(mode="resident")) as engine:
        assert engine.generate(prompt, _greedy("lookup")).tokens == plain.tokens


class KnowingDrafter:
    """Drafts the plain reply's next tokens, every third one wrong: kept and rejected drafts on
    a synthetic model (random weights repeat little, so lookup would rarely draft)."""

    def __init__(self, prompt: list[int], reply: list[int]) -> None:
        self.prompt, self.reply = prompt, reply

    def propose(self, context, limit: int) -> list[int]:
        given = len(context) - len(self.prompt)
        draft = self.reply[given : given + limit]
        return [t if (given + i) % 3 else t + 1 for i, t in enumerate(draft)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_greedy_drafted_tokens_are_the_plain_runs_on_other_families(
    checkpoint_dir, family, monkeypatch
):
    """On-demand with a cache of a few experts a layer, prefetch, resident; with a repetition
    penalty too (each position sees the drafts before it)."""
    from engine.runtime import speculative

    model = checkpoint_dir(family)
    prompt = [5, 9, 13, 17, 21, 5, 9, 13]
    penalised = {"repetition_penalty": 1.3}
    with Engine(model, EngineConfig(mode="on-demand", expert_cache_bytes=120_000)) as engine:
        plain = engine.generate(prompt, _greedy(None, **penalised))
        drafter = KnowingDrafter(prompt, plain.tokens)
        monkeypatch.setattr(speculative, "make_drafter", lambda name: drafter)
        drafted = engine.generate(prompt, _greedy("lookup", **penalised))
        assert drafted.tokens == plain.tokens
        draft = drafted.summary["draft"]
        assert 0 < draft["accepted"] < draft["drafted"]
        assert sum(s.loads for s in drafted.steps[1:]) > 0  # the cache misses
        sampled = GenerationConfig(
            max_tokens=12,
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=3,
            ignore_eos=True,
            draft="lookup",
        )
        tokens = engine.generate(prompt, sampled).tokens
        assert len(tokens) == 12 and engine.generate(prompt, sampled).tokens == tokens  # seeded
        engine.request_mode("prefetch")
        assert engine.generate(prompt, _greedy("lookup", **penalised)).tokens == plain.tokens
    with Engine(model, EngineConfig(mode="resident")) as engine:
        assert engine.generate(prompt, _greedy("lookup", **penalised)).tokens == plain.tokens


def test_a_verify_step_reads_only_the_missing_experts_of_its_union(checkpoint_dir, monkeypatch):
    """With most of a layer in the cache, a forward of a few positions routed to more than half
    of the layer's experts reads what it misses, not the whole layer."""
    from engine.runtime import speculative

    model = checkpoint_dir("qwen3_moe")
    prompt = [5, 9, 13, 17, 21, 5, 9, 13, 17, 21, 5, 9, 13]
    config = EngineConfig(mode="on-demand", expert_cache_bytes=400_000)
    with Engine(model, config) as engine:
        assert engine.memory_plan.whole_layer_prefill and not engine.store.every_layer_held
        plain = engine.generate(prompt, _greedy(None))  # the cache warms
        drafter = KnowingDrafter(prompt, plain.tokens)
        monkeypatch.setattr(speculative, "make_drafter", lambda name: drafter)
        drafted = engine.generate(prompt, _greedy("lookup", draft_max=2))
    verify = _verify_steps(drafted)
    assert verify and max(s.experts_union for s in verify) > 0
    assert sum(s.whole_layer_reads for s in verify) == 0


def test_a_multi_position_forward_computes_each_position_as_one_token_forwards_do():
    """The bound behind greedy exactness: a verify forward's logits against one-token forwards'
    over the same cache (resident demo). Equal here (the CPU's kernels give each row the same
    value whatever the rows beside it); a kernel that rounds by row count must stay inside."""
    with Engine(DEMO, EngineConfig(mode="resident")) as engine:
        prompt = engine.encode("Tell me about the sea.", chat=True)
        inputs = [43, 493, 329, 312, 261]
        caches = []
        for _ in range(2):
            cache = make_prompt_cache(engine.model)
            engine.model(mx.array(prompt)[None], cache=cache)
            caches.append(cache)
        one = mx.concatenate([engine.model(mx.array([[t]]), cache=caches[0])[0] for t in inputs])
        many = engine.model(mx.array([inputs]), cache=caches[1])[0]
        difference = mx.abs(one - many).max().item()
    assert difference <= 1e-4 * mx.abs(one).max().item()


def test_drafts_are_refused_in_one_line_where_they_cannot_be_exact(checkpoint_dir):
    with Engine(checkpoint_dir("qwen3_next"), EngineConfig(mode="on-demand")) as engine:
        with pytest.raises(Edge0Error, match="cannot .*linear attention"):
            engine.stream([5, 9, 13], _greedy("lookup"))
    with Engine(DEMO, EngineConfig(mode="prerouter", k=4, expert_cache_bytes=4 << 20)) as engine:
        with pytest.raises(Edge0Error, match="prerouter mode: its routing"):
            engine.stream([5, 9, 13], _greedy("lookup"))
        gen = GenerationConfig(draft="lookup", logprobs=2)
        engine.request_mode("on-demand")
        with pytest.raises(Edge0Error, match="logprobs"):
            engine.stream([5, 9, 13], gen)
    with pytest.raises(Edge0Error, match="draft='model'"):
        GenerationConfig(draft="model")


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    drafter = LookupDrafter()
    assert drafter.propose([1, 2, 3, 4, 9, 2, 3, 4, 7, 2, 3, 4], 3) == [7, 2, 3]
    assert drafter.propose([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], 2) == [9, 5]  # the longest match
    assert drafter.propose([1, 2, 3, 4, 9, 8, 4], 2) == []  # one token is no match
    assert LookupDrafter(shortest=1).propose([1, 2, 3, 4, 9, 8, 4], 2) == [9, 8]
    assert drafter.propose([1, 2, 3], 4) == [] and drafter.propose([1, 1], 0) == []


def test_the_draft_length_grows_on_full_accepts_and_shrinks_on_early_rejects():
    length = DraftLength(8)
    for drafted, accepted, then in ((2, 2, 4), (4, 4, 8), (8, 8, 8), (8, 1, 2), (2, 0, 1)):
        length.update(drafted, accepted)
        assert length.current == then


def test_speculative_sampling_keeps_the_target_distribution():
    """Many draws of the rule at once: the first token is distributed as p_0 whatever the
    draft, and after a kept draft the next one as p_1 (four standard errors apart at most)."""
    mx.random.seed(0)
    draws = 40_000
    p = mx.array([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.3, 0.4], [0.2] * 5])
    probs = mx.broadcast_to(p, (draws, *p.shape))
    draft = mx.broadcast_to(mx.array([1, 3]), (draws, 2))
    kept, tokens = speculative_tokens(probs, draft)
    kept, tokens = np.array(kept), np.array(tokens)
    first = np.bincount(tokens[:, 0], minlength=5) / draws
    assert np.abs(first - np.array(p[0])).max() < 4 * np.sqrt(0.25 / draws)
    followed = tokens[kept >= 1, 1]
    second = np.bincount(followed, minlength=5) / len(followed)
    assert np.abs(second - np.array(p[1])).max() < 4 * np.sqrt(0.25 / len(followed))
    assert np.all((kept == 0) == (tokens[:, 0] != 1))  # a kept draft is the draft


def test_the_verifier_penalises_each_position_as_the_sampler_does():
    """Greedy with a repetition penalty: position i sees the reply and the drafts before it, so
    a draft that repeats is penalised where the plain run would penalise it."""
    gen = GenerationConfig(repetition_penalty=10.0, penalty_context=4)
    verify = Verifier(gen)
    logits = mx.array([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    kept, tokens = verify(logits, [0], [1])  # after the draft 1, token 1 is penalised
    assert int(kept) == 1 and np.array(tokens).tolist() == [1, 2]


def test_the_verifier_samples_from_the_samplers_filtered_distribution():
    """top-k 1 leaves one token a position: sampling then keeps exactly the argmax drafts."""
    verify = Verifier(GenerationConfig(temperature=1.0, top_k=1))
    logits = mx.array([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    kept, tokens = verify(logits, [0], [1, 2])
    assert int(kept) == 1 and np.array(tokens).tolist()[:2] == [1, 1]


def test_a_request_to_the_server_asks_for_drafts_in_every_api(checkpoint_dir, monkeypatch):
    """`draft` (and `draft_max`) are a request's own in the chat, completions, Messages and
    Responses APIs; a drafter that does not exist is refused naming the field; a drafted reply's
    figures say how many drafts were kept; prerouter mode refuses it naming the field."""
    from edge0_tui.engine_service.service import request_figures
    from edge0_tui.server.anthropic_shapes import parse_messages
    from edge0_tui.server.engine_worker import api_error
    from edge0_tui.server.openai_shapes import ApiError, parse_chat, parse_completion
    from edge0_tui.server.responses_api import ResponseStore, parse_responses

    ids = ("tiny", "edge0")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "draft": "lookup"}
    asked = [
        parse_chat({**chat, "draft_max": 3}, ids).generation,
        parse_completion({"model": "tiny", "prompt": "hi", "draft": "lookup"}, ids).generation,
        parse_messages({**chat, "max_tokens": 8}, ids).generation,
        parse_responses(
            {"model": "tiny", "input": "hi", "draft": "lookup"}, ids, ResponseStore()
        ).generation,
    ]
    assert [(g.draft, g.draft_max) for g in asked] == [("lookup", 3)] + [("lookup", 8)] * 3
    with pytest.raises(ApiError) as refused:
        parse_chat({**chat, "draft": "magic"}, ids)
    assert refused.value.param == "draft"

    from engine.runtime import speculative

    always = type("Always", (), {"propose": lambda self, context, limit: [5] * limit})()
    monkeypatch.setattr(speculative, "make_drafter", lambda name: always)
    prompt = [5, 9, 13, 17, 5, 9, 13, 17, 5, 9]
    with Engine(checkpoint_dir("qwen3_moe"), EngineConfig(mode="on-demand")) as engine:
        result = engine.generate(
            prompt, dataclasses.replace(asked[0], ignore_eos=True, max_tokens=8)
        )
        assert request_figures(result, engine.k, engine.mode)["draft"]["steps"] > 0
    with Engine(DEMO, EngineConfig(mode="prerouter")) as engine:
        with pytest.raises(Edge0Error) as error:
            engine.generate(prompt, asked[0])
        assert api_error(error.value, 0).param == "draft"

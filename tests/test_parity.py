"""Streaming with the true router gives the same greedy tokens as stock mlx-lm, for every family.

Resident mode is mlx-lm's own model with every weight in memory: the oracle. On-demand mode must
match it token for token, whichever path the experts take (per-expert decode, compact prefill stack,
whole-layer prefill) and however often the pool evicts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig, GenerationConfig
from engine.runtime.generation import Engine
from engine.runtime.loader import read_config, routed_top_k

# Past EOS too: some random models end a reply early, and parity compares every token. Sixteen
# tokens: under the one-layer budget each decode step evicts and reads again.
GREEDY = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
# Where nothing is evicted the test counts the decode's hits against its loads: a one-expert
# model is still reading new experts after sixteen tokens.
LONGER = replace(GREEDY, max_tokens=32)
# Three tokens: a two-token prefill chunk routes to at most 2 * top_k = 8 of 16 experts, below the
# whole-layer threshold (half the experts), so prefill takes the per-expert path.
SHORT_PROMPT = [11, 400, 97]
# Sixty tokens in chunks of 16: every chunk touches most experts, so prefill reads whole layers.
LONG_PROMPT = [(i * 37 + 5) % 1000 + 3 for i in range(60)]


def _generate(model_dir, prompt, gen=GREEDY, **config) -> tuple[list[int], list]:
    # Today's kernels: the dense prefill path (a fast BLAS) is bounded in test_prefill_fast.py.
    # Whole-layer prefill wherever it fits, whatever the cache: the path the long prompt checks.
    config = {"whole_layer_prefill": True, **config}
    engine = Engine(model_dir, EngineConfig(prefill_chunk=16, exact_kernels=True, **config))
    try:
        result = engine.generate(prompt, gen)
        return result.tokens, result.steps
    finally:
        engine.close()


@pytest.fixture(scope="module")
def resident_tokens(checkpoint_dir):
    cache = {}

    def get(family: str, prompt_name: str) -> list[int]:
        if (family, prompt_name) not in cache:
            prompt = SHORT_PROMPT if prompt_name == "short" else LONG_PROMPT
            tokens, _ = _generate(checkpoint_dir(family), prompt, LONGER, mode="resident")
            cache[family, prompt_name] = tokens
        return cache[family, prompt_name]

    return get


def _one_layer_budget(model_dir) -> int:
    """A budget of one expert more than one layer's routed set: experts are evicted every step."""
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    try:
        store = engine.store
        layer = max(store.index.layers)
        return (engine.loaded.top_k + 1) * store.resident_expert_nbytes(layer)
    finally:
        engine.close()


def _all_but_one_budget(model_dir) -> int:
    """A budget one expert short of every expert: nothing is evicted once read, but no layer
    can be held whole, so every layer reads its routing back and reads what it misses."""
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    try:
        store = engine.store
        total = sum(
            store.index.layers[n].num_experts * store.resident_expert_nbytes(n)
            for n in store.index.layers
        )
        return total - store.resident_expert_nbytes(max(store.index.layers))
    finally:
        engine.close()


BUDGETS = {"everything": lambda _: 1 << 30, "all-but-one": _all_but_one_budget}


@pytest.mark.parametrize("prompt_name", ["short", "long"])
@pytest.mark.parametrize("cache", ["everything", "all-but-one", "one-layer"])
def test_on_demand_matches_resident(checkpoint_dir, resident_tokens, family, prompt_name, cache):
    model_dir = checkpoint_dir(family)
    budget = BUDGETS.get(cache, _one_layer_budget)(model_dir)
    prompt = SHORT_PROMPT if prompt_name == "short" else LONG_PROMPT
    gen = LONGER if cache == "all-but-one" else GREEDY
    tokens, steps = _generate(model_dir, prompt, gen, mode="on-demand", expert_cache_bytes=budget)

    assert len(tokens) == gen.max_tokens
    # (Greedy: a shorter reply is the first tokens of the longer one.)
    assert tokens == resident_tokens(family, prompt_name)[: len(tokens)]

    prefill = [s for s in steps if s.phase == "prefill"]
    decode = [s for s in steps if s.phase == "decode"]
    whole_layer_reads = sum(s.whole_layer_reads for s in prefill)
    if cache == "everything":
        # Every expert is held in the cache (read once, at the first step): nothing more is
        # read, prefill takes the bank, and a decode step waits on the device once, as
        # resident mode does.
        assert whole_layer_reads == 0
        assert all(s.loads == 0 and s.hits > 0 for s in decode)
        assert all(s.host_syncs == 1 for s in decode)
        return
    if prompt_name == "long":
        assert whole_layer_reads > 0, "long prompts must read whole layers"
        assert max(s.transient_peak_mib for s in prefill) > 0
    elif cache == "all-but-one":
        assert whole_layer_reads == 0, "short prompts must take the per-expert path"
    # (A short prompt under the one-layer budget may touch more experts than the cache holds:
    # those chunks read their layers whole.)
    assert all(s.whole_layer_reads == 0 for s in decode)
    if cache == "one-layer":
        # Little more than one layer fits, so routed experts are read again step after step
        # (every step, unless a K=1 model's few MoE layers route into the spare slot).
        loading = sum(s.loads > 0 for s in decode)
        one_expert = routed_top_k(read_config(model_dir)) == 1
        assert loading > 0 if one_expert else loading == len(decode)
        assert all(s.expert_pool_mib * 2**20 <= budget for s in decode)
    else:
        # Everything read stays: after the first pass over the prompt, decode reads only new
        # experts, and each MoE layer reads its routing back once a step (and no more).
        assert sum(s.hits for s in decode) > sum(s.loads for s in decode)
        assert all(s.host_syncs == len(s.routed_by_layer) + 1 for s in decode)


@pytest.mark.parametrize("family_name", ["qwen3_moe", "deepseek_v3"])
def test_a_chunk_computed_in_token_blocks_matches_resident(
    checkpoint_dir, monkeypatch, family_name
):
    """A long prefill chunk's expert products in blocks of tokens (bounded activations): the
    resident model's tokens, for a chunk of 130 tokens in the smallest blocks (none with fewer
    routed rows than the kernel sorts)."""
    from engine.experts import switch_glu

    model_dir = checkpoint_dir(family_name)
    prompt = [(i * 53 + 7) % 900 + 3 for i in range(131)]
    chunk = {"prefill_chunk": 256, "exact_kernels": True}
    resident = Engine(model_dir, EngineConfig(mode="resident", **chunk))
    try:
        want = resident.generate(prompt, GREEDY).tokens
    finally:
        resident.close()
    blocks = []
    block_glu = switch_glu.StreamingSwitchGLU._gather_glu_block

    def counted(self, x, indices, bank):
        blocks.append(indices.size // indices.shape[-1])
        return block_glu(self, x, indices, bank)

    monkeypatch.setattr(switch_glu, "GATHER_ACTIVATION_BYTES", 1)  # the smallest blocks
    monkeypatch.setattr(switch_glu.StreamingSwitchGLU, "_gather_glu_block", counted)
    streamed = Engine(model_dir, EngineConfig(mode="on-demand", **chunk))
    try:
        got = streamed.generate(prompt, GREEDY).tokens
        k = streamed.k
    finally:
        streamed.close()
    assert got == want
    chunk_blocks = [b for b in blocks if b > 1]  # (decode steps are one block of one token)
    assert len(chunk_blocks) > 1 and max(chunk_blocks) < 130  # the chunk went in blocks
    assert min(chunk_blocks) * k >= switch_glu.SORTED_MIN_ROWS


@pytest.mark.parametrize("family_name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("exact", [True, False])
def test_a_prompt_through_the_bank_in_expert_groups_matches_whole_layers(
    checkpoint_dir, family_name, exact
):
    """Without whole-layer prefill a chunk routed to more experts than the expert cache holds goes
    through the bank a bankful at a time: the tokens of the whole-layer path (exact kernels: the
    resident model's; the fast path: the same values, computed per expert alike), nothing read as
    a whole layer, and the cache never above its budget."""
    model_dir = checkpoint_dir(family_name)
    budget = _one_layer_budget(model_dir)
    config = {"prefill_chunk": 64, "exact_kernels": exact, "expert_cache_bytes": budget}
    whole, _ = _generate_with(
        model_dir, LONG_PROMPT, mode="on-demand", whole_layer_prefill=True, **config
    )
    grouped, steps = _generate_with(
        model_dir, LONG_PROMPT, mode="on-demand", whole_layer_prefill=False, **config
    )
    assert grouped == whole
    prefill = [s for s in steps if s.phase == "prefill"]
    assert sum(s.whole_layer_reads for s in prefill) == 0
    routed_set = routed_top_k(read_config(model_dir))
    assert sum(s.loads for s in prefill) > routed_set + 1  # more than one bankful was read
    assert all(s.expert_pool_mib * 2**20 <= budget for s in steps)


def _generate_with(model_dir, prompt, **config) -> tuple[list[int], list]:
    engine = Engine(model_dir, EngineConfig(**config))
    try:
        result = engine.generate(prompt, GREEDY)
        return result.tokens, result.steps
    finally:
        engine.close()

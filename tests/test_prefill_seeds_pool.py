"""A prompt's whole-layer reads seed the expert pool (`experts/prefill_seed.py`): the prompt's
last token, the first one-token forward, finds its experts resident instead of reading them
again, so a prompt and its first token read each expert about once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint.index import CheckpointIndex
from engine.config import EngineConfig, GenerationConfig
from engine.experts.prefill_seed import HALF_LIFE, by_recent_use
from engine.runtime.generation import Engine

DEMO = Path(__file__).resolve().parent.parent / "assets" / "demo"
PROMPT = [(i * 37 + 5) % 900 + 3 for i in range(96)]
ONE_TOKEN = GenerationConfig(max_tokens=1, temperature=0.0)


def _model(checkpoint_dir, name: str) -> Path:
    return DEMO if name == "demo" else checkpoint_dir(name)


def _expert_layers(model: Path) -> dict:
    index = CheckpointIndex(model)
    index.add_moe_layers_by_name()
    return index.layers


@pytest.mark.parametrize("name", ["demo", "gpt_oss"])
def test_a_prompt_and_its_first_token_read_each_expert_once(checkpoint_dir, name):
    """A cache of most of the model (too small to hold every layer): the prompt reads its layers
    whole, and the first token then reads (almost) nothing; before, it read its routed set again."""
    model = _model(checkpoint_dir, name)
    layers = _expert_layers(model)
    expert_bytes = sum(layer.nbytes for layer in layers.values())
    one_expert = max(layer.expert_nbytes for layer in layers.values())
    config = EngineConfig(mode="on-demand", expert_cache_bytes=expert_bytes * 3 // 4)
    with Engine(model, config) as engine:
        result = engine.generate(PROMPT, ONE_TOKEN)
    prompt, first = result.steps
    assert prompt.whole_layer_reads == len(layers)
    read = round((prompt.mib_read + first.mib_read) * 2**20)
    # Before, the first token read its whole routed set again (K experts a layer); now at most
    # half of it: those outside the layer's share of the cache, or that no prompt token routed to.
    routed_set = first.loads + first.hits
    assert read <= expert_bytes + routed_set // 2 * one_expert, (read, expert_bytes)
    assert first.hits > first.loads


def test_a_small_cache_keeps_each_layers_share(checkpoint_dir):
    """A cache of a quarter of the model: each layer keeps its share, the budget holds, and the
    first token finds some of its experts (before: none, the pool was empty)."""
    model = checkpoint_dir("gpt_oss")
    quarter = sum(layer.nbytes for layer in _expert_layers(model).values()) // 4
    config = EngineConfig(mode="on-demand", whole_layer_prefill=True, expert_cache_bytes=quarter)
    with Engine(model, config) as engine:
        result = engine.generate(PROMPT, ONE_TOKEN)
        pool = engine.store.pool
        assert pool.resident_bytes <= pool.budget_bytes
        layers = {key[0] for key in pool.keys()}
    assert len(layers) == len(engine.store.index.layers)  # every layer kept its share
    assert result.steps[-1].hits > 0


def test_recent_uses_count_most():
    # Experts 1 and 7 used at every one of 40 positions but the last, 3 and 4 only at the last:
    # used all along counts more than once at the end.
    routed = np.array([[[7, 1]] * 39 + [[3, 4]]])  # [batch, tokens, k]
    assert by_recent_use(routed) == [1, 7, 3, 4]
    # ... and 9 used once, HALF_LIFE positions before the end of each row: after the last ones.
    late = np.zeros((2, HALF_LIFE + 1, 1), dtype=np.int64) + 5
    late[:, 0, 0] = 9
    assert by_recent_use(late) == [5, 9]

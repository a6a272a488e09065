"""The numerical guard repairs NaN in a layer's output, counts it, and keeps generation sane."""

from __future__ import annotations

from nan_once import NaNOnce

from engine.config import EngineConfig, GenerationConfig
from engine.runtime.generation import Engine


def _poisoned_run(model_dir, guard: bool):
    engine = Engine(model_dir, EngineConfig(mode="on-demand", hidden_guard=guard))
    try:
        layer = engine.model.layers[1]
        layer.self_attn = NaNOnce(layer.self_attn, poison_call=4)  # the 3rd decode step
        return engine.generate([5, 6, 7], GenerationConfig(max_tokens=12))
    finally:
        engine.close()


def test_nan_is_repaired_and_counted(checkpoint_dir):
    model_dir = checkpoint_dir("qwen3_moe")
    result = _poisoned_run(model_dir, guard=True)
    counts = [s.nonfinite_repaired for s in result.steps]
    assert sum(counts) > 0 and result.summary["nonfinite_repaired"] == sum(counts)
    assert counts.index(next(c for c in counts if c)) == 3  # prefill chunk, first token, 2 decode
    tokens_after = result.tokens[4:]
    assert len(set(tokens_after)) > 1  # not the collapse into one repeated token

    unguarded = _poisoned_run(model_dir, guard=False)
    # Without the guard the NaN reaches the logits and the KV cache: every later token is the
    # argmax of NaN logits.
    assert len(set(unguarded.tokens[4:])) == 1

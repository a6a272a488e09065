"""The wrap head: the first MoE layer's experts read a token ahead, its routing untouched.

Nothing before the first MoE layer can predict it a whole token ahead, so without the wrap head
every miss there blocks the forward. The wrap head (owned by a late layer, predicting the first
MoE layer at token t+1) only starts reads: the first layer still routes by its own router."""

from __future__ import annotations

import shutil

import pytest
from adapters import write_random_profile
from safetensors.numpy import load_file, save_file

from engine.checkpoint.index import read_safetensors
from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.routing.prerouter import load_prerouter
from engine.runtime.generation import Engine

GREEDY = GenerationConfig(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 13, 17]


@pytest.fixture
def profiles(checkpoint_dir, tmp_path):
    """Two copies of the tiny checkpoint with the same random K=4 profile, one with a wrap head
    owned by the second-to-last MoE layer."""
    dirs = {}
    for name, wrap_owner in (("plain", None), ("wrapped", -2)):
        dirs[name] = tmp_path / name
        shutil.copytree(checkpoint_dir("qwen3_moe"), dirs[name])
        write_random_profile(dirs[name], 4, seed=3, wrap_owner=wrap_owner)
    return dirs


def _generate(model_dir, **config):
    # Room for a step's experts and the next one's reads ahead (32 of the 64), not for all.
    engine = Engine(model_dir, EngineConfig(k=4, expert_cache_bytes=32 * 7680, **config))
    try:
        heads = engine.routing.heads
        return engine.generate(PROMPT, GREEDY), heads
    finally:
        engine.close()


def test_the_wrap_head_reads_the_first_layer_ahead_and_changes_no_token(profiles):
    plain, plain_heads = _generate(profiles["plain"], mode="prerouter")
    wrapped, heads = _generate(profiles["wrapped"], mode="prerouter")
    moe_layers = sorted({*heads.owners, *heads.consumers})
    assert plain_heads.wrap is None
    assert heads.wrap.owners == [moe_layers[-2]] and heads.wrap.consumers == [moe_layers[0]]
    assert wrapped.tokens == plain.tokens
    decode = [s for s in wrapped.steps if s.phase == "decode"]
    plain_decode = [s for s in plain.steps if s.phase == "decode"]
    # The first layer is not routed by the prediction: the same layers are, nothing is dropped.
    assert [s.predicted for s in decode] == [s.predicted for s in plain_decode]
    assert wrapped.summary["dropped"] == 0
    # Its reads ahead are made, and each step says how many of its routed experts they covered.
    assert sum(s.prefetch_issued for s in decode) > sum(s.prefetch_issued for s in plain_decode)
    assert all(s.prefetch_hit_rate is not None for s in decode)
    assert all(s.prefetch_hit_rate is None for s in plain_decode)


def test_prefetch_mode_reads_the_wrap_prediction_ahead_too(profiles):
    on_demand, _ = _generate(profiles["wrapped"], mode="on-demand")
    prefetch, _ = _generate(profiles["wrapped"], mode="prefetch")
    plain, _ = _generate(profiles["plain"], mode="prefetch")
    assert prefetch.tokens == on_demand.tokens
    decode = [s for s in prefetch.steps if s.phase == "decode"]
    plain_decode = [s for s in plain.steps if s.phase == "decode"]
    assert sum(s.prefetch_issued for s in decode) > sum(s.prefetch_issued for s in plain_decode)


def test_a_wrap_head_that_does_not_fit_is_explained(profiles, tmp_path):
    source = profiles["wrapped"] / "prerouter_k4.safetensors"
    tensors = load_file(source)
    _, metadata = read_safetensors(source)
    engine = Engine(profiles["wrapped"], EngineConfig(mode="on-demand"))
    try:
        loaded = engine.loaded
        args = (loaded.num_layers, loaded.hidden, loaded.num_experts, engine.fingerprint)
        assert load_prerouter(source, *args).wrap is not None

        def refused(name: str, change) -> str:
            path = tmp_path / name
            tensors_copy, meta = dict(tensors), dict(metadata)
            change(tensors_copy, meta)
            save_file(tensors_copy, path, metadata=meta)
            with pytest.raises(Edge0Error) as error:
                load_prerouter(path, *args)
            assert str(path) in str(error.value)
            return str(error.value)

        def no_owner(t, m):
            del m["wrap_owner"]

        def no_tensors(t, m):
            for part in ("fc1", "fc2", "linear_init"):
                del t[f"wrap.{part}.weight"]

        def owner_outside(t, m):
            m["wrap_owner"] = "99"

        def narrow(t, m):
            t["wrap.fc1.weight"] = t["wrap.fc1.weight"][:, :-1]

        def lacks_fc2(t, m):
            del t["wrap.fc2.weight"]

        assert "wrap_owner metadata" in refused("no-owner.safetensors", no_owner)
        assert "wrap.* tensors" in refused("no-tensors.safetensors", no_tensors)
        assert "wrap_owner 99 is outside" in refused("outside.safetensors", owner_outside)
        assert "fc1 of the wrap head of shape" in refused("narrow.safetensors", narrow)
        assert "the wrap head lacks fc2" in refused("lacks.safetensors", lacks_fc2)
    finally:
        engine.close()

"""The prerouter: head maths, prediction as routing, nothing dropped, reset, LoRA, K switching."""

from __future__ import annotations

import json
import math
import shutil
import time

import mlx.core as mx
import numpy as np
import pytest
from adapters import profile_k, write_random_profile

from engine.adapters.lora import LoRALinear
from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.routing.functions import route
from engine.routing.prerouter import PrerouterHeads, load_prerouter
from engine.runtime.generation import Engine

# Past EOS: a random model may end its reply at once, and these tests look at decode steps.
GREEDY = GenerationConfig(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def profiled_originals(checkpoint_dir, tmp_path_factory):
    """`get(family, ks)`: the tiny checkpoint with random adapters for each K, written once a
    module (the adapters are seeded: every copy of it is what each test wrote for itself)."""
    root = tmp_path_factory.mktemp("profiled")
    made = {}

    def get(family: str, ks: tuple[int, ...]):
        if (family, ks) not in made:
            model_dir = root / f"{family}-k{'-'.join(map(str, ks))}"
            shutil.copytree(checkpoint_dir(family), model_dir)
            for i, k in enumerate(ks):
                write_random_profile(model_dir, k, seed=i)
            made[family, ks] = model_dir
        return made[family, ks]

    return get


@pytest.fixture
def profiled(profiled_originals, tmp_path):
    """`profiled(family, ks)`: a copy of its own (tests change the files) of the tiny checkpoint
    with random adapters for each K."""

    def make(family: str = "qwen3_moe", ks=(4,)):
        model_dir = tmp_path / f"{family}-profiled"
        ks = tuple(profile_k(family, k) for k in ks)
        if not model_dir.exists():
            shutil.copytree(profiled_originals(family, ks), model_dir)
        return model_dir

    return make


def test_head_maths_matches_numpy():
    rng = np.random.default_rng(0)
    n, inner, e, h = 3, 8, 6, 10
    width = h + 2 * e
    fc1, fc2, lin = (
        rng.normal(size=s).astype(np.float32)
        for s in [(n, inner, width), (n, e, inner), (n, e, width)]
    )
    z = rng.normal(size=(n, width)).astype(np.float32)
    heads = PrerouterHeads(None, 2, [0, 1, 2], h, e, mx.array(fc1), mx.array(fc2), mx.array(lin))
    ours = np.array(heads(mx.array(z)))
    served = np.array(heads.prepare_for_serving(mx.float32)(mx.array(z)))  # transposed weights
    np.testing.assert_allclose(served, ours, rtol=1e-5, atol=1e-5)
    # The weights as stored stay readable (the student path, a save): views of the served copy.
    np.testing.assert_array_equal(np.array(heads.fc1), fc1)
    np.testing.assert_array_equal(np.array(heads.linear_init), lin)
    erf = np.vectorize(math.erf)
    for i in range(n):
        hidden = fc1[i] @ z[i]
        gelu = 0.5 * hidden * (1 + erf(hidden / math.sqrt(2)))
        expected = lin[i] @ z[i] + fc2[i] @ gelu
        np.testing.assert_allclose(ours[i], expected, rtol=1e-5, atol=1e-5)


def _run_recording(engine: Engine, prompt, steps: int, inject=None, ignore_eos: bool = False):
    """Generate, recording what each step's heads predicted (read with its token) and what each
    step's consumer layers executed. Returns the result and two lists in step order, the
    predictions of step s beside the routing executed at step s + 1."""
    predicted, executed = {}, {}
    state = engine.routing
    flush, settle, run = state.flush, state.settle, state.executed
    made_at = {}

    def recording_flush():
        out = flush()
        if out is not None:
            made_at[id(out)] = engine.store.pool.step
        return out

    def recording_settle(predictions, host):
        out = settle(predictions, host)
        predicted[made_at[id(predictions)]] = {layer: sorted(e) for layer, e in out.items()}
        return out

    def recording_executed(layer, x, routed):
        experts = sorted(np.array(routed).reshape(-1).tolist())
        executed.setdefault(engine.store.pool.step, {})[layer] = experts
        return run(layer, x, routed)

    state.flush, state.settle, state.executed = (
        recording_flush,
        recording_settle,
        recording_executed,
    )
    if inject is not None:
        state.heads = inject(state.heads)
    result = engine.generate(prompt, GenerationConfig(max_tokens=steps, ignore_eos=ignore_eos))
    pairs = [(predicted[s], executed[s + 1]) for s in sorted(predicted) if s + 1 in executed]
    return result, [p for p, _ in pairs], [e for _, e in pairs]


def test_prediction_is_the_routing_and_nothing_is_dropped(profiled, family):
    model_dir = profiled(family)
    engine = Engine(model_dir, EngineConfig(mode="prerouter", expert_cache_bytes=60_000))
    try:
        # Past EOS: 32 decode steps whichever token a random model writes.
        result, predictions, executed = _run_recording(
            engine, [5, 9, 13, 17], steps=32, ignore_eos=True
        )
        consumers = sorted({layer for p in predictions for layer in p})
        assert consumers, "no consumer layers"
        assert len(result.tokens) >= 32
        # The heads of each step predicted the next step's routing (the first after prefill).
        for flushed, used in zip(predictions, executed, strict=True):
            for layer in consumers:
                assert flushed[layer] == used[layer]
        for step in result.steps[-len(result.tokens) :]:
            assert step.predicted == len(consumers)
            assert step.dropped == 0
        assert result.summary["dropped"] == 0
        decode = [s for s in result.steps if s.phase == "decode"]
        assert sum(s.prefetch_issued for s in decode) > 0
        # Every read ahead is used, or (this cache is smaller than a step's routed experts)
        # given up to make room for a layer's misses.
        assert sum(
            s.prefetch_in_time + s.prefetch_late + s.prefetch_given_up for s in decode
        ) == sum(s.prefetch_issued for s in decode)
    finally:
        engine.close()


def test_injected_logits_route_exactly(profiled, family):
    engine = Engine(profiled(family), EngineConfig(mode="prerouter", expert_cache_bytes=60_000))
    e = engine.loaded.num_experts
    calls = []

    class Injected:
        """Heads replaced by a fixed schedule of logits: step s favours experts s, s+1, ..."""

        def __init__(self, heads):
            self.__dict__.update(heads.__dict__)

        def __call__(self, z, first=0, end=None):
            # Step s's heads (built in step s, after the prefill's step 1) favour s - 1, ...
            s = engine.store.pool.step - 1
            calls.append(s)
            rows = range(len(self.owners))[first:end]
            logits = np.full((len(rows), e), -5.0, dtype=np.float32)
            for row, i in enumerate(rows):
                for j in range(6):
                    logits[row, (s + 3 * i + j) % e] = 5.0 - j
            # A head's logits for each sequence's row (features [owners, rows, in]).
            return mx.array(logits)[:, None, :] if z.ndim == 3 else mx.array(logits)

    try:
        result, predictions, executed = _run_recording(engine, [1, 2, 3], steps=16, inject=Injected)
        spec = next(iter(engine.loaded.blocks.values())).routing_spec
        owners = engine.routing.heads.owners
        for s, (flushed, used) in enumerate(zip(predictions, executed)):
            for i, owner in enumerate(owners):
                logits = np.full((e,), -5.0, dtype=np.float32)
                for j in range(6):
                    logits[(s + 3 * i + j) % e] = 5.0 - j
                bias = engine.loaded.blocks[owner + 1].expert_bias()
                inds, _ = route(mx.array(logits), spec, engine.k, bias)
                want = sorted(np.array(inds).tolist())
                assert flushed[owner + 1] == want
                assert used[owner + 1] == want
        assert result.summary["dropped"] == 0
    finally:
        engine.close()


def test_first_step_and_reset(profiled):
    model_dir = profiled("qwen3_moe")
    engine = Engine(model_dir, EngineConfig(mode="prerouter"))
    try:
        consumers = len(engine.routing.heads.owners)
        one = engine.generate([7], GREEDY)
        # A one-token prompt: step 1 routes with the true routers; predictions start after it.
        assert one.steps[0].predicted == 0 and one.steps[1].predicted == consumers
        # A longer prompt: step 1 already routes by predictions made at the last prefill position.
        first = engine.generate([3, 4, 5, 6], GREEDY)
        first_token_step = [s for s in first.steps if s.phase == "prefill"][-1]
        assert first_token_step.tokens == 1 and first_token_step.predicted == consumers
        second = engine.generate([8, 9, 10, 11], GREEDY)
    finally:
        engine.close()
    fresh = Engine(model_dir, EngineConfig(mode="prerouter"))
    try:
        # Request 2 in a used engine equals request 2 in a fresh one: nothing carried over.
        assert fresh.generate([8, 9, 10, 11], GREEDY).tokens == second.tokens
    finally:
        fresh.close()


def test_lora_zero_b_changes_nothing_and_random_matches_dense(profiled):
    model_dir = profiled("qwen3_moe")
    plain = Engine(model_dir, EngineConfig(mode="prerouter", lora=False))
    try:
        baseline = plain.generate([3, 4, 5], GREEDY).tokens
    finally:
        plain.close()

    # This test edits the LoRA behind the engine's back: no KV cache may outlive the edit.
    engine = Engine(model_dir, EngineConfig(mode="prerouter", reuse_prompt_cache=False))
    try:
        wrapped = [m for _, m in engine.model.named_modules() if isinstance(m, LoRALinear)]
        assert wrapped, "the profile's LoRA was not applied"
        # A random delta against a dense float64 reference.
        layer = wrapped[0]
        x = mx.random.normal((1, 3, layer.lora_a.shape[1]))
        expected = np.array(layer.base(x)).astype(np.float64) + layer.scale * (
            np.array(x).astype(np.float64) @ np.array(layer.lora_a).T.astype(np.float64)
        ) @ np.array(layer.lora_b).T.astype(np.float64)
        np.testing.assert_allclose(np.array(layer(x)), expected, rtol=1e-4, atol=1e-5)
        with_lora = engine.generate([3, 4, 5], GREEDY).tokens
        for module in wrapped:
            module.lora_b = mx.zeros_like(module.lora_b)
        zero_b = engine.generate([3, 4, 5], GREEDY).tokens
    finally:
        engine.close()
    assert zero_b == baseline
    assert with_lora != baseline  # the random delta does change the model


def test_k_switch_mid_conversation_equals_fresh_engine(profiled):
    model_dir = profiled("qwen3_moe", ks=(2, 4))
    history = [{"role": "user", "content": "hello there"}]
    engine = Engine(model_dir, EngineConfig(mode="prerouter", k=2))
    try:
        reply = engine.generate(engine.encode_chat(history), GREEDY)
        history += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "and then?"},
        ]
        start = time.perf_counter()
        engine.request_k(4)
        engine.apply_requests()  # what the next step does first
        swap_s = time.perf_counter() - start
        assert engine.k == 4 and engine.lora.adapter.k == 4
        second = engine.generate(engine.encode_chat(history), GREEDY)
        assert {s.k for s in second.steps} == {4}
    finally:
        engine.close()
    print(f"\nK=2 -> K=4 swap took {swap_s * 1e3:.1f} ms")
    assert swap_s < 1.0
    fresh = Engine(model_dir, EngineConfig(mode="prerouter", k=4))
    try:
        assert fresh.generate(fresh.encode_chat(history), GREEDY).tokens == second.tokens
    finally:
        fresh.close()


def test_k_request_between_steps_from_another_thread(profiled):
    import threading

    engine = Engine(profiled("qwen3_moe", ks=(2, 4)), EngineConfig(mode="prerouter", k=4))
    try:
        switched = threading.Event()
        reply = engine.stream([1, 2, 3], GenerationConfig(max_tokens=20))
        for token in reply:
            if token.step.phase == "decode" and not switched.is_set():
                threading.Thread(target=engine.request_k, args=(2,)).start()
                switched.set()
        result = reply.result
        ks = [s.k for s in result.steps]
        assert ks[0] == 4 and ks[-1] == 2
        assert ks == sorted(ks, reverse=True)  # 4 until the request, 2 after
        assert result.summary["dropped"] == 0
    finally:
        engine.close()


def test_mode_switch_and_on_demand_uses_no_predictions(profiled):
    engine = Engine(profiled("qwen3_moe"), EngineConfig(mode="on-demand"))
    try:
        assert engine.modes() == ["on-demand", "prerouter", "prefetch"]
        result = engine.generate([1, 2, 3], GREEDY)
        assert all(s.predicted == 0 and s.prefetch_issued == 0 for s in result.steps)
        engine.request_mode("prerouter")
        result = engine.generate([1, 2, 3], GREEDY)
        assert engine.mode == "prerouter" and max(s.predicted for s in result.steps) > 0
    finally:
        engine.close()


def test_shadow_router_reports_recall(profiled):
    engine = Engine(profiled("qwen3_moe"), EngineConfig(mode="prerouter", shadow_router=True))
    try:
        summary = engine.generate([1, 2, 3], GREEDY).summary
        assert 0.0 <= summary["shadow_recall"] <= 1.0
    finally:
        engine.close()


# -- files from elsewhere ---------------------------------------------------------------------------


def test_reference_format_nested_metadata_and_keys(profiled, tmp_path):
    model_dir = profiled("qwen3_moe")
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    loaded = engine.loaded
    engine.close()
    ours = mx.load(str(model_dir / "prerouter_k4.safetensors"))
    nested = {
        k.replace(".fc", ".mlp.prerouter.fc").replace(
            ".linear_init", ".mlp.prerouter.linear_init"
        ): v
        for k, v in ours.items()
    }
    owners = sorted({int(k.split(".")[1]) for k in ours})
    path = tmp_path / "prerouter_edge0_tiny.safetensors"
    meta = {"__metadata__": json.dumps({"source": "x.npz", "K": 4, "owners": owners})}
    mx.save_safetensors(str(path), nested, metadata=meta)
    heads = load_prerouter(path, loaded.num_layers, loaded.hidden, loaded.num_experts, "any")
    assert heads.owners == owners and heads.k == 4


def _loaded(model_dir):
    engine = Engine(model_dir, EngineConfig(mode="on-demand"))
    engine.close()
    return engine


def test_adapter_for_another_model_is_refused(profiled, checkpoint_dir, tmp_path):
    model_dir = profiled("qwen3_moe")
    other = tmp_path / "other"
    shutil.copytree(checkpoint_dir("qwen3_moe"), other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # any change to config.json is another base
    (other / "config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "prerouter_k4.safetensors", other)
    with pytest.raises(Edge0Error, match="another base model"):
        Engine(other, EngineConfig(mode="prerouter"))


def test_bad_prerouter_files_are_explained(profiled, tmp_path):
    model_dir = profiled("qwen3_moe")
    loaded = _loaded(model_dir).loaded
    tensors = mx.load(str(model_dir / "prerouter_k4.safetensors"))
    args = (loaded.num_layers, loaded.hidden, loaded.num_experts, "any")

    outside = {k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()}
    mx.save_safetensors(str(tmp_path / "a.safetensors"), outside)
    with pytest.raises(Edge0Error, match="outside"):
        load_prerouter(tmp_path / "a.safetensors", *args)

    mx.save_safetensors(str(tmp_path / "b.safetensors"), tensors, metadata={"K": "8"})
    with pytest.raises(Edge0Error, match="K=8"):
        load_prerouter(tmp_path / "b.safetensors", *args, k=4)

    narrow = {k: (v[:, :-3] if "fc1" in k or "linear_init" in k else v) for k, v in tensors.items()}
    mx.save_safetensors(str(tmp_path / "c.safetensors"), narrow)
    with pytest.raises(Edge0Error, match="does not fit"):
        load_prerouter(tmp_path / "c.safetensors", *args)


def test_missing_lora_target_is_named(profiled):
    model_dir = profiled("qwen3_moe")
    tensors = mx.load(str(model_dir / "lora_k4.safetensors"))
    module = next(iter(tensors)).rsplit(".", 1)[0]
    for part in ("lora_A", "lora_B"):
        renamed = f"{module}.{part}".replace("self_attn", "cross_attn")
        tensors[renamed] = tensors.pop(f"{module}.{part}")
    mx.save_safetensors(str(model_dir / "lora_k4.safetensors"), tensors)
    with pytest.raises(Edge0Error, match="does not exist in this model"):
        Engine(model_dir, EngineConfig(mode="prerouter"))
    assert Engine(model_dir, EngineConfig(mode="prerouter", lora=False)).lora is None


def test_owner_that_is_not_a_moe_layer_is_refused(profiled):
    # bailing_moe's layer 0 is dense: a head owned by it has no routed experts to one-hot, and
    # flushing would wait for it forever (no predictions at all). It is refused by name.
    model_dir = profiled("bailing_moe")
    tensors = mx.load(str(model_dir / "prerouter_k4.safetensors"))
    first = min(int(k.split(".")[1]) for k in tensors)
    for part in ("fc1", "fc2", "linear_init"):
        tensors[f"layers.0.{part}.weight"] = tensors[f"layers.{first}.{part}.weight"]
    mx.save_safetensors(str(model_dir / "prerouter_k4.safetensors"), tensors)
    with pytest.raises(Edge0Error, match=r"owner layers \[0\] are not MoE layers"):
        Engine(model_dir, EngineConfig(mode="prerouter"))


def test_pending_request_is_visible_until_applied(profiled):
    engine = Engine(profiled("qwen3_moe", ks=(2, 4)), EngineConfig(mode="on-demand"))
    try:
        assert engine.pending == (4, "on-demand")
        profile = engine.request_mode("prerouter")
        assert profile.prerouter and engine.pending == (profile.k, "prerouter")
        assert engine.mode == "on-demand"  # applied only before the next step
        engine.generate([1, 2, 3], GenerationConfig(max_tokens=2))
        assert (engine.k, engine.mode) == engine.pending == (profile.k, "prerouter")
    finally:
        engine.close()


def _cache_for(model_dir, first_layer_whole: bool) -> int:
    """An expert cache that holds the first MoE layer whole and one routed set of each other
    layer, or (not `first_layer_whole`) one expert less: more than a routed set of every
    layer, but the first layer is not held."""
    engine = Engine(model_dir, EngineConfig(mode="prerouter"))
    try:
        layers, first = sorted(engine.store.index.layers), min(engine.store.index.layers)
        experts = engine.store.index.layers[first].num_experts + engine.k * (len(layers) - 1)
        return (experts - (not first_layer_whole)) * engine.store.resident_expert_nbytes(first)
    finally:
        engine.close()


def _record_stages_and_reads(engine: Engine) -> list[tuple]:
    """From now on: ("stage", layer) for each read ahead staged, ("read", why) for each host read."""
    events = []
    store, reads = engine.store, engine.host_reads
    stage, read = store.stage, reads.read

    def recording_stage(layer, experts):
        events.append(("stage", layer))
        return stage(layer, experts)

    def recording_read(arrays, why, also=None):
        events.append(("read", why))
        return read(arrays, why, also)

    store.stage, reads.read = recording_stage, recording_read
    return events


def test_a_decode_step_waits_on_the_device_once_and_reads_ahead_after_it(profiled):
    """Prerouter: every head runs on the device in the step's graph; its predictions come back
    with the token in the step's one host read, and the next step's reads ahead start right
    after it. Consumers route by their prediction with no read of their own: a step waits on
    the device once, with the self-routed first layer held (its routing stays on the device),
    and twice where the cache cannot hold it (its routing is read back). A cache too small for
    a step's routed experts adds waits for slots (not here). The prediction is still the
    routing."""
    model_dir = profiled("qwen3_moe")
    for first_whole, held, syncs in ((True, {0}, 1), (False, set(), 2)):
        cache = _cache_for(model_dir, first_whole)
        engine = Engine(model_dir, EngineConfig(mode="prerouter", expert_cache_bytes=cache))
        try:
            events = _record_stages_and_reads(engine)
            result, predictions, executed = _run_recording(engine, [5, 9, 13, 17], steps=12)
            assert engine.store.pool.held_layers == held
            owners = engine.routing.heads.owners
        finally:
            engine.close()
        decode = [s for s in result.steps if s.phase == "decode"]
        assert len(decode) >= 8
        assert all(s.host_syncs == syncs for s in decode)
        # After each step's read of its token, every consumer's reads for the next step are
        # staged, and nothing is staged before a step's read.
        reads_of_token = [i for i, e in enumerate(events) if e[0] == "read" and "token" in e[1]]
        for first, after in zip(reads_of_token, reads_of_token[1:]):
            staged = [e[1] for e in events[first:after] if e[0] == "stage"]
            assert sorted(staged) == sorted(o + 1 for o in owners)
        for flushed, used in zip(predictions, executed, strict=True):
            for owner in owners:
                assert flushed[owner + 1] == used[owner + 1]
        assert result.summary["dropped"] == 0


def test_prefetch_reads_predictions_ahead_and_keeps_the_true_routing(profiled, family):
    """Prefetch mode: the heads' predictions are only read ahead; every layer routes by its own
    router, so the tokens are the on-demand tokens, and the steps say how many routed experts
    had been read ahead."""
    model_dir = profiled(family)
    tokens = {}
    for mode in ("on-demand", "prefetch"):
        k = profile_k(family)
        engine = Engine(
            model_dir,
            EngineConfig(mode=mode, k=k, expert_cache_bytes=60_000, prefetch_min_expert_bytes=0),
        )
        try:
            assert "prefetch" in engine.modes()
            result = engine.generate([5, 9, 13, 17], GREEDY)
        finally:
            engine.close()
        tokens[mode] = result.tokens
        decode = [s for s in result.steps if s.phase == "decode"]
        if mode == "prefetch":
            assert all(s.predicted == 0 for s in decode)  # nothing routed by a prediction
            assert sum(s.prefetch_issued for s in decode) > 0
            rates = [s.prefetch_hit_rate for s in decode]
            assert all(r is not None and 0.0 <= r <= 1.0 for r in rates)
            assert 0.0 <= result.summary["prefetch_hit_rate"] <= 1.0
            issued = sum(s.prefetch_issued for s in decode)
            assert sum(s.prefetch_in_time + s.prefetch_late for s in decode) <= issued
    assert len(tokens["on-demand"]) >= 8
    assert tokens["prefetch"] == tokens["on-demand"]


def test_prefetch_drops_reads_ahead_its_step_did_not_use(profiled):
    """In prefetch mode the true router routes, so a mispredicted expert's read ahead is never
    used: it is dropped when the step it was for ends. (Kept until the request ended, such reads
    held 2.5 MiB each outside the pool's budget and a 384 MiB wall was killed in a few steps.)"""
    engine = Engine(
        profiled("qwen3_moe"),
        EngineConfig(mode="prefetch", k=4, expert_cache_bytes=60_000, prefetch_min_expert_bytes=0),
    )
    store = engine.store
    held_after_step = []
    end_step = store.end_step

    def recording_end_step():
        counters = end_step()
        # What stays staged is only what was issued for the next step (its predictions, and
        # its first layer's guesses).
        held = sum(store.pool.is_read_ahead(key) for key in _all_experts(store))
        step = store.pool.step + 1
        next_step = store.ledger.issued(step, "heads") + store.ledger.issued(step, "lookahead")
        held_after_step.append((held, next_step))
        return counters

    store.end_step = recording_end_step
    try:
        result = engine.generate([5, 9, 13, 17], GenerationConfig(max_tokens=16))
    finally:
        engine.close()
    decode = [s for s in result.steps if s.phase == "decode"]
    issued = sum(s.prefetch_issued for s in decode)
    used = sum(s.prefetch_in_time + s.prefetch_late for s in decode)
    assert used < issued  # the heads mispredict, so some reads ahead go unused
    assert all(held <= next_step for held, next_step in held_after_step)


def _all_experts(store) -> list[tuple[int, int]]:
    return [(n, e) for n, layer in store.index.layers.items() for e in range(layer.num_experts)]


TWELVE_TOKENS = GenerationConfig(max_tokens=12)


@pytest.mark.parametrize("mode", ["prerouter", "prefetch"])
def test_reads_ahead_stay_inside_the_expert_cache_budget(profiled, mode):
    """A read ahead reserves its expert's bytes in the pool when it is issued: resident experts
    and reads in flight together stay within --expert-cache (they used to sit outside it, and the
    prefetch arm of a 384 MiB wall was killed for it). The slot bank they live in is the budget."""
    budget = 200_000  # two steps' predicted sets of the tiny model, a quarter of its experts
    engine = Engine(
        profiled("qwen3_moe"),
        EngineConfig(mode=mode, k=4, expert_cache_bytes=budget, prefetch_min_expert_bytes=0),
    )
    store, pool = engine.store, engine.store.pool
    seen = []
    stage = store.stage

    def checked_stage(layer, experts):
        stage(layer, experts)
        seen.append((pool.resident_bytes, pool.reserved_bytes))
        assert pool.resident_bytes + pool.reserved_bytes <= pool.budget_bytes
        assert store.bank(layer).nbytes <= pool.budget_bytes

    store.stage = checked_stage
    try:
        result = engine.generate([5, 9, 13, 17], TWELVE_TOKENS)
    finally:
        engine.close()
    assert sum(s.prefetch_issued for s in result.steps) > 0
    assert max(reserved for _, reserved in seen) > 0
    assert pool.reserved_bytes == 0  # every promise was taken back when the request ended

    # A budget below one step's reads ahead: some are not made ahead, none goes over it.
    small = Engine(
        profiled("qwen3_moe"),
        EngineConfig(mode=mode, k=4, expert_cache_bytes=60_000, prefetch_min_expert_bytes=0),
    )
    store, pool = small.store, small.store.pool
    stage = store.stage
    store.stage = checked_stage
    try:
        tokens = small.generate([5, 9, 13, 17], TWELVE_TOKENS).tokens
    finally:
        small.close()
    if mode == "prefetch":  # the reads ahead never change the tokens
        assert tokens == result.tokens


def test_prefetch_hit_rate_is_the_overlap_of_reads_ahead_and_routing(profiled):
    """The hit rate a step reports is the share of the experts its consumer layers' routers chose
    that the previous flush had predicted (and so read ahead)."""
    engine = Engine(
        profiled("qwen3_moe"),
        # A cache that cannot hold every expert: held layers read nothing ahead.
        EngineConfig(mode="prefetch", k=4, prefetch_min_expert_bytes=0, expert_cache_bytes=60_000),
    )
    try:
        result, staged_sets, chosen_sets = _run_recording(engine, [1, 2, 3], steps=8)
    finally:
        engine.close()
    decode = [s for s in result.steps if s.phase == "decode"]
    # The prompt's chunk predicted the forward on the last prompt token, which produced token
    # 0; that forward's heads predicted decode step 0, and so on.
    assert len(decode) >= 4
    for step, staged, chosen in zip(decode, staged_sets[1:], chosen_sets[1:], strict=True):
        hits = sum(len(set(staged[layer]) & set(chosen[layer])) for layer in staged)
        routed = sum(len(set(chosen[layer])) for layer in staged)
        assert step.prefetch_hit_rate == hits / routed


def test_a_switch_whose_files_cannot_be_read_keeps_the_profile_that_stood(profiled):
    model_dir = profiled("qwen3_moe", ks=(2, 4))
    engine = Engine(model_dir, EngineConfig(mode="prerouter", k=2))
    try:
        (model_dir / "lora_k4.safetensors").write_bytes(b"not a safetensors file")
        engine.request_k(4)
        with pytest.raises(Edge0Error, match="lora_k4"):
            engine.apply_requests()
        # Nothing half-applied: the K=2 heads and LoRA still route and run.
        assert engine.k == 2 and engine.lora is not None and engine.lora.adapter.k == 2
        assert {s.k for s in engine.generate([11, 400, 97], GREEDY).steps} == {2}
    finally:
        engine.close()


def test_served_heads_are_held_once(profiled):
    """The engine's heads are in memory once (transposed for serving), not twice: the second
    copy was 223 MiB on the 7 GB preset, which no plan counted."""
    model_dir = profiled("qwen3_moe")
    k = profile_k("qwen3_moe")
    with Engine(model_dir, EngineConfig(mode="on-demand")) as engine:
        before = mx.get_active_memory()
        heads = engine.loaded.load_heads(
            model_dir / f"prerouter_k{k}.safetensors", engine.fingerprint, k
        )
        held = mx.get_active_memory() - before
        one_copy = sum(a.nbytes for a in (heads.fc1, heads.fc2, heads.linear_init))
        assert 0 < held < 1.5 * one_copy, (held, one_copy)  # (allocations round up a little)


def test_the_plan_holds_the_largest_profiles_heads_and_lora(checkpoint_dir, tmp_path):
    """A model with K profiles plans their files' memory (the largest profile's heads and LoRA,
    from the headers); switching to one loads exactly that (heads once, the LoRA once in the
    compute dtype: each was held twice). No profile: no term. (The small preset: on the tiny
    one, allocations rounding up are a few % of its arrays.)"""
    with Engine(checkpoint_dir("qwen3_moe"), EngineConfig(mode="on-demand")) as bare:
        assert bare.memory_plan.adapter_bytes == 0
        assert not any(name.startswith("adapters") for name, _ in bare.memory_plan.terms())
    model_dir = tmp_path / "small"
    shutil.copytree(checkpoint_dir("qwen3_moe", "small"), model_dir)
    k = profile_k("qwen3_moe")
    write_random_profile(model_dir, k)
    with Engine(model_dir, EngineConfig(mode="on-demand")) as engine:
        term = engine.memory_plan.adapter_bytes
        files = [model_dir / f"{kind}_k{k}.safetensors" for kind in ("prerouter", "lora")]
        elements = sum(a.size for path in files for a in mx.load(str(path)).values())
        assert term == 4 * elements  # float32 on the CPU
        assert ("adapters (largest K profile)", term) in engine.memory_plan.terms()
        assert engine.memory_plan.as_dict()["adapter_bytes"] == term
        # No freed buffer to reuse: one larger than asked would count its whole size.
        mx.clear_cache()
        before = mx.get_active_memory()
        engine.request_mode("prerouter")
        engine.apply_requests()
        assert engine.mode == "prerouter" and engine.lora is not None
        assert 0 < mx.get_active_memory() - before <= term


def test_a_prerouter_run_plans_at_the_k_it_runs(profiled, checkpoint_dir):
    """K is chosen before the load (`chosen_k`): a prerouter run without a K starts at its
    heads' K and its memory plan is made at that K, not at the native one and then switched.
    A mode without heads says so before any weight is read."""
    model_dir = profiled("qwen3_moe", ks=(2,))
    with Engine(model_dir, EngineConfig(mode="on-demand")) as native:
        native_k = native.k
    assert native_k != 2
    with Engine(model_dir, EngineConfig(mode="prerouter")) as engine:
        assert engine.k == engine.loaded.k == 2
        assert engine.loaded.memory_plan.k == engine.memory_plan.k == 2
        assert engine.loaded.memory_plan == engine.loaded.plan_at(2)
    with pytest.raises(Edge0Error, match="prerouter mode needs prerouter_k"):
        Engine(checkpoint_dir("qwen3_moe"), EngineConfig(mode="prerouter"))

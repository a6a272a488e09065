"""Phase 1 through the streaming engine: traces equal the resident model's, they go to disk window
by window (memory does not grow with the text), and both stages resume where they stopped."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from edge0_tui.cli import main
from engine.config import EngineConfig
from engine.runtime.loader import load
from engine.train.collect import TraceFiles, collect_traces, token_windows
from engine.train.heads import (
    TrainHeadsConfig,
    batch,
    fit_heads,
    init_heads,
    routing_of,
)

WINDOW, WINDOWS = 16, 6


def _windows(seed: int = 0) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(3, 1000, size=WINDOW * WINDOWS)
    return token_windows(tokens, WINDOW)


def _load(model_dir, mode: str):
    # A cache that holds one layer's routed set only: streaming evicts inside every window.
    return load(model_dir, EngineConfig(mode=mode, expert_cache_bytes=64 * 1024))


def _arrays(traces: TraceFiles) -> dict[str, np.ndarray]:
    out = {}
    for layer in traces.shape.layers:
        out[f"x_{layer}"] = traces.read("x", layer, slice(None))
        out[f"logits_{layer}"] = traces.read("logits", layer, slice(None))
    return out


def _collect(model_dir, mode, folder, windows=None, on_window=None) -> TraceFiles:
    loaded = _load(model_dir, mode)
    try:
        return collect_traces(
            loaded, _windows() if windows is None else windows, folder, None, on_window
        )
    finally:
        if loaded.store is not None:
            loaded.store.close()


def _fit(model_dir, traces, state_dir, config, on_step=None):
    loaded = _load(model_dir, "resident")
    layers = traces.shape.layers
    owners = [n for n in layers if n + 1 in layers]
    heads = init_heads(loaded, owners, config.k, config.inner, config.seed)
    routing = routing_of(loaded, config.k)
    return fit_heads(
        traces,
        owners,
        routing,
        heads,
        config,
        state_dir,
        "fp",
        1,
        lambda line: None,
        False,
        on_step,
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "bailing_moe"])
def test_streamed_traces_equal_resident_and_train_the_same_heads(checkpoint_dir, tmp_path, family):
    model_dir = checkpoint_dir(family)
    resident = _collect(model_dir, "resident", tmp_path / "resident")
    streamed = _collect(model_dir, "on-demand", tmp_path / "streamed")
    assert resident.complete and streamed.complete
    a, b = _arrays(resident), _arrays(streamed)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert any(np.abs(v).max() > 0 for v in a.values())  # something was recorded

    config = TrainHeadsConfig(k=2, inner=32, steps=4, batch=32, checkpoint_every=2)
    one = _fit(model_dir, resident, tmp_path / "state-resident", config)
    two = _fit(model_dir, streamed, tmp_path / "state-streamed", config)
    for part in ("fc1", "fc2", "linear_init"):
        assert mx.array_equal(getattr(one, part), getattr(two, part)), part


def test_collection_writes_memmaps_window_by_window(checkpoint_dir, tmp_path):
    model_dir = checkpoint_dir("qwen3_moe")
    seen = []

    def on_window(index, captured):
        seen.append((index, {layer: (x.shape, lg.shape) for layer, (x, lg) in captured.items()}))

    traces = _collect(model_dir, "on-demand", tmp_path / "t", on_window=on_window)
    shape = traces.shape
    # In memory: one window of every layer at a time, whatever the number of windows.
    assert [i for i, _ in seen] == list(range(WINDOWS))
    for _, shapes in seen:
        assert shapes == {
            layer: ((WINDOW, shape.hidden), (WINDOW, shape.experts)) for layer in shape.layers
        }
    assert not any(isinstance(v, np.ndarray) for v in vars(traces).values())  # nothing kept
    # On disk: memory-mapped .npy arrays of the whole collection, x in float16, logits float32.
    for layer in shape.layers:
        x = np.load(tmp_path / "t" / f"x_{layer}.npy", mmap_mode="r")
        logits = np.load(tmp_path / "t" / f"logits_{layer}.npy", mmap_mode="r")
        assert x.shape == (WINDOWS, WINDOW, shape.hidden) and x.dtype == np.float16
        assert logits.shape == (WINDOWS, WINDOW, shape.experts) and logits.dtype == np.float32
    progress = json.loads((tmp_path / "t" / "progress.json").read_text())
    assert progress["windows_done"] == WINDOWS
    # A training batch has the batch's size, not the collection's.
    loaded = _load(model_dir, "resident")
    owners = [n for n in shape.layers if n + 1 in shape.layers]
    w, t = np.array([1, 2, 5]), np.array([0, 3, WINDOW - 2])
    z, y = batch(traces, owners, w, t, routing_of(loaded, 2))
    assert z.shape == (len(owners), 3, shape.hidden + 2 * shape.experts)
    assert y.shape == (len(owners), 3, shape.experts)
    # A window's first position has no previous top-K set: its one-hot is all zero.
    assert z[:, 0, shape.hidden + shape.experts :].sum().item() == 0
    assert z[:, 1, shape.hidden + shape.experts :].sum().item() == 2 * len(owners)


def test_collection_resumes_after_the_last_complete_window(checkpoint_dir, tmp_path):
    model_dir = checkpoint_dir("qwen3_moe")
    whole = _collect(model_dir, "on-demand", tmp_path / "whole")

    def stop_after_two(index, captured):
        if index == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _collect(model_dir, "on-demand", tmp_path / "stopped", on_window=stop_after_two)
    stopped = TraceFiles.open(tmp_path / "stopped")
    assert stopped.windows_done == 2 and not stopped.complete
    later = []
    resumed = _collect(
        model_dir, "on-demand", tmp_path / "stopped", on_window=lambda i, c: later.append(i)
    )
    assert later == list(range(2, WINDOWS))  # windows 0 and 1 were not run again
    a, b = _arrays(whole), _arrays(resumed)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # Other tokens are another collection: a fresh folder's worth, never mixed with this one.
    other = _collect(model_dir, "on-demand", tmp_path / "stopped", windows=_windows(seed=1))
    assert other.shape.key != whole.shape.key and other.complete


def test_training_resumes_from_the_saved_state(checkpoint_dir, tmp_path):
    model_dir = checkpoint_dir("qwen3_moe")
    traces = _collect(model_dir, "on-demand", tmp_path / "t")
    config = TrainHeadsConfig(k=2, inner=32, steps=6, batch=32, checkpoint_every=2)
    whole = _fit(model_dir, traces, tmp_path / "whole", config)

    def stop_at_three(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _fit(model_dir, traces, tmp_path / "stopped", config, on_step=stop_at_three)
    saved = json.loads((tmp_path / "stopped" / "checkpoint.json").read_text())
    assert saved["step"] == 2
    steps = []
    resumed = _fit(model_dir, traces, tmp_path / "stopped", config, on_step=steps.append)
    assert steps == [3, 4, 5, 6]
    for part in ("fc1", "fc2", "linear_init"):
        assert mx.array_equal(getattr(whole, part), getattr(resumed, part)), part


def test_cli_train_heads_default_corpus_into_the_auto_folder(
    checkpoint_dir, tmp_path, monkeypatch, capsys
):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model_dir)
    data = tmp_path / "data"
    monkeypatch.setenv("EDGE0_DATA_DIR", str(data))
    args = ["train", "heads", str(model_dir), "--k", "2", "--steps", "4", "--max-tokens", "1500"]
    assert main(args + ["--expert-cache", "256K"]) == 0
    printed = capsys.readouterr().out
    assert "tokens the model wrote from" in printed and "held-out recall@2" in printed
    written = list(data.glob("adapters/*/prerouter_k2.safetensors"))
    assert len(written) == 1
    assert not list(model_dir.glob("prerouter_*")) and not (model_dir / "work").exists()
    assert list(written[0].parent.glob("work/traces-*/x_*.npy"))
    # The same command again: collection and training are already done, nothing is redone.
    assert main(args + ["--expert-cache", "256K"]) == 0
    again = capsys.readouterr()
    assert "resuming" in again.out
    assert "written before" in again.out and "the first reply" not in again.out  # text kept
    assert main(["info", str(model_dir)]) == 0
    assert f"K=2: prerouter (quality not recovered, auto folder: {written[0]})" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_layer_major_traces_equal_each_windows_own_forward_and_read_each_layer_once(
    checkpoint_dir, tmp_path, family
):
    """Issue 48 item 1: the collection runs every window through a layer before the next layer
    (each MoE layer read once for the pass, not once a window), and records what each window's
    own forward computes."""
    from engine.routing.moe_block import ops_for
    from engine.train.collect import FLOAT16_MAX, X_DTYPE, _Capture

    model_dir = checkpoint_dir(family)
    windows = _windows()
    loaded = load(model_dir, EngineConfig(mode="on-demand", whole_layer_prefill=True))
    try:
        traces = collect_traces(loaded, windows, tmp_path / "t")
        counters = loaded.store.counters  # the collection's one pass
        assert counters.whole_layer_reads == len(loaded.sites)
        expected = {}
        sinks = {site.layer: [] for site in loaded.sites}
        for site in loaded.sites:  # a window's own forward, its MoE blocks recorded
            block = getattr(site.decoder_layer, site.block_attribute)
            capture = _Capture(block, ops_for(loaded.family.name), sinks[site.layer])
            setattr(site.decoder_layer, site.block_attribute, capture)
        loaded.model(mx.array(windows[3])[None])
        for layer, [(x, logits)] in sinks.items():
            x = np.clip(np.array(x[0].astype(mx.float32)), -FLOAT16_MAX, FLOAT16_MAX)
            expected[layer] = (x.astype(X_DTYPE), np.array(logits[0].astype(mx.float32)))
    finally:
        loaded.store.close()
    written = traces.window(3)
    for layer, (x, logits) in expected.items():
        np.testing.assert_array_equal(written[layer][0], x, err_msg=f"x {layer}")
        np.testing.assert_array_equal(written[layer][1], logits, err_msg=f"logits {layer}")

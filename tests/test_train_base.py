"""Phase 0 (the demo teacher): corpus split, capacity-dispatch MoE, resumable training, export.

No download: the corpus functions take a directory, and the tests write a small fake one."""

from __future__ import annotations

import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.config import EngineConfig, GenerationConfig
from engine.errors import Edge0Error
from engine.runtime.generation import Engine
from engine.train import corpus
from engine.train.base import (
    LOSS_CSV,
    STATE_FILE,
    TrainBaseConfig,
    _read_curve,
    build_model,
    capacity_glu,
    held_out_perplexity,
    train_base,
)

WORDS = (
    "love thou art the sweet night my lord fair heaven what say you good speak not so "
    "and death is but a dream king queen crown sword gentle heart"
).split()
SPEAKERS = ("Kent.", "Lear.", "Fool.", "Regan.")

TINY = TrainBaseConfig(
    layers=2,
    hidden=64,
    heads=2,
    kv_heads=1,
    head_dim=32,
    experts=8,
    top_k=2,
    moe_int=64,
    vocab=320,
    seq_len=32,
    batch=4,
    chat_every=2,
    steps=8,
    lr=1e-2,
    min_lr=1e-3,
    warmup=2,
    save_every=4,
    eval_every=4,
    eval_windows=4,
)


def _fake_play(rng: np.random.Generator, speeches: int = 30) -> str:
    parts = ["THE TRAGEDY OF NOBODY\n\nby Nobody\n\n\n\nACT I.\n\n[Enter Kent.]"]
    for i in range(speeches):
        lines = [" ".join(rng.choice(WORDS, size=7)) for _ in range(int(rng.integers(1, 4)))]
        parts.append(SPEAKERS[i % len(SPEAKERS)] + "\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def texts_dir(tmp_path_factory):
    """40 fake works (`*_gut.txt`) and one folio copy that must be ignored."""
    root = tmp_path_factory.mktemp("texts")
    rng = np.random.default_rng(0)
    for i in range(40):
        (root / f"play_{i:02d}_gut.txt").write_text(_fake_play(rng))
    (root / "play_00_gut_f.txt").write_text("folio spelling, not a modern work\n")
    return root


def test_split_is_deterministic_and_held_out_never_trained(texts_dir):
    works = corpus.load_works(texts_dir)
    first, second = corpus.split_works(works), corpus.split_works(dict(reversed(works.items())))
    assert len(works) == 40 and "play_00" in works
    assert sorted(first.held_out) == sorted(second.held_out)
    assert len(first.held_out) == 2  # 5% of 40 works
    assert not set(first.held_out) & set(first.train)
    assert set(first.held_out) | set(first.train) == set(works)
    # No held-out speech appears in the chat exchanges built from the train split.
    held_speeches = {s for t in first.held_out.values() for s in corpus.speeches(t)}
    exchanges = "".join(e for t in first.train.values() for e in corpus.chat_exchanges(t))
    assert not any(s in exchanges for s in held_speeches if len(s) > 40)


def test_split_texts_are_written_for_the_training_phases(texts_dir, tmp_path):
    split = corpus.write_split_texts(tmp_path / "text", texts_dir)
    train = (tmp_path / "text" / "train.txt").read_text()
    held_out = (tmp_path / "text" / "held_out.txt").read_text()
    assert train == "\n\n".join(split.train.values())
    assert held_out == "\n\n".join(split.held_out.values())
    assert not any(work in train for work in split.held_out.values())


def test_clean_text_strips_gutenberg_framing():
    raw = (
        "The Project Gutenberg EBook of Hamlet\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***"
        "\r\n\r\nHam.\r\nTo be,   or not to be.\r\n\r\n\r\n\r\nThis etext is free.\r\n\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nlicence text\r\n"
    )
    assert corpus.clean_text(raw) == "Ham.\nTo be, or not to be.\n"


def test_fetch_offline_without_cache_is_a_clear_error(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(corpus.subprocess, "run", offline)
    with pytest.raises(Edge0Error, match="cannot download the demo corpus"):
        corpus.fetch_corpus(tmp_path)


def _dense_top_k_moe(block, x: mx.array) -> mx.array:
    """Reference: every expert on every token, weighted by the renormalized top-k gates."""
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-block.top_k, axis=-1)[..., -block.top_k :]
    picked = mx.take_along_axis(gates, inds, axis=-1)
    weights = mx.zeros_like(gates)
    weights = mx.put_along_axis(weights, inds, picked / picked.sum(-1, keepdims=True), axis=-1)
    glu = block.switch_mlp
    y = 0
    for e in range(block.num_experts):
        h = nn.silu(x @ glu.gate_proj.weight[e].T) * (x @ glu.up_proj.weight[e].T)
        y = y + weights[..., e : e + 1] * (h @ glu.down_proj.weight[e].T)
    return y


def test_capacity_dispatch_equals_dense_top_k_when_nothing_is_dropped():
    model = build_model(TINY)
    block = model.model.layers[0].mlp
    block.capacity_factor = block.num_experts / block.top_k  # room for every assignment
    x = mx.random.normal((3, 11, TINY.hidden), key=mx.random.key(1))
    y, _, kept, total = block.forward_with_stats(x)
    assert kept.item() == total
    assert mx.allclose(y, _dense_top_k_moe(block, x), atol=1e-5).item()
    # At capacity 1 an expert keeps one assignment; every other one is dropped as zeros.
    flat = x.reshape(-1, TINY.hidden)
    inds = mx.argpartition(block.gate(flat), kth=-2, axis=-1)[..., -2:]
    out, kept = capacity_glu(block.switch_mlp, flat, inds, capacity=1)
    nonzero = (mx.abs(out).sum(-1) > 0).sum().item()
    assert kept.item() == nonzero == len(set(np.array(inds).ravel().tolist()))


class _Interrupt(Exception):
    pass


def _stop_at(step: int):
    def progress(line: str) -> None:
        if line.startswith(f"step {step}/"):
            raise _Interrupt

    return progress


def _quiet(line: str) -> None:
    pass


def test_training_learns_resumes_exactly_and_exports_a_servable_model(tmp_path, texts_dir):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_base(straight, TINY, texts_dir, export=False, progress=_quiet, show_bar=False)
    curve = _read_curve(straight, TINY.steps)
    losses = [float(row["loss"]) for row in curve]
    assert len(losses) == TINY.steps and losses[-1] < losses[0] - 0.3

    with pytest.raises(_Interrupt):
        train_base(resumed, TINY, texts_dir, export=False, progress=_stop_at(4), show_bar=False)
    assert [float(r["loss"]) for r in _read_curve(resumed, 99)] == losses[:4]
    with pytest.raises(Edge0Error, match="other settings"):
        train_base(resumed, TINY.__class__(**{**vars(TINY), "seed": 1}), texts_dir, show_bar=False)
    train_base(resumed, TINY, texts_dir, resume=True, progress=_quiet, show_bar=False)
    assert [float(r["loss"]) for r in _read_curve(resumed, 99)] == losses
    a, b = mx.load(str(straight / STATE_FILE)), mx.load(str(resumed / STATE_FILE))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert (resumed / LOSS_CSV).exists()

    # The served 4-bit base: streamed on demand it decodes exactly what the resident model does.
    tokens = {}
    for mode in ("resident", "on-demand"):
        with Engine(resumed / "base", EngineConfig(mode=mode)) as engine:
            prompt = engine.encode("Speak of love", chat=True)
            result = engine.generate(prompt, GenerationConfig(max_tokens=12, temperature=0.0))
            tokens[mode] = result.tokens
    assert tokens["resident"] == tokens["on-demand"] and tokens["resident"]
    assert (resumed / "teacher" / "config.json").exists()
    teacher = mx.load(str(resumed / "teacher" / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in teacher.values())
    report = held_out_perplexity(resumed / "base", texts_dir, window=TINY.seq_len)
    assert report["tokens"] > 0 and 1.0 < report["perplexity"] < TINY.vocab

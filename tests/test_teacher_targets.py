"""Phase 2's teacher targets kept on disk (engine/train/teacher_targets.py): the top-k loss is
the whole-distribution KL where k holds the mass, the targets are made once (and finished after a
stop) and reused, and phase 2 trains on them."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from engine.train.lora import forward_kl
from engine.train.teacher_targets import (
    TeacherTargets,
    teacher_targets,
    top_k_targets,
    topk_forward_kl,
)

TEXT = " ".join(f"word{i % 97} and line {i}." for i in range(3000))


def test_the_top_k_loss_is_the_whole_kl_where_k_holds_the_mass():
    rng = np.random.default_rng(0)
    teacher = mx.array(rng.normal(size=(2, 5, 50)).astype(np.float32) * 3)
    student = mx.array(rng.normal(size=(2, 5, 50)).astype(np.float32))
    whole = forward_kl(teacher, student)
    # k = vocabulary - 1: the bucket is one token, so the loss is the whole KL.
    assert mx.allclose(topk_forward_kl(student, *top_k_targets(teacher, 49)), whole, atol=1e-5)
    # A smaller k merges the tail into one bucket on each side: never more than the whole KL.
    coarse = topk_forward_kl(student, *top_k_targets(teacher, 8))
    assert bool(mx.all(coarse <= whole + 1e-5)) and bool(mx.all(coarse >= 0))
    ids, logp, tail = top_k_targets(teacher, 8)
    assert mx.allclose(
        mx.logsumexp(mx.concatenate([logp, tail[..., None]], -1), -1),
        mx.zeros(tail.shape),
        atol=1e-5,
    )
    assert TeacherTargets.bytes_per_position(64) == 388


def test_targets_are_made_once_finished_after_a_stop_and_reused(tmp_path):
    calls = []

    def teacher(tokens: mx.array) -> mx.array:
        calls.append(tokens.shape[0])
        return mx.eye(40)[tokens % 40] * 5.0

    inputs = np.arange(7 * 6, dtype=np.int32).reshape(7, 6)
    key = {"rows": "r", "teacher": "t"}
    made = teacher_targets(teacher, inputs, 2, 4, tmp_path, key, batch=3, log=lambda _: None)
    assert calls == [3, 3, 1] and made.ids.shape == (7, 4, 4)
    assert inputs[1, 2] % 40 in made.ids[1, 0]  # the likeliest token is among the kept ones
    # A stop after the first batch: the state says 3 rows; the rest is made, not the start.
    state = json.loads((tmp_path / "teacher_targets.json").read_text())
    (tmp_path / "teacher_targets.json").write_text(json.dumps({**state, "done": 3}))
    calls.clear()
    again = teacher_targets(teacher, inputs, 2, 4, tmp_path, key, batch=3, log=lambda _: None)
    assert calls == [3, 1] and np.array_equal(np.array(again.ids), np.array(made.ids))
    calls.clear()
    teacher_targets(teacher, inputs, 2, 4, tmp_path, key, batch=3, log=lambda _: None)
    assert calls == []  # complete: reused
    teacher_targets(teacher, inputs, 2, 4, tmp_path, {**key, "teacher": "u"}, 3, lambda _: None)
    assert calls == [3, 3, 1]  # another teacher: made again
    x, *target = made.batch(np.array([5, 0]))
    assert x.shape == (2, 4, 4) and target[1].shape == (2, 4)


@pytest.mark.parametrize("k", [0, 64])
def test_the_cli_takes_teacher_top_k(monkeypatch, tmp_path, k):
    import engine.train.lora
    from edge0_tui.cli import main

    calls = []
    monkeypatch.setattr(engine.train.lora, "train_lora", lambda *a, **kw: calls.append(a[3]))
    (tmp_path / "M").mkdir()
    text = tmp_path / "t.txt"
    text.write_text("x")
    args = ["train", "lora", str(tmp_path / "M"), "--k", "2", "--text", str(text)]
    assert main([*args, "--teacher-top-k", str(k)]) == 0
    assert calls[0].teacher_top_k == k

"""Phase 2's teacher targets kept on disk (engine/train/teacher_targets.py): the top-k loss is
the whole-distribution KL where k holds the mass, the targets are made once (and finished after a
stop) and reused, and phase 2 trains on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import Edge0Error
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
    made = teacher_targets(teacher, inputs, 2, 4, tmp_path, key, 3, 40, lambda _: None)
    assert calls == [3, 3, 1] and made.ids.shape == (7, 4, 4)
    assert inputs[1, 2] % 40 in made.ids[1, 0]  # the likeliest token is among the kept ones
    # A stop after the first batch: the state says 3 rows; the rest is made, not the start.
    state = json.loads((tmp_path / "teacher_targets.json").read_text())
    (tmp_path / "teacher_targets.json").write_text(json.dumps({**state, "done": 3}))
    calls.clear()
    again = teacher_targets(teacher, inputs, 2, 4, tmp_path, key, 3, 40, lambda _: None)
    assert calls == [3, 1] and np.array_equal(np.array(again.ids), np.array(made.ids))
    calls.clear()
    teacher_targets(teacher, inputs, 2, 4, tmp_path, key, 3, 40, lambda _: None)
    assert calls == []  # complete: reused
    teacher_targets(teacher, inputs, 2, 4, tmp_path, {**key, "teacher": "u"}, 3, 40, lambda _: None)
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


# -- a kept cache that does not check out is made again, never trained on -------------------------


def _toy_teacher(calls: list):
    def teacher(tokens: mx.array) -> mx.array:
        calls.append(tokens.shape[0])
        return mx.eye(40)[tokens % 40] * 5.0

    return teacher


INPUTS = np.arange(7 * 6, dtype=np.int32).reshape(7, 6)
KEY = {"rows": "r", "teacher": "t"}


def _spoil_done(folder):
    state = (folder / "teacher_targets.json").read_text()
    (folder / "teacher_targets.json").write_text(state.replace('"done": 7', '"done": 1e400'))


def _spoil_truncated(folder):
    path = folder / "teacher_ids.npy"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _spoil_shape(folder):
    np.save(folder / "teacher_ids.npy", np.zeros((7, 4, 3), np.int32))


def _spoil_float64(folder):
    np.save(folder / "teacher_ids.npy", np.zeros((7, 4, 4), np.float64))


def _spoil_nan(folder):
    logp = np.load(folder / "teacher_logp.npy", mmap_mode="r+")
    logp[2, 1, 0] = np.nan
    logp.flush()


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (_spoil_done, "says inf rows are done"),
        (_spoil_truncated, "teacher_ids.npy holds"),
        (_spoil_shape, "teacher_ids.npy is int32 [7, 4, 3], expected int32 [7, 4, 4]"),
        (_spoil_float64, "teacher_ids.npy is float64"),
        (_spoil_nan, "logp holds NaN"),
    ],
)
def test_a_kept_cache_that_does_not_check_out_is_made_again(tmp_path, spoil, reason):
    calls: list[int] = []
    teacher = _toy_teacher(calls)
    made = teacher_targets(teacher, INPUTS, 2, 4, tmp_path, KEY, 3, 40, lambda _: None)
    good = np.array(made.ids), np.array(made.logp)
    del made
    spoil(tmp_path)
    calls.clear()
    lines: list[str] = []
    again = teacher_targets(teacher, INPUTS, 2, 4, tmp_path, KEY, 3, 40, lines.append)
    assert calls == [3, 3, 1]  # made again, from the first row
    said = [line for line in lines if "making the teacher targets again" in line]
    assert len(said) == 1 and reason in said[0] and str(tmp_path) in said[0], lines
    assert "--lr" not in " ".join(lines)
    assert np.array_equal(np.array(again.ids), good[0])
    assert np.array_equal(np.array(again.logp), good[1], equal_nan=False)


def test_a_teacher_that_gives_nan_is_named_not_trained_on(tmp_path):
    def teacher(tokens: mx.array) -> mx.array:
        return mx.full((*tokens.shape, 40), mx.nan)

    with pytest.raises(Edge0Error, match=r"rows 0\.\.2 are unusable: .*check the teacher"):
        teacher_targets(teacher, INPUTS, 2, 4, tmp_path, KEY, 3, 40, lambda _: None)
    assert not (tmp_path / "teacher_targets.json").exists()  # no row said to be made


def test_a_folder_where_the_cache_goes_is_refused_in_one_line(tmp_path):
    (tmp_path / "teacher_ids.npy").mkdir()
    with pytest.raises(Edge0Error, match="teacher_ids.npy: a directory, not a regular file"):
        teacher_targets(_toy_teacher([]), INPUTS, 2, 4, tmp_path, KEY, 3, 40, lambda _: None)


# Run in a child: out-of-vocabulary ids once reached MLX's gather and crashed the process.
OUT_OF_VOCABULARY = """
import sys
from pathlib import Path
import mlx.core as mx
import numpy as np
from engine.train.teacher_targets import teacher_targets, topk_forward_kl

folder = Path(sys.argv[1])
inputs = np.arange(7 * 6, dtype=np.int32).reshape(7, 6)
teacher = lambda tokens: mx.eye(40)[tokens % 40] * 5.0
key = {"rows": "r", "teacher": "t"}
made = teacher_targets(teacher, inputs, 2, 4, folder, key, 3, 40, lambda _: None)
made.ids[3, 0, 0] = 2_000_000_000
made.ids.flush()
del made
again = teacher_targets(teacher, inputs, 2, 4, folder, key, 3, 40, print)
ids, logp, tail = again.batch(np.arange(7))
loss = topk_forward_kl(mx.zeros((7, 4, 40)), ids, logp, tail)
print("loss", float(loss.sum()))
"""


def test_ids_outside_the_vocabulary_are_made_again_in_a_process_that_lives(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_VOCABULARY, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "token ids outside the vocabulary of 40 (from 0 to 2000000000)" in done.stdout
    assert "making the teacher targets again" in done.stdout and "loss " in done.stdout


def test_making_the_targets_says_how_far_it_is_and_what_is_left(tmp_path):
    lines: list[str] = []
    teacher_targets(_toy_teacher([]), INPUTS, 2, 4, tmp_path, KEY, 3, 40, lines.append)
    first = [line for line in lines if line.startswith("the first teacher targets: 3 rows in")]
    assert len(first) == 1 and "the 4 rows left take about" in first[0], lines
    assert any(line.startswith("teacher targets: 7 of 7 rows (100%") for line in lines), lines

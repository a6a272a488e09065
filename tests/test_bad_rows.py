"""`train lora --rows`: the teacher rows cache is read like every other input file. A FIFO blocked
forever; random bytes, an empty file, an archive without `settings`, an object array and a folder
were tracebacks. Now each is one `edge0: error:` line naming the file, and the file is left as it
was (never replaced by a new cache)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from adapters import write_random_profile
from cli_runner import run_cli
from test_bad_inputs import assert_refused


@pytest.fixture(scope="module")
def profiled(checkpoint_dir, tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("rows") / "qwen3_moe-tiny"
    shutil.copytree(checkpoint_dir("qwen3_moe"), model)
    write_random_profile(model, 2)
    return model


def _npz(path: Path, **arrays) -> None:
    with open(path, "wb") as f:  # np.savez would add .npz to another name
        np.savez(f, **arrays)


ROWS = {
    "fifo": (lambda p: os.mkfifo(p), "a FIFO (named pipe), not a regular file"),
    "folder": (lambda p: p.mkdir(), "a directory, not a regular file"),
    "random bytes": (lambda p: p.write_bytes(os.urandom(4096)), "not a teacher rows cache"),
    "empty": (lambda p: p.write_bytes(b""), "not a teacher rows cache"),
    "no settings": (
        lambda p: _npz(p, prompts=np.zeros((20, 32), np.int32)),
        "no 'settings', 'continuations' array",
    ),
    "object array": (
        lambda p: _npz(
            p,
            settings=np.array([{"evil": 1}], dtype=object),
            prompts=np.zeros(1),
            continuations=np.zeros(1),
        ),
        "holds Python objects, which are never unpickled",
    ),
    ".npy array": (lambda p: np.save(open(p, "wb"), np.zeros(3)), "not an .npz archive"),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_bad_rows_file_is_one_line(profiled, tmp_path, case):
    make, problem = ROWS[case]
    rows = tmp_path / "rows.npz"
    make(rows)
    before = rows.read_bytes() if rows.is_file() else None
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = run_cli(
        "train", "lora", str(profiled), "--k", "2", "--text", str(text), "--rows", str(rows),
        "--generate", "20", "--steps", "1", "--out", str(tmp_path / "lora_k2.safetensors"),
        timeout=60,
    )  # fmt: skip
    assert_refused(out, rows, problem)
    if before is not None:
        assert rows.read_bytes() == before
    assert not (tmp_path / "lora_k2.safetensors").exists()


def test_rows_of_the_wrong_shape_are_refused(profiled, tmp_path):
    """A cache whose settings match but whose arrays do not fit them (hand-edited, or corrupt)."""
    from engine.train.run import check_token_rows

    good = np.zeros((4, 8), np.int32)
    assert check_token_rows(tmp_path, "cache", good, "prompts", 8).shape == (4, 8)
    for bad in (np.zeros((4, 7), np.int32), np.zeros(4, np.int32), np.full((4, 8), -1), good + 0.5):
        with pytest.raises(Exception, match="expected rows of 8 token ids"):
            check_token_rows(tmp_path, "cache", bad, "prompts", 8)

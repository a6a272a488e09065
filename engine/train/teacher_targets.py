"""Phase 2's teacher targets, computed once and kept on disk: each position's top-k tokens.

The teacher (the checkpoint itself at its native K, or a float model) is the same for every
step, every epoch and every K profile, so its distribution over the training rows is computed
once, streaming through the rows a batch at a time, and kept in three memory-mapped arrays beside
the teacher rows:

- `ids` [rows, positions, k] int32: the teacher's k likeliest tokens at each position;
- `logp` [rows, positions, k] float16: their log-probabilities;
- `tail` [rows, positions] float32: the log-probability of the rest of the vocabulary.

That is `k * 6 + 4` bytes a position, whatever the vocabulary: 388 bytes at k=64 (388 KB per 1k
tokens), where a whole distribution over a 151k vocabulary in float32 is 604 KB per token. The
loss is then KL(teacher || student) over those k tokens plus one bucket for the rest
(`topk_forward_kl`), exact when the k tokens hold the teacher's whole mass. The arrays are
written batch by batch with the number done in a JSON beside them, so a killed run resumes
where it stopped; arrays made for other rows, another teacher or another k are made again, and
so are arrays that do not check out (`kept_rows`: their size, dtype and shape, the ids within the
vocabulary, the log-probabilities finite), said in one line: never trained on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint.index import check_regular_file
from ..checkpoint.outputs import check_output_folder
from ..errors import Edge0Error
from .run import Log, ProgressLines, training_progress

NAMES = ("ids", "logp", "tail")


@dataclass
class TeacherTargets:
    ids: np.ndarray
    logp: np.ndarray
    tail: np.ndarray

    def batch(self, rows: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
        """The targets of `rows`, read from disk for this batch only."""
        rows = np.asarray(rows)
        return (
            mx.array(self.ids[rows]),
            mx.array(self.logp[rows].astype(np.float32)),
            mx.array(self.tail[rows]),
        )

    @staticmethod
    def bytes_per_position(k: int) -> int:
        return k * (4 + 2) + 4


def teacher_targets(
    teacher: Callable[[mx.array], mx.array],
    inputs: np.ndarray,
    first: int,
    k: int,
    folder: Path,
    key: dict,
    batch: int,
    vocab: int,
    log: Log = print,
    bar: bool = False,
) -> TeacherTargets:
    """The teacher's top-k targets for positions `first`.. of each row of `inputs` [rows, T]
    over a vocabulary of `vocab` tokens (kept in `folder`, made or finished where `key` differs
    or they are incomplete; made again where what is kept does not check out)."""
    rows, positions = len(inputs), inputs.shape[1] - first
    layout = {
        "ids": (np.dtype(np.int32), (rows, positions, k)),
        "logp": (np.dtype(np.float16), (rows, positions, k)),
        "tail": (np.dtype(np.float32), (rows, positions)),
    }
    key = {**key, "k": k, "first": first, "shape": [rows, positions]}
    check_output_folder(folder, "the teacher targets")
    folder.mkdir(parents=True, exist_ok=True)
    done, problem = kept_rows(folder, key, layout, vocab)
    if problem:
        log(f"{folder}: {problem}; making the teacher targets again")
    arrays = {
        name: np.lib.format.open_memmap(
            _path(folder, name), mode="r+" if done else "w+", dtype=dtype, shape=shape
        )
        for name, (dtype, shape) in layout.items()
    }
    if done < rows:
        per = TeacherTargets.bytes_per_position(k)
        log(
            f"teacher targets: the top {k} tokens of {rows} x {positions} positions "
            f"({per} bytes a position, {per * rows * positions / 2**20:.1f} MiB), from row {done}"
        )
        lines = ProgressLines(log, "teacher targets", "rows", rows, done)
        with training_progress(bar) as progress:
            task = progress.add_task("teacher targets", total=rows, completed=done, status="")
            for start in range(done, rows, batch):
                end = min(start + batch, rows)
                logits = teacher(mx.array(inputs[start:end]))[:, first:]
                made = dict(zip(NAMES, top_k_targets(logits, k)))
                made["logp"] = made["logp"].astype(mx.float16)
                made = {name: np.array(array) for name, array in made.items()}
                if problem := _bad_values(made, vocab):
                    raise Edge0Error(
                        f"the teacher's targets for rows {start}..{end - 1} are unusable: "
                        f"{problem} (its logits there are not finite: check the teacher)"
                    )
                for name, array in arrays.items():
                    array[start:end] = made[name]
                    array.flush()
                _state_path(folder).write_text(json.dumps({**key, "done": end}))
                progress.update(task, completed=end)
                lines.advance(end)
    return TeacherTargets(arrays["ids"], arrays["logp"], arrays["tail"])


# -- what is kept, checked before it is trained on -------------------------------------------------
# A cache someone else's process, a full disk or a hand edit changed can hold anything: ids out
# of the vocabulary crash MLX's gather outright, a truncated file reads back as zeros (the
# memory map extends it), NaN trains a LoRA into NaN. What does not check out is made again.

STATE_MAX_BYTES = 1 << 16


def _path(folder: Path, name: str) -> Path:
    return folder / f"teacher_{name}.npy"


def _state_path(folder: Path) -> Path:
    return folder / "teacher_targets.json"


def kept_rows(folder: Path, key: dict, layout: dict, vocab: int) -> tuple[int, str | None]:
    """Rows of `folder`'s targets already made for `key` and usable, and why none are where
    something was kept but does not check out (None: nothing kept, or all of it usable). A
    path that is not a regular file is refused (a FIFO would block, a folder cannot be made
    again)."""
    paths = [_state_path(folder), *(_path(folder, name) for name in layout)]
    for path in paths:
        if os.path.lexists(path):
            check_regular_file(path)
    if not paths[0].exists():
        return 0, None
    done, problem = _read_done(paths[0], key)
    if problem is None:
        problem = next(
            filter(None, (_bad_file(_path(folder, n), *layout[n]) for n in layout)), None
        )
    if problem is None and done:
        problem = _bad_rows(folder, layout, done, vocab)
    return (0, problem) if problem else (done, None)


def _read_done(path: Path, key: dict) -> tuple[int, str | None]:
    """The rows the state file says are done, or why it does not check out."""
    try:
        with open(path, "rb") as f:
            state = json.loads(f.read(STATE_MAX_BYTES + 1)[:STATE_MAX_BYTES])
    except (OSError, ValueError, RecursionError):
        return 0, f"{path.name} is not a state file"
    done = state.pop("done", None) if isinstance(state, dict) else None
    if type(done) is not int or not 0 <= done <= key["shape"][0]:
        return 0, f"{path.name} says {done!r} rows are done, not a count of its rows"
    if state != key:
        return 0, "made for other rows, another teacher or another k"
    return done, None


def _bad_file(path: Path, dtype: np.dtype, shape: tuple) -> str | None:
    """Why an .npy file is not the array `shape` of `dtype`, whole; None when it is."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            found_shape, fortran, found_dtype = read(f)
            header = f.tell()
    except (OSError, ValueError, EOFError):
        return f"{path.name} is not an .npy array"
    if found_dtype != dtype or tuple(found_shape) != shape or fortran:
        return f"{path.name} is {found_dtype} {list(found_shape)}, expected {dtype} {list(shape)}"
    expected = header + dtype.itemsize * math.prod(shape)
    size = path.stat().st_size
    if size != expected:
        return f"{path.name} holds {size} bytes, expected {expected} (truncated or extended)"
    return None


def _bad_rows(folder: Path, layout: dict, done: int, vocab: int) -> str | None:
    """Why the first `done` rows are not usable targets, read a block of rows at a time."""
    arrays = {name: np.load(_path(folder, name), mmap_mode="r") for name in layout}
    per_row = max(1, math.prod(layout["ids"][1][1:]))
    block = max(1, (1 << 22) // per_row)
    for start in range(0, done, block):
        rows = {name: array[start : min(start + block, done)] for name, array in arrays.items()}
        if problem := _bad_values(rows, vocab):
            return f"{problem} (in rows {start}..{min(start + block, done) - 1})"
    return None


def _bad_values(targets: dict[str, np.ndarray], vocab: int) -> str | None:
    """Why targets are unusable: ids outside the vocabulary, log-probabilities not finite."""
    ids = targets["ids"]
    if ids.size and not (0 <= ids.min() and ids.max() < vocab):
        return f"token ids outside the vocabulary of {vocab} (from {ids.min()} to {ids.max()})"
    for name in ("logp", "tail"):
        if not np.isfinite(targets[name]).all():
            return f"{name} holds NaN or infinite log-probabilities"
    return None


def top_k_targets(logits: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """The k likeliest tokens [..., k], their log-probabilities, and the rest's log-probability."""
    logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
    ids = mx.argpartition(-logp, kth=k - 1, axis=-1)[..., :k]
    rest = mx.put_along_axis(logp, ids, mx.array(-mx.inf, logp.dtype), axis=-1)
    return ids.astype(mx.int32), mx.take_along_axis(logp, ids, axis=-1), mx.logsumexp(rest, -1)


def topk_forward_kl(
    student_logits: mx.array, ids: mx.array, logp: mx.array, tail: mx.array
) -> mx.array:
    """KL(teacher || student) per position over the teacher's k tokens plus one bucket for the
    rest of the vocabulary on each side (see the module docstring)."""
    student = nn.log_softmax(student_logits.astype(mx.float32), axis=-1)
    s_top = mx.take_along_axis(student, ids, axis=-1)
    s_rest = mx.put_along_axis(student, ids, mx.array(-mx.inf, student.dtype), axis=-1)
    s = mx.concatenate([s_top, mx.logsumexp(s_rest, axis=-1, keepdims=True)], axis=-1)
    t = mx.concatenate([logp, tail[..., None]], axis=-1)
    return (mx.exp(t) * (t - s)).sum(axis=-1)

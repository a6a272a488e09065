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
where it stopped; arrays made for other rows, another teacher or another k are made again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .run import Log, training_progress

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
    log: Log = print,
    bar: bool = False,
) -> TeacherTargets:
    """The teacher's top-k targets for positions `first`.. of each row of `inputs` [rows, T]
    (kept in `folder`, made or finished where `key` differs or they are incomplete)."""
    rows, positions = len(inputs), inputs.shape[1] - first
    shapes = {"ids": (rows, positions, k), "logp": (rows, positions, k), "tail": (rows, positions)}
    dtypes = {"ids": np.int32, "logp": np.float16, "tail": np.float32}
    state_path = folder / "teacher_targets.json"
    key = {**key, "k": k, "first": first, "shape": [rows, positions]}
    done = _done(state_path, key, folder)
    folder.mkdir(parents=True, exist_ok=True)
    mode = "r+" if done else "w+"
    arrays = {
        name: np.lib.format.open_memmap(
            folder / f"teacher_{name}.npy", mode=mode, dtype=dtypes[name], shape=shapes[name]
        )
        for name in NAMES
    }
    if done < rows:
        size = TeacherTargets.bytes_per_position(k) * rows * positions
        log(
            f"teacher targets: the top {k} tokens of {rows} x {positions} positions "
            f"({TeacherTargets.bytes_per_position(k)} bytes a position, {size / 2**20:.1f} MiB), "
            f"from row {done}"
        )
        with training_progress(bar) as progress:
            task = progress.add_task("teacher targets", total=rows, completed=done, status="")
            for start in range(done, rows, batch):
                end = min(start + batch, rows)
                logits = teacher(mx.array(inputs[start:end]))[:, first:]
                ids, logp, tail = top_k_targets(logits, k)
                arrays["ids"][start:end] = np.array(ids)
                arrays["logp"][start:end] = np.array(logp.astype(mx.float16))
                arrays["tail"][start:end] = np.array(tail)
                for array in arrays.values():
                    array.flush()
                state_path.write_text(json.dumps({**key, "done": end}))
                progress.update(task, completed=end)
    return TeacherTargets(arrays["ids"], arrays["logp"], arrays["tail"])


def _done(state_path: Path, key: dict, folder: Path) -> int:
    """Rows already made for this key (0: none, or made for something else)."""
    try:
        state = json.loads(state_path.read_text())
        done = int(state.pop("done"))
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    files = all((folder / f"teacher_{name}.npy").is_file() for name in NAMES)
    return done if state == key and files and 0 <= done <= key["shape"][0] else 0


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

"""What every training phase shares around its loop: the progress bar and resumable state.

State is one safetensors file per run (`OUT/NAME.safetensors`): the model's trainable parameters,
the optimizer state, and the run's JSON state (step, settings, log) in the file's metadata, so that
weights and step always agree. A copy of the JSON goes to `OUT/NAME.json` for people and tools.
Both are written to temporary files and renamed: a crash or Ctrl+C never leaves half a state, and a
rerun with the same settings continues from the last save.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import stat
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..checkpoint.index import check_regular_file
from ..checkpoint.outputs import check_output_file, check_output_folder
from ..errors import Edge0Error
from ..runtime.metrics import process_lifetime_peaks

Log = Callable[[str], None]


def training_progress(enabled: bool) -> Progress:
    """The progress bar of every training phase (on stderr); tasks carry a `status` field."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=Console(stderr=True),
        disable=not enabled,
    )


class ProgressLines:
    """A long phase's progress on the log, which a run whose output is not a terminal reads
    (the bar shows only on one): after the first piece of work, what it took and what the rest
    will take; then at every tenth of the whole (or after `QUIET_S` without a line), how far it
    is and what is left. `train heads` writing its text, phase 2's teacher rows and targets."""

    EVERY = 0.1
    QUIET_S = 300.0

    def __init__(
        self, log: Log, what: str, unit: str, total: int, done: int = 0, first: str = ""
    ) -> None:
        self.log, self.what, self.unit, self.total = log, what, unit, total
        self.first = first or f"the first {what}"
        self.had = done
        self.started = self.last_line = time.perf_counter()
        self.next_line = done + self.EVERY * total

    def advance(self, done: int) -> None:
        """`done` of the total are done now."""
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        rate, left = (done - self.had) / elapsed, self.total - done
        if self.last_line == self.started and left > 0:  # the first piece: the estimate
            self.log(
                f"{self.first}: {done - self.had:,} {self.unit} in {elapsed:.1f} s "
                f"({_rate(rate, self.unit)}): the {left:,} {self.unit} left take about "
                f"{duration_text(left / max(rate, 1e-9))}"
            )
        elif done >= self.next_line or left <= 0 or now - self.last_line >= self.QUIET_S:
            self.log(
                f"{self.what}: {done:,} of {self.total:,} {self.unit} "
                f"({done / max(self.total, 1):.0%}, {_rate(rate, self.unit)}"
                + (f", about {duration_text(left / max(rate, 1e-9))} left)" if left > 0 else ")")
            )
            self.next_line = done + self.EVERY * self.total
        else:
            return
        self.last_line = now


def _rate(per_second: float, unit: str) -> str:
    return f"{per_second:.0f} {unit}/s" if per_second >= 10 else f"{per_second:.2g} {unit}/s"


# -- one run a folder ----------------------------------------------------------------------------------


class RunLock:
    """An exclusive lock on a training folder for the life of a run (`flock` on `FOLDER/lock`,
    which the OS releases when the process ends, however it ends): a second run into the same
    folder is refused, naming the first, instead of both writing its state and its adapter."""

    NAME = "lock"

    def __init__(self, folder: Path, what: str = "a training run") -> None:
        self.folder, self.what = Path(folder), what
        self.file = None

    def __enter__(self) -> RunLock:
        path = self.folder / self.NAME
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Not truncated: the holder's line stays readable. Non-blocking: a FIFO put there
            # would otherwise hang the open.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise Edge0Error(f"{path}: cannot take the run's lock ({e.strerror or e})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise Edge0Error(f"{path}: not a regular file; remove it, or choose another --out-dir")
        file = os.fdopen(fd, "r+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            holder = file.read(200).strip() or "a process that has not said which"
            file.close()
            raise Edge0Error(
                f"{self.folder}: in use by another run ({holder}); wait for it to end, or "
                "choose another --out-dir"
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        file.seek(0)
        file.truncate(0)
        file.write(f"pid {os.getpid()}, started {started}, {self.what}\n")
        file.flush()
        self.file = file
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()  # closing releases the lock; the file stays for the next run
            self.file = None


# -- resumable state ---------------------------------------------------------------------------------


def save_state(
    out_dir: Path, name: str, model: nn.Module, optimizer: optim.Optimizer, state: dict
) -> None:
    """Trainable parameters, optimizer state and `state` in OUT/NAME.safetensors (+ NAME.json)."""
    arrays = {f"model.{k}": v for k, v in tree_flatten(model.trainable_parameters())}
    arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(optimizer.state)})
    out_dir.mkdir(parents=True, exist_ok=True)
    # What the process that saved has needed so far (`peak_mlx_bytes`, `peak_rss_bytes`: the
    # kernel's high-water mark), for whoever sizes a machine for the run.
    state = {**state, "peak_memory": process_lifetime_peaks()}
    text = json.dumps(state, indent=1) + "\n"
    tmp = out_dir / f"{name}.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays, metadata={"state": text})
    tmp.replace(out_dir / f"{name}.safetensors")
    (out_dir / f"{name}.tmp.json").write_text(text)
    (out_dir / f"{name}.tmp.json").replace(out_dir / f"{name}.json")


def save_weights(path: Path, model: nn.Module) -> None:
    """The model's trainable parameters in `path`, replaced whole (never half written)."""
    arrays = dict(tree_flatten(model.trainable_parameters()))
    tmp = path.with_name(path.stem + ".tmp.safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp), arrays)
    tmp.replace(path)


def check_outputs(out: Path, out_dir: Path) -> None:
    """A LoRA phase's adapter file and its state folder can be written: checked before the run,
    which would otherwise fail (with a traceback) only when it saves."""
    check_output_folder(out_dir, "the training state")
    check_output_file(out, "the LoRA")


def read_state(out_dir: Path, name: str) -> tuple[dict, dict[str, mx.array]] | None:
    """A saved run's JSON state and arrays from OUT/NAME.safetensors; None when there is none."""
    path = out_dir / f"{name}.safetensors"
    if not path.exists():
        return None
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
        if "state" in metadata:
            state = json.loads(metadata["state"])
        else:  # written before 2026-12-01: the state in NAME.json, the step maybe in the metadata
            state = json.loads((out_dir / f"{name}.json").read_text())
            state["step"] = int(metadata.get("step", state["step"]))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise Edge0Error(
            f"{path}: cannot read the training state ({e}); delete it to start over"
        ) from None
    return state, arrays


def read_cache(path: Path, what: str, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays `names` of an .npz cache a phase wrote (teacher rows, held-out rollouts); None
    when there is no file. Read like every other input: a FIFO, a device or a folder is refused
    before anything opens it, object arrays are never unpickled, and a file that is not such an
    archive is an Edge0Error naming it (a cache of ours is never silently replaced by
    something the user pointed at)."""
    if not os.path.lexists(path):
        return None
    check_regular_file(path)
    hint = "delete it to start over, or name another file"
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError("an .npy array, not an .npz archive")
        with archive:
            missing = [n for n in names if n not in archive.files]
            if missing:
                raise ValueError(f"no {', '.join(map(repr, missing))} array")
            _check_unpacked_sizes(archive, names, os.path.getsize(path))
            arrays = {n: archive[n] for n in names}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise Edge0Error(f"{path}: not a {what} ({_reason(e)}); {hint}") from None
    except pickle.UnpicklingError as e:
        raise Edge0Error(f"{path}: not a {what} ({e}); {hint}") from None
    except AttributeError:  # np.load's reply to some garbage
        raise Edge0Error(f"{path}: not a {what} (unreadable .npz); {hint}") from None
    return arrays


# How much larger than its file an .npz cache may unpack: token ids compress a few times, a zip
# bomb a thousand times and more (a small file that would take all memory once loaded).
MAX_UNPACK_RATIO = 64
MAX_UNPACK_SLACK = 64 << 20  # and any cache may unpack to this much, whatever its file


def _check_unpacked_sizes(archive, names: tuple[str, ...], file_bytes: int) -> None:
    """Bound what loading `names` allocates before any is read: the sizes the zip directory says
    (zipfile stops reading a member at its stated size) and the shapes the .npy headers say."""
    limit = MAX_UNPACK_RATIO * file_bytes + MAX_UNPACK_SLACK
    total = 0
    for name in names:
        info = archive.zip.getinfo(f"{name}.npy")
        with archive.zip.open(info) as member:
            version = np.lib.format.read_magic(member)
            v1 = version == (1, 0)  # 2.0 and 3.0 share the header's layout
            read = (
                np.lib.format.read_array_header_1_0 if v1 else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(member)
        declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if declared > info.file_size:
            raise ValueError(f"array {name!r} says {declared} bytes but holds {info.file_size}")
        total += info.file_size
    if total > limit:
        raise ValueError(f"unpacks to {total} bytes from a file of {file_bytes}, a zip bomb")


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, EOFError):
        return "empty or truncated"
    if isinstance(e, ValueError) and "allow_pickle" in str(e):
        return "holds Python objects, which are never unpickled"
    return str(e) or type(e).__name__


def check_token_rows(path: Path, what: str, array: np.ndarray, name: str, width: int) -> np.ndarray:
    """`array` as rows of `width` token ids (non-negative integers); else an Edge0Error."""
    if (
        array.ndim != 2
        or array.shape[1] != width
        or not np.issubdtype(array.dtype, np.integer)
        or (array.size and array.min() < 0)
    ):
        raise Edge0Error(
            f"{path}: not a {what} ({name!r} is {array.dtype} {list(array.shape)}, expected rows "
            f"of {width} token ids); delete it to start over, or name another file"
        )
    return array.astype(np.int32)


def restore(model: nn.Module, optimizer: optim.Optimizer, arrays: dict[str, mx.array]) -> None:
    """Load saved trainable parameters and optimizer state (see `save_state`)."""
    # Phase 2/3 states written before 2026-12-01 name the parameters `lora.*`.
    weights = [
        (n.split(".", 1)[1], v) for n, v in arrays.items() if n.startswith(("model.", "lora."))
    ]
    model.load_weights(weights, strict=False)
    optimizer.init(model.trainable_parameters())
    current = dict(tree_flatten(optimizer.state))
    current.update({n[10:]: v for n, v in arrays.items() if n.startswith("optimizer.")})
    optimizer.state = tree_unflatten(list(current.items()))
    mx.eval(model.parameters(), optimizer.state)


# Settings a rerun may change: `steps` (a longer run continues a shorter one); how often it
# saves and logs, and whether phase 2 may fit its batch to the plan, change no step (the batch
# it trains with is compared).
FREE_SETTINGS = ("steps", "checkpoint_every", "log_every", "fit_batch", "fit_teacher_top_k")


def changed_settings(saved: dict, config, free: tuple[str, ...] = FREE_SETTINGS) -> list[str]:
    """The settings of `config` (a dataclass) that differ from a saved run's, but `free`."""
    current = asdict(config)
    return sorted(k for k, v in saved.items() if k not in free and current.get(k) != v)


# -- phases 2 and 3 ------------------------------------------------------------------------------------


def cost_line(step_s: float, tokens: int, steps_left: int) -> str:
    """Time a step took, per 1k tokens, and what the steps left will take (with the ETA)."""
    left = step_s * steps_left
    eta = time.strftime("%H:%M", time.localtime(time.time() + left))
    return (
        f"a step took {step_s:.1f} s ({step_s / tokens * 1000:.2f} s per 1k tokens): the "
        f"{steps_left} steps left take about {duration_text(left)} (until about {eta})"
    )


def duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class TrainingRun:
    """What the training phases share around their loops: AdamW on the trainable weights
    (clipped gradients), the log, a held-out measure at step 0 and at every checkpoint, and the
    state in `out_dir` (`checkpoint.safetensors`) that a rerun with the same settings resumes
    from. With `keep_best` (the heads: held-out loss is what picks them) the weights of the
    checkpoint with the lowest held-out loss are kept beside it (`best.safetensors`), and `finish`
    takes them back when a later checkpoint measured worse."""

    STATE = "checkpoint"
    BEST = "best"

    def __init__(
        self, out_dir: Path, student, config, loss_fn, heldout, log: Log, keep_best: bool = False
    ):
        self.out_dir, self.student, self.config = out_dir, student, config
        self.heldout, self.log, self.keep_best = heldout, log, keep_best
        self.loss_and_grad = student.value_and_grad(loss_fn)
        self.optimizer = optim.AdamW(learning_rate=config.lr, weight_decay=config.weight_decay)
        self._timed = False
        # (the step before this process's first, when that first began): the pace so far.
        self._since = (0, time.perf_counter())
        self.state = self._resume()
        if self.state is None:
            self.state = {"config": asdict(config), "fingerprint": student.fingerprint, "step": 0}
            self.state["log"] = [{"step": 0, "heldout": round(heldout(), 6)}]
            log(f"held-out loss before training {self.state['log'][0]['heldout']:.5f}")
        else:
            log(f"resuming {out_dir} at step {self.state['step']}")

    @property
    def done(self) -> int:
        """Steps already taken (0, or where the checkpoint stopped)."""
        return self.state["step"]

    @property
    def history(self) -> list[dict]:
        return self.state["log"]

    def step(self, step: int, *batch, tokens: int | None = None) -> float:
        """One optimizer step on `batch` (the loss function's arguments); returns the loss.
        `tokens`: the positions the step trains on, for its cost line (default: the size of the
        batch's first array, the token rows of phases 2 and 3)."""
        config = self.config
        started = time.perf_counter()
        loss, grads = self.loss_and_grad(*batch)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        self.optimizer.update(self.student.model, grads)
        mx.eval(self.student.model.trainable_parameters(), self.optimizer.state, loss)
        entry = {"step": step, "loss": round(loss.item(), 6)}
        if not self._timed:  # the first step of this process: what the run will cost
            self._timed = True
            self._since = (step - 1, started)
            positions = tokens if tokens is not None else batch[0].size
            self.log(cost_line(time.perf_counter() - started, positions, config.steps - step))
        self.history.append(entry)
        self.state["step"] = step
        if step % config.checkpoint_every == 0 or step == config.steps:
            entry["heldout"] = round(self.heldout(), 6)
            best = self.state.get("best")
            if self.keep_best and (best is None or entry["heldout"] < best["heldout"]):
                save_weights(self.out_dir / f"{self.BEST}.safetensors", self.student.model)
                self.state["best"] = {"step": step, "heldout": entry["heldout"]}
            save_state(self.out_dir, self.STATE, self.student.model, self.optimizer, self.state)
        if step % config.log_every == 0 or "heldout" in entry:
            held = f"  held-out {entry['heldout']:.5f}" if "heldout" in entry else ""
            left = self._time_left(step)
            self.log(f"step {step}/{config.steps}  loss {entry['loss']:.5f}{held}{left}")
        return entry["loss"]

    def _time_left(self, step: int) -> str:
        """What the steps after `step` will take at this process's pace so far ("" at the end)."""
        first, began = self._since
        left = self.config.steps - step
        if left <= 0:
            return ""
        pace = (time.perf_counter() - began) / (step - first)
        return f"  (about {duration_text(pace * left)} left)"

    def finish(self) -> None:
        """The run is over: where a checkpoint before the last had the lowest held-out loss, its
        weights are taken back (and the log says so); the last step's stay otherwise."""
        best, last = self.state.get("best"), self.history[-1]
        if not self.keep_best or best is None or "heldout" not in last:
            return
        if best["step"] == last["step"]:
            return
        path = self.out_dir / f"{self.BEST}.safetensors"
        try:
            weights = mx.load(str(path))
        except (OSError, ValueError) as e:
            raise Edge0Error(f"{path}: cannot read the best checkpoint's weights ({e})") from None
        self.student.model.load_weights(list(weights.items()), strict=False)
        mx.eval(self.student.model.trainable_parameters())
        self.log(
            f"the last step's held-out loss ({last['heldout']:.5f} at step {last['step']}) is "
            f"worse than step {best['step']}'s ({best['heldout']:.5f}): keeping step "
            f"{best['step']}'s weights"
        )

    def _resume(self) -> dict | None:
        """The saved state, loaded into the student and the optimizer; None when there is none.
        A run with other settings (except `steps`) or another base is refused."""
        saved = read_state(self.out_dir, self.STATE)
        if saved is None:
            return None
        state, arrays = saved
        changed = changed_settings(state.get("config", {}), self.config)
        if changed or state.get("fingerprint") != self.student.fingerprint:
            what = f"other settings ({', '.join(changed)})" if changed else "another base model"
            raise Edge0Error(
                f"{self.out_dir} holds a run with {what}; choose another --out-dir or delete it"
            )
        restore(self.student.model, self.optimizer, arrays)
        state["config"] = asdict(self.config)  # a new `steps` is the run's new length
        return state

"""Phase 1's traces: every MoE layer's input and router logits, collected through the streaming
engine and written to disk as they are computed, so memory does not grow with the number of tokens.

The model runs in on-demand mode (`EngineConfig(mode="on-demand")`): routed experts stream into the
bounded expert cache. The windows go through the model in layer-major passes
(`runtime/layer_major.py`): every window of a pass through a layer, then the next, so that each
MoE layer's experts are read about once a pass, not once a window. Each MoE block is wrapped to
record its input x and its router logits; once a layer has run every window of the pass, they
are written into memory-mapped `.npy` arrays; once the last layer has, the pass's windows are
marked done.

A trace folder:

    progress.json     shape, dtypes, what was collected (a key over the base, the tokens and the
                      window) and `windows_done`; written atomically after each window
    tokens.npy        [W, T] int32, the windows
    x_L.npy           [W, T, H] float16, MoE layer L's input
    logits_L.npy      [W, T, E] float32, MoE layer L's router logits

x is float16: it is almost all of the bytes (H per position against E logits) and the heads read
it as a feature, where float16's ~1e-3 relative rounding is far below what they resolve; MoE
inputs come after a norm and stay well inside float16's range (values beyond it are clipped).
Router logits stay float32: they decide the top-K sets (features and targets), and rounding them
could flip near ties.

An array is memory-mapped only while one layer of a pass is written or one batch is read, then
unmapped: the process holds at most a pass's hidden states and one layer's records of it, whatever
the trace's length. A rerun with the same model, tokens and window continues after the last
complete window.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint.index import base_fingerprint
from ..checkpoint.outputs import check_free_space, reserve
from ..config import format_bytes
from ..errors import Edge0Error
from ..routing.moe_block import ops_for
from ..runtime.layer_major import layer_major, pass_budget, windows_per_pass
from ..runtime.loader import LoadedModel
from .run import Log, ProgressLines

FORMAT_VERSION = 1
X_DTYPE, LOGITS_DTYPE = np.float16, np.float32
FLOAT16_MAX = float(np.finfo(np.float16).max)
PROGRESS = "progress.json"


@dataclass(frozen=True)
class TraceShape:
    """What a trace folder holds; `key` names the collection (base, tokens, window)."""

    key: str
    windows: int
    window: int
    layers: tuple[int, ...]
    hidden: int
    experts: int

    @property
    def nbytes(self) -> int:
        per_position = self.hidden * np.dtype(X_DTYPE).itemsize
        per_position += self.experts * np.dtype(LOGITS_DTYPE).itemsize
        return self.windows * self.window * len(self.layers) * per_position


def trace_key(fingerprint: str, windows: np.ndarray) -> str:
    """A short hash of the base, the window length and the tokens: a trace folder's name."""
    digest = hashlib.sha256(f"v{FORMAT_VERSION}|{fingerprint}|{windows.shape}|".encode())
    digest.update(np.ascontiguousarray(windows, dtype=np.int32).tobytes())
    return digest.hexdigest()[:16]


def token_windows(tokens: np.ndarray, window: int) -> np.ndarray:
    """[W, window] non-overlapping windows of `tokens` (the tail that does not fill one is dropped)."""
    count = len(tokens) // window
    return np.asarray(tokens[: count * window], dtype=np.int32).reshape(count, window)


class TraceFiles:
    """A trace folder's arrays. Each access maps the file for that one read or write only."""

    def __init__(self, folder: Path, shape: TraceShape, windows_done: int) -> None:
        self.folder = folder
        self.shape = shape
        self.windows_done = windows_done

    # -- creating and reopening ----------------------------------------------------------------------

    @classmethod
    def open_or_create(cls, folder: Path, shape: TraceShape, windows: np.ndarray) -> TraceFiles:
        """The folder's traces so far when it holds this collection, else a new empty one."""
        found = cls.open(folder)
        if found is not None and found.shape == shape:
            if not found.complete:  # written by a version that left them sparse, maybe
                found.reserve()
            return found
        folder.mkdir(parents=True, exist_ok=True)
        check_free_space(folder, shape.nbytes, "the traces")
        np.save(folder / "tokens.npy", windows)
        files = cls(folder, shape, 0)
        try:
            files._create_arrays()
            files.reserve()
        except Edge0Error:  # the disk filled: the arrays made so far would only hold it full
            for path in files._array_paths():
                path.unlink(missing_ok=True)
            raise
        files._write_progress()
        return files

    def _create_arrays(self) -> None:
        w, t = self.shape.windows, self.shape.window
        for layer in self.shape.layers:  # sized, not written: the files start sparse
            for path, dtype, width in (
                (self._x_path(self.folder, layer), X_DTYPE, self.shape.hidden),
                (self._logits_path(self.folder, layer), LOGITS_DTYPE, self.shape.experts),
            ):
                np.lib.format.open_memmap(path, "w+", dtype, (w, t, width))  # unmapped at once

    def _array_paths(self) -> list[Path]:
        """x_L then logits_L for every layer L."""
        return [
            path
            for layer in self.shape.layers
            for path in (self._x_path(self.folder, layer), self._logits_path(self.folder, layer))
        ]

    @classmethod
    def open(cls, folder: Path) -> TraceFiles | None:
        """The trace folder's state, or None when it has none (never started, or unreadable)."""
        try:
            saved = json.loads((folder / PROGRESS).read_text())
            shape = TraceShape(**{**saved["shape"], "layers": tuple(saved["shape"]["layers"])})
            done = int(saved["windows_done"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if saved.get("version") != FORMAT_VERSION or not 0 <= done <= shape.windows:
            return None
        return cls(folder, shape, done)

    def reserve(self) -> None:
        """Every array's blocks allocated on disk now (they were made sparse): a window written
        through a memory map on a full disk would otherwise kill the process with SIGBUS."""
        for path in self._array_paths():
            reserve(path, path.stat().st_size, "the traces")

    @property
    def complete(self) -> bool:
        return self.windows_done == self.shape.windows

    # -- writing -------------------------------------------------------------------------------------

    def write_layer(self, first: int, layer: int, x: np.ndarray, logits: np.ndarray) -> None:
        """Layer `layer`'s arrays of windows `first`, `first + 1`, ... (a layer-major pass: x
        [n, T, H], logits [n, T, E]); `mark_done` then says each window is complete."""
        for path, value in (
            (self._x_path(self.folder, layer), x),
            (self._logits_path(self.folder, layer), logits),
        ):
            array = np.lib.format.open_memmap(path, mode="r+")
            array[first : first + len(value)] = value
            array.flush()  # on disk before progress.json says the window is done
            del array  # unmapped: written windows do not stay in this process's memory

    def mark_done(self, index: int) -> None:
        """Window `index` has every layer written (`write_layer`)."""
        if index != self.windows_done:
            raise ValueError(f"window {index} done after {self.windows_done} complete ones")
        self.windows_done = index + 1
        self._write_progress()

    def window(self, index: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Window `index`'s arrays as written ({layer: (x [T, H], logits [T, E])})."""
        return {
            layer: (
                self.read("x", layer, index, dtype=None),
                self.read("logits", layer, index, dtype=None),
            )
            for layer in self.shape.layers
        }

    def _write_progress(self) -> None:
        state = {
            "version": FORMAT_VERSION,
            "shape": asdict(self.shape),
            "windows_done": self.windows_done,
            "dtypes": {"x": np.dtype(X_DTYPE).name, "logits": np.dtype(LOGITS_DTYPE).name},
        }
        tmp = self.folder / f"{PROGRESS}.tmp"
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        os.replace(tmp, self.folder / PROGRESS)

    # -- reading -------------------------------------------------------------------------------------

    def read(
        self,
        kind: str,
        layer: int,
        windows: np.ndarray | slice | int,
        positions=slice(None),
        dtype: type | None = np.float32,
    ) -> np.ndarray:
        """A copy of `kind` ("x" or "logits") of `layer` at [windows, positions] (numpy indexing),
        as `dtype` (None: as stored); the file is mapped for this read only."""
        path = (self._x_path if kind == "x" else self._logits_path)(self.folder, layer)
        array = np.load(path, mmap_mode="r")
        out = np.array(array[windows, positions], dtype=dtype)  # a copy: the map can go
        del array
        return out

    @staticmethod
    def _x_path(folder: Path, layer: int) -> Path:
        return folder / f"x_{layer}.npy"

    @staticmethod
    def _logits_path(folder: Path, layer: int) -> Path:
        return folder / f"logits_{layer}.npy"


# -- collecting ----------------------------------------------------------------------------------------


class _Capture(nn.Module):
    """Wraps an MoE block to record its input and its router logits, then runs it."""

    def __init__(self, block: nn.Module, ops, sink: list) -> None:
        super().__init__()
        self.block = block
        self._ops = ops
        self._sink = sink

    def __call__(self, x: mx.array) -> mx.array:
        self._sink.append((x, self._ops.gate_logits(self.block, x)))
        return self.block(x)


WindowCallback = Callable[[int, dict[int, tuple[np.ndarray, np.ndarray]]], None]


def collect_traces(
    loaded: LoadedModel,
    windows: np.ndarray,
    folder: Path,
    progress=None,
    on_window: WindowCallback | None = None,
    log: Log | None = None,
) -> TraceFiles:
    """Run `loaded` (on-demand mode; resident works too, for comparison) over `windows` [W, T],
    writing every MoE layer's input and router logits to `folder`, window by window. Continues a
    collection the folder already holds. `progress` is a rich Progress (or None), `log` gets its
    progress lines with what is left (`run.ProgressLines`); `on_window(i, captured)` sees each
    window's in-memory arrays after they are written."""
    layers = tuple(sorted(site.layer for site in loaded.sites))
    shape = TraceShape(
        trace_key(base_fingerprint(loaded.index), windows),
        len(windows),
        windows.shape[1],
        layers,
        loaded.hidden,
        loaded.num_experts,
    )
    traces = TraceFiles.open_or_create(folder, shape, windows)
    task = None
    if progress is not None:
        task = progress.add_task(
            "collect", total=shape.windows, completed=traces.windows_done, status=""
        )
    if traces.complete:
        return traces
    route_by_own_routers(loaded)
    ops = ops_for(loaded.family.name)
    sinks = {layer: [] for layer in layers}
    blocks = {}
    for site in loaded.sites:
        blocks[site.layer] = getattr(site.decoder_layer, site.block_attribute)
        wrapped = _Capture(blocks[site.layer], ops, sinks[site.layer])
        setattr(site.decoder_layer, site.block_attribute, wrapped)
    started, tokens_done = time.perf_counter(), 0
    lines = ProgressLines(log, "collection", "windows", shape.windows, traces.windows_done)
    # Half the pass budget: a layer's records of the pass are about its hidden states again.
    per_pass = windows_per_pass(shape.window, shape.hidden, pass_budget(loaded.memory_plan) // 2)
    try:
        for first in range(traces.windows_done, shape.windows, per_pass):
            part = windows[first : min(first + per_pass, shape.windows)]
            _run_pass(loaded, part, first, sinks, traces)
            for index in range(first, first + len(part)):
                traces.mark_done(index)
                tokens_done += shape.window
                if progress is not None:
                    rate = tokens_done / max(time.perf_counter() - started, 1e-9)
                    progress.update(task, advance=1, status=f"{rate:.0f} tok/s")
                if on_window is not None:
                    on_window(index, traces.window(index))
            if log is not None:
                lines.advance(first + len(part))
    finally:
        for site in loaded.sites:  # put the blocks back
            setattr(site.decoder_layer, site.block_attribute, blocks[site.layer])
    return traces


def route_by_own_routers(loaded: LoadedModel) -> None:
    """Streaming: the true routers at the native K, no heads (what the traces record)."""
    if loaded.routing is not None:
        loaded.routing.k = loaded.top_k
        loaded.routing.set_heads(None)


def _run_pass(
    loaded: LoadedModel, windows: np.ndarray, first: int, sinks: dict[int, list], traces
) -> None:
    """Teacher-forced forwards over `windows` (the collection's from `first`), a decoder layer
    at a time over all of them (`runtime/layer_major.py`: each MoE layer's experts read about
    once for the pass); each MoE layer's (x [T, H], logits [T, E]) of every window written as
    soon as the layer has run them, in the dtypes they are stored in. The LM head is not run."""

    def write(layer: int) -> None:
        if layer not in sinks:  # a dense layer
            return
        pairs = list(sinks[layer])
        sinks[layer].clear()
        x = np.stack([np.array(x[0].astype(mx.float32)) for x, _ in pairs])
        logits = np.stack([np.array(lg[0].astype(mx.float32)) for _, lg in pairs])
        x = np.clip(x, -FLOAT16_MAX, FLOAT16_MAX).astype(X_DTYPE)
        traces.write_layer(first, layer, x, logits)

    batches = [mx.array(window)[None] for window in windows]
    try:
        layer_major(loaded.model, batches, loaded.model, None, loaded.store, after_layer=write)
    finally:
        for sink in sinks.values():
            sink.clear()


def describe(shape: TraceShape) -> str:
    return (
        f"{shape.windows} windows of {shape.window} tokens x {len(shape.layers)} MoE layers "
        f"({format_bytes(shape.nbytes)} on disk)"
    )


def check_windows(windows: np.ndarray, window: int) -> None:
    if len(windows) < 2:
        raise Edge0Error(f"the text is too short: need at least {2 * window} tokens")

"""Reading routed experts from the checkpoint with pread, on a pool of reader threads.

Reads go straight into NumPy buffers with `os.preadv` (cold mmap page faults measured 3-4x slower
than pread on the reference Linux box). Just before each read, `mincore` over the exact byte ranges
says how much of it was already in the page cache, so every read reports its cold bytes.

Thread rule: reader threads only fill NumPy buffers. Turning them into MLX arrays happens on the
engine's thread (`to_mlx`), because MLX streams are thread-local on Metal.
"""

from __future__ import annotations

import errno
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checkpoint.index import CheckpointIndex, ExpertTensor, LayerExperts
from .page_cache import FileResidency

# NumPy has no bfloat16: BF16 data is read as uint16 and reinterpreted by MLX.
_NUMPY_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "F16": np.float16,
    "BF16": np.uint16,
    "U32": np.uint32,
    "I32": np.int32,
    "F32": np.float32,
    "U64": np.uint64,
    "I64": np.int64,
    "F64": np.float64,
}


@dataclass
class ReadResult:
    """The bytes of one expert (or one whole layer) as typed NumPy arrays, with accounting."""

    layer: int
    expert: int | None  # None: the whole layer, every expert stacked
    arrays: dict[str, np.ndarray | mx.array]  # "gate_proj.weight" -> array
    dtypes: dict[str, str]  # safetensors dtype of each array
    nbytes: int
    cold_bytes: int
    wall_ms: float


class ExpertReader:
    """Reads experts or whole layers of a checkpoint on `threads` reader threads."""

    def __init__(
        self,
        index: CheckpointIndex,
        threads: int = 4,
        widen_to_float32: bool = False,
        build_arrays: bool = False,
    ) -> None:
        self.index = index
        # On CPU the engine computes in float32: widening bf16/fp16 here, in NumPy on the reader
        # threads, keeps the engine thread from running MLX ops (which would wait behind the
        # forward pass it has queued) just to convert experts.
        self.widen_to_float32 = widen_to_float32
        # On the CPU backend the reader threads also copy the bytes into MLX arrays (no stream is
        # involved; checked to exit cleanly), so the engine thread does no per-expert copy at all.
        # On Metal that stays on the engine thread, where MLX wants all of its work.
        self.build_arrays = build_arrays
        # Two descriptors per shard, so the kernel's readahead serves each access pattern: none for
        # scattered expert reads (readahead would pull neighbouring experts in and hide cold reads),
        # aggressive for whole-layer reads.
        self._expert_fds = {shard: _open(shard, "POSIX_FADV_RANDOM") for shard in index.shards}
        self._layer_fds = {shard: _open(shard, "POSIX_FADV_SEQUENTIAL") for shard in index.shards}
        self._residency = {shard: FileResidency(shard) for shard in index.shards}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="edge0-read")

    def submit_expert(self, layer: int, expert: int) -> Future[ReadResult]:
        layer_experts = self.index.layers[layer]
        if not 0 <= expert < layer_experts.num_experts:
            raise IndexError(f"layer {layer} has no expert {expert}")
        return self._pool.submit(self._read, layer_experts, expert)

    def submit_layer(self, layer: int) -> Future[ReadResult]:
        return self._pool.submit(self._read, self.index.layers[layer], None)

    def _read(self, layer_experts: LayerExperts, expert: int | None) -> ReadResult:
        start = time.perf_counter()
        arrays, dtypes = {}, {}
        nbytes = cold = 0
        for tensor in layer_experts.tensors:
            offset, length, shape = _range_of(tensor, expert)
            file = tensor.entry.file
            cold += length - self._residency[file].resident_bytes(offset, length)
            buffer = np.empty(length, dtype=np.uint8)
            fds = self._layer_fds if expert is None else self._expert_fds
            self._pread_into(fds[file], buffer, offset, file)
            key = f"{tensor.projection}.{tensor.part}"
            array = buffer.view(_NUMPY_DTYPES[tensor.entry.dtype]).reshape(shape)
            dtype = tensor.entry.dtype
            if self.widen_to_float32 and dtype in ("BF16", "F16"):
                array, dtype = _to_float32(array, dtype), "F32"
            arrays[key] = _host_to_mlx(array, dtype) if self.build_arrays else array
            dtypes[key] = dtype
            nbytes += length
        wall_ms = (time.perf_counter() - start) * 1e3
        return ReadResult(layer_experts.layer, expert, arrays, dtypes, nbytes, cold, wall_ms)

    def _pread_into(self, fd: int, buffer: np.ndarray, offset: int, file: Path) -> None:
        view = memoryview(buffer)
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(file)) from None
            if n == 0:
                raise OSError(
                    errno.EIO, f"unexpected end of file at byte {offset + done}", str(file)
                )
            done += n

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in [*self._expert_fds.values(), *self._layer_fds.values()]:
            os.close(fd)
        for residency in self._residency.values():
            residency.close()
        self._expert_fds.clear()
        self._layer_fds.clear()


def _open(path: Path, advice: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # Linux; macOS has no fadvise
        os.posix_fadvise(fd, 0, 0, getattr(os, advice))
    return fd


def _range_of(tensor: ExpertTensor, expert: int | None) -> tuple[int, int, tuple[int, ...]]:
    if expert is None:
        return tensor.entry.offset, tensor.entry.nbytes, tensor.entry.shape
    offset, length = tensor.expert_range(expert)
    return offset, length, tensor.expert_shape


def _to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _host_to_mlx(array: np.ndarray, dtype: str) -> mx.array:
    value = mx.array(array)  # a copy into MLX memory, ready at once
    return value.view(mx.bfloat16) if dtype == "BF16" else value


def to_mlx(result: ReadResult, float_dtype: mx.Dtype | None) -> dict[str, mx.array]:
    """MLX arrays for a read (engine thread only). Floating tensors are cast to `float_dtype`;
    arrays built from host memory are ready at once, so nothing here waits on the stream."""
    out = {}
    for key, array in result.arrays.items():
        value = array if isinstance(array, mx.array) else _host_to_mlx(array, result.dtypes[key])
        if (
            float_dtype is not None
            and mx.issubdtype(value.dtype, mx.floating)
            and value.dtype != float_dtype
        ):
            value = value.astype(float_dtype)
        out[key] = value
    return out

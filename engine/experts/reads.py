"""Reading routed experts from the checkpoint with pread, on a pool of reader threads (a small
miss the forward waits for: on the thread that needs it).

Reads go straight into NumPy buffers with `os.preadv` (cold mmap page faults were measured slower
than pread on the reference Linux box: docs/notebook/figures-from-code-comments.md).
Just before each read, `mincore` over the exact byte ranges
says how much of it was already in the page cache, so every read reports its cold bytes.

Where the bytes land: an expert the store reads goes into its slot of a `SlotBank` (`into`):
`pread` straight into the bank's MLX memory when the dtypes agree, else into a scratch buffer and
copied into the slot (bf16 scales into the high halves of a CPU bank's float32s: that is the
widening, `SlotPart.widens_bf16`) or converted. No MLX op runs on a reader, on
any backend. A whole layer (prefill) lands, on the CPU backend, in MLX arrays allocated by the
reader thread (`pread` into the array's memory, casts evaluated there); on Metal, where MLX wants
its work on the engine's thread, in NumPy buffers that `to_mlx` turns into arrays.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import itertools
import os
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checkpoint.index import CheckpointIndex, LayerExperts
from ..trace import NO_TRACE, Tracer
from .page_cache import FileResidency
from .read_pacing import ReadPacer

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


# Read priorities: reads the forward waits for now go first, then reads ahead by layer.
NOW = (0, 0)
AHEAD = (1,)
# An expert at least this big that the forward waits for is read in parts, one per projection, on
# as many threads; below it the per-read fixed cost outweighs what parallel parts would save.
SPLIT_BYTES = 1 << 20
# A read ahead reads tensors bigger than this in chunks of it, with reads needed now in between.
READ_AHEAD_CHUNK = 256 << 10


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


MLX_DTYPES = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "F32": mx.float32,
    "U64": mx.uint64,
    "I64": mx.int64,
}


@dataclass(frozen=True)
class _TensorPlan:
    """One stacked expert tensor of a layer, with where and how to read it."""

    key: str  # "gate_proj.weight"
    file: Path
    expert_fd: int
    layer_fd: int
    residency: FileResidency
    offset: int  # of expert 0
    expert_nbytes: int
    expert_shape: tuple[int, ...]
    whole_nbytes: int
    whole_shape: tuple[int, ...]
    numpy_dtype: type
    dtype: str  # safetensors dtype


class ExpertReader:
    """Reads experts or whole layers of a checkpoint on `threads` reader threads."""

    def __init__(
        self,
        index: CheckpointIndex,
        threads: int = 4,
        widen_to_float32: bool = False,
        build_arrays: bool = False,
        bypass_page_cache: bool = False,
        tracer: Tracer = NO_TRACE,
        pacer: ReadPacer | None = None,
    ) -> None:
        self.index = index
        self.tracer = tracer
        # A simulated disk of a set bandwidth for cold bytes (bench --read-limit-by pacing).
        self.pacer = pacer
        # On CPU the engine computes in float32: widening bf16/fp16 here, in NumPy on the reader
        # threads, keeps the engine thread from running MLX ops (which would wait behind the
        # forward pass it has queued) just to convert experts.
        self.widen_to_float32 = widen_to_float32
        # On the CPU backend reads land in MLX arrays made on the reader threads (checked to exit
        # cleanly), so the engine thread does no per-expert work at all; on Metal that stays on
        # the engine thread, where MLX wants all of its work.
        self.build_arrays = build_arrays
        # Two descriptors per shard, so the kernel's readahead serves each access pattern: none for
        # scattered expert reads (readahead would pull neighbouring experts in and hide cold reads),
        # aggressive for whole-layer reads.
        # `bypass_page_cache`: macOS's F_NOCACHE, its stand-in for a page-cache budget.
        self._expert_fds = {
            shard: _open(shard, "POSIX_FADV_RANDOM", bypass_page_cache) for shard in index.shards
        }
        self._layer_fds = {
            shard: _open(shard, "POSIX_FADV_SEQUENTIAL", bypass_page_cache)
            for shard in index.shards
        }
        self._residency = {shard: FileResidency(shard) for shard in index.shards}
        self._plans: dict[int, list[_TensorPlan]] = {}
        self._local = threading.local()
        self._queue = ReadQueue(threads, "edge0-read")

    @property
    def native_ids(self) -> set[int]:
        """The reader threads' native thread ids."""
        return self._queue.native_ids

    def submit_expert(
        self,
        layer: int,
        expert: int,
        ahead: bool = False,
        step: int = 0,
        into: dict[str, np.ndarray] | None = None,
    ) -> Future[ReadResult]:
        """Read one expert: needed now, or `ahead` for `step` (reads ahead go after every read the
        forward waits for, by the step and then the layer that will use them). With `into` (a
        slot of a `SlotBank`), the bytes land there, converted to the slot's dtypes, and the
        result holds no arrays."""
        layer_experts = self.index.layers[layer]
        if not 0 <= expert < layer_experts.num_experts:
            raise IndexError(f"layer {layer} has no expert {expert}")
        submitted = self.tracer.now()
        read = self._read if into is None else self._read_into
        if ahead:
            return self._queue.submit(
                (AHEAD[0], step, layer), read, layer_experts, expert, submitted, True, into
            )
        plans = self._plans_of(layer_experts)
        if layer_experts.expert_nbytes < SPLIT_BYTES:
            # A small miss is read at once by the thread that needs it: a hand-off to a reader
            # (wake-up, GIL, future) cost more than reading a demo-sized expert from the page
            # cache, and so did queueing it for this thread to run (figures:
            # docs/notebook/figures-from-code-comments.md).
            return _run_here(read, layer_experts, expert, submitted, False, into)
        # A miss the forward waits for: one read per projection, so that every free thread (the
        # waiting engine thread included) reads a part of it at once.
        by_projection: dict[str, list[_TensorPlan]] = {}
        for plan in plans:
            by_projection.setdefault(plan.key.split(".")[0], []).append(plan)
        parts = [
            self._queue.submit(NOW, read, layer_experts, expert, submitted, False, into, group)
            for group in by_projection.values()
        ]
        return _joined(parts)

    def submit_layer(self, layer: int, ahead: bool = False) -> Future[ReadResult]:
        priority = (AHEAD[0], 0, layer) if ahead else NOW
        return self._queue.submit(
            priority, self._read, self.index.layers[layer], None, self.tracer.now(), ahead
        )

    def _read(
        self,
        layer_experts: LayerExperts,
        expert: int | None,
        submitted: float,
        ahead: bool,
        into: None = None,  # (an expert read into a bank slot is `_read_into`)
        plans: list[_TensorPlan] | None = None,
    ) -> ReadResult:
        """Read an expert (or the whole layer, `expert` None): its tensors, or only `plans`, into
        arrays of their own."""
        start = time.perf_counter()
        what = f"{layer_experts.layer}.{'all' if expert is None else expert}"
        self.tracer.complete(f"queued {what}", "read", submitted, start)
        arrays, dtypes = {}, {}
        nbytes = cold = 0
        tracer = self.tracer
        plans = plans or self._plans_of(layer_experts)
        # A whole layer's cold bytes are counted before any of it is read: the kernel's readahead
        # for one tensor runs megabytes into the next, and `mincore` just before that one's read
        # counted those pages warm. Counted first, the figure is higher but still below what the
        # disk delivers under a cgroup that takes pages back
        # (docs/notebook/2026-12-reads-under-compute.md, "prefill's cold count").
        layer_cold = (
            [self._cold_bytes(plan, plan.offset, plan.whole_nbytes) for plan in plans]
            if expert is None
            else None
        )
        # One tensor at a time, read then copied, so that a whole layer's bytes are never held
        # twice (host buffer and MLX array) under a tight memory limit.
        for i, plan in enumerate(plans):
            if expert is None:
                offset, length, fd = plan.offset, plan.whole_nbytes, plan.layer_fd
                shape = plan.whole_shape
            else:
                offset, length = plan.offset + expert * plan.expert_nbytes, plan.expert_nbytes
                fd, shape = plan.expert_fd, plan.expert_shape
            began = tracer.now()
            whole_on_cpu = self.build_arrays and expert is None
            if whole_on_cpu:  # a whole layer lands in MLX memory: no second copy of its bytes
                buffer = mx.zeros((length,), dtype=mx.uint8)
                mx.eval(buffer)
            elif self.build_arrays:  # an expert: this thread's scratch buffer, copied below
                buffer = self._scratch(length)
            else:
                buffer = np.empty(length, dtype=np.uint8)
            cold_now = None if layer_cold is None else layer_cold[i]
            tensor_cold = self._read_paced(plan, fd, buffer, offset, length, began, cold_now)
            read = tracer.now()
            tracer.complete(f"pread {what}", "read", began, read, bytes=length, cold=tensor_cold)
            widen = self.widen_to_float32 and plan.dtype in ("BF16", "F16")
            if whole_on_cpu:
                array = buffer.view(MLX_DTYPES[plan.dtype]).reshape(shape)
                if widen:
                    array = array.astype(mx.float32)
                mx.eval(array)  # here, so the engine's stream gets a ready array
            else:
                array = buffer.view(plan.numpy_dtype).reshape(shape)
                if widen:
                    array = _to_float32(array, plan.dtype)
                if self.build_arrays:
                    # A plain copy on this thread: no MLX evaluation, which would hand off to this
                    # thread's stream and back twice per tensor and, with the forward keeping the
                    # cores busy, wait for a core each time (a trace showed it per expert).
                    array = _host_to_mlx(array, "F32" if widen else plan.dtype)
            arrays[plan.key] = array
            dtypes[plan.key] = "F32" if widen else plan.dtype
            tracer.complete(f"to array {what}", "read", read, tracer.now())
            nbytes += length
            cold += tensor_cold
            if ahead:
                # Between two tensors of a read ahead, a read the forward waits for goes first:
                # a miss then has every reader thread within one tensor's read, instead of
                # sharing the disk with reads that are not needed until later layers.
                self._queue.run_urgent()
        end = time.perf_counter()
        wall_ms = (end - start) * 1e3
        return ReadResult(layer_experts.layer, expert, arrays, dtypes, nbytes, cold, wall_ms)

    def _read_into(
        self,
        layer_experts: LayerExperts,
        expert: int,
        submitted: float,
        ahead: bool,
        into: dict[str, np.ndarray],
        plans: list[_TensorPlan] | None = None,
    ) -> ReadResult:
        """Read an expert (its tensors, or only `plans`) into a bank slot, `into`: straight into
        the slot's bytes where the dtypes agree, else through this thread's scratch buffer and
        copied or converted into it (bf16 scales widened to float32 on the CPU:
        `SlotPart.widens_bf16`). The result holds no arrays."""
        start = time.perf_counter()
        tracer = self.tracer
        traced = tracer.enabled
        what = f"{layer_experts.layer}.{expert}" if traced else ""
        if traced:
            tracer.complete(f"queued {what}", "read", submitted, start)
        # Every step of this loop is paid per tensor, and a small expert's tensors (the demo's)
        # cost less to read from the page cache than the bookkeeping around them.
        nbytes = cold = 0
        for plan in plans or self._plans_of(layer_experts):
            slot = into[plan.key]
            length = plan.expert_nbytes
            offset = plan.offset + expert * length
            direct = slot.dtype == plan.numpy_dtype and slot.flags.c_contiguous
            buffer = slot if direct else self._scratch(length)
            began = time.perf_counter()
            if ahead and length > READ_AHEAD_CHUNK:
                tensor_cold = self._read_ahead_in_chunks(plan, buffer, offset, length)
            else:
                tensor_cold = self._read_paced(plan, plan.expert_fd, buffer, offset, length, began)
            if not direct:
                convert_into(buffer.view(plan.numpy_dtype).reshape(slot.shape), plan.dtype, slot)
            if traced:
                tracer.complete(
                    f"pread {what}", "read", began, tracer.now(), bytes=length, cold=tensor_cold
                )
            nbytes += length
            cold += tensor_cold
            if ahead:  # between two tensors of a read ahead, a read needed now goes first
                self._queue.run_urgent()
        wall_ms = (time.perf_counter() - start) * 1e3
        return ReadResult(layer_experts.layer, expert, {}, {}, nbytes, cold, wall_ms)

    def _read_ahead_in_chunks(
        self, plan: _TensorPlan, buffer: np.ndarray, offset: int, length: int
    ) -> int:
        """Read a big tensor of a read ahead in chunks, doing any read needed now between two
        (returns its cold bytes). A miss that arrives meanwhile then waits behind one chunk per
        reader instead of one tensor: a disk serves requests in turn (the pacer models that). On
        the paced wall, layer 0's misses had waited behind whole tensors read ahead, and chunking
        shortened prerouter's step (docs/notebook/2026-12-reads-under-compute.md, "Reads ahead in
        ... chunks")."""
        flat = memoryview(buffer).cast("B")
        cold = 0
        for start in range(0, length, READ_AHEAD_CHUNK):
            end = min(start + READ_AHEAD_CHUNK, length)
            cold += self._read_paced(
                plan,
                plan.expert_fd,
                flat[start:end],
                offset + start,
                end - start,
                time.perf_counter(),
            )
            if end < length:
                self._queue.run_urgent()
        return cold

    def _read_paced(
        self,
        plan: _TensorPlan,
        fd: int,
        buffer: np.ndarray | memoryview | mx.array,
        offset: int,
        length: int,
        began: float,
        cold: int | None = None,
    ) -> int:
        """Fill `buffer` with the `length` bytes at `offset` of `plan`'s file, held to the
        pacer's bandwidth (read began at `began`); returns the bytes that were cold (`cold`:
        counted already, else by `mincore` now)."""
        if cold is None:
            cold = self._cold_bytes(plan, offset, length)
        self._pread_into(fd, buffer, offset, plan.file)
        if self.pacer is not None:
            self.pacer.pace(cold, began)
        return cold

    @staticmethod
    def _cold_bytes(plan: _TensorPlan, offset: int, length: int) -> int:
        """Bytes of the range not in the page cache now, by `mincore`: asked just before its read.
        (Reading with `preadv(RWF_NOWAIT)` first would spare the mincore of a warm read, but it
        undercounted cold bytes under a page-cache budget on this kernel: it counted warm many
        decode reads that mincore counts cold.)"""
        return length - plan.residency.resident_bytes(offset, length)

    def _scratch(self, nbytes: int) -> np.ndarray:
        """This thread's reusable read buffer, grown to the largest expert tensor seen. Reusing
        it keeps the host heap flat: a fresh buffer per read grew RSS by glibc's per-thread
        arenas until a tight memory limit killed the process."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or buffer.size < nbytes:
            buffer = self._local.scratch = np.empty(nbytes, dtype=np.uint8)
        return buffer[:nbytes]

    def _plans_of(self, layer_experts: LayerExperts) -> list[_TensorPlan]:
        """Each expert tensor of a layer with its file handles resolved, made once per layer: a
        read of a small expert is mostly per-tensor bookkeeping, so keep that to the minimum."""
        plans = self._plans.get(layer_experts.layer)
        if plans is None:
            plans = [
                _TensorPlan(
                    key=f"{t.projection}.{t.part}",
                    file=t.entry.file,
                    expert_fd=self._expert_fds[t.entry.file],
                    layer_fd=self._layer_fds[t.entry.file],
                    residency=self._residency[t.entry.file],
                    offset=t.entry.offset,
                    expert_nbytes=t.expert_nbytes,
                    expert_shape=t.expert_shape,
                    whole_nbytes=t.entry.nbytes,
                    whole_shape=t.entry.shape,
                    numpy_dtype=_NUMPY_DTYPES[t.entry.dtype],
                    dtype=t.entry.dtype,
                )
                for t in layer_experts.tensors
            ]
            self._plans[layer_experts.layer] = plans
        return plans

    def _pread_into(
        self, fd: int, buffer: np.ndarray | memoryview, offset: int, file: Path
    ) -> None:
        """Fill `buffer` (contiguous) from `offset` of the file. The buffer goes to `preadv` as
        it is (no memoryview to make for the read that nearly always fills it at once); a short
        read goes on from where it stopped."""
        remaining = buffer
        done = 0
        while done < buffer.nbytes:
            try:
                n = os.preadv(fd, [remaining], offset + done)
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(file)) from None
            if n == 0:
                raise OSError(
                    errno.EIO, f"unexpected end of file at byte {offset + done}", str(file)
                )
            done += n
            remaining = memoryview(buffer).cast("B")[done:]

    def wait(self, future: Future[ReadResult]) -> None:
        """Wait for a read, doing reads needed now on this thread meanwhile."""
        self._queue.help_until(future)

    def close(self) -> None:
        self._queue.shutdown()
        for fd in [*self._expert_fds.values(), *self._layer_fds.values()]:
            os.close(fd)
        for residency in self._residency.values():
            residency.close()
        self._expert_fds.clear()
        self._layer_fds.clear()


class ReadQueue:
    """Reader threads that take the most urgent read first: lowest `priority`, then oldest.

    Reads issued a step ahead are queued by the layer that will use them; a read the forward is
    blocked on now goes before all of them. (A plain FIFO pool made the first layers' on-demand
    misses wait behind every read issued ahead for later layers.)"""

    def __init__(self, threads: int, name: str) -> None:
        self._heap: list = []
        self.native_ids: set[int] = set()  # the reader threads', once started
        started = threading.Semaphore(0)
        self._order = itertools.count()  # FIFO among equal priorities
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(started,), name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()
        for _ in self._threads:  # every reader has said who it is (reader_core.py pins them)
            started.acquire()

    def submit(self, priority: tuple, fn, *args) -> Future:
        """Queue `fn(*args)` for the first free reader."""
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the expert reader is closed")
            heapq.heappush(self._heap, (priority, next(self._order), future, fn, args))
            self._ready.notify()
        return future

    def run_urgent(self) -> None:
        """Run the queued reads that are needed now, if any, on the calling thread."""
        while True:
            with self._ready:
                if not (self._heap and self._heap[0][0] < AHEAD):
                    return
                item = heapq.heappop(self._heap)
            _run(item)
            del item

    def help_until(self, future: Future) -> None:
        """Until `future` is done, the calling thread runs queued reads that are needed now (the
        parts of a big miss): a thread that would only wait reads a part itself."""
        while not future.done():
            with self._ready:
                urgent = self._heap and self._heap[0][0] < AHEAD
                item = heapq.heappop(self._heap) if urgent else None
            if item is None:
                wait([future])
                return
            _run(item)
            del item

    def _work(self, started: threading.Semaphore) -> None:
        self.native_ids.add(threading.get_native_id())
        started.release()
        while True:
            with self._ready:
                while not self._heap and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                item = heapq.heappop(self._heap)
            _run(item)
            # An idle thread must not keep its last read (a whole layer, maybe) alive.
            del item

    def shutdown(self) -> None:
        """Cancel queued reads, let running ones finish, stop the threads."""
        with self._ready:
            self._closed = True
            for _, _, future, _, _ in self._heap:
                future.cancel()
            self._heap.clear()
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()


def _run(item: tuple) -> None:
    _, _, future, fn, args = item
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # handed to whoever waits on the read
        future.set_exception(e)


def _run_here(fn, *args) -> Future:
    """`fn(*args)` run now, on this thread, as a finished future (its result or its error)."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # handed to whoever waits on the read, as a queued read's is
        future.set_exception(e)
    return future


def _joined(parts: list[Future[ReadResult]]) -> Future[ReadResult]:
    """One future for the reads of an expert's parts: their arrays and accounting together."""
    joined: Future[ReadResult] = Future()
    joined.set_running_or_notify_cancel()
    remaining = [len(parts)]
    lock = threading.Lock()

    def part_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        if any(p.cancelled() for p in parts):
            joined.set_exception(RuntimeError("the expert reader is closed"))
        elif any(p.exception() is not None for p in parts):
            joined.set_exception(next(p.exception() for p in parts if p.exception()))
        else:
            results = [p.result() for p in parts]
            first = results[0]
            joined.set_result(
                ReadResult(
                    first.layer,
                    first.expert,
                    {k: v for r in results for k, v in r.arrays.items()},
                    {k: v for r in results for k, v in r.dtypes.items()},
                    sum(r.nbytes for r in results),
                    sum(r.cold_bytes for r in results),
                    max(r.wall_ms for r in results),
                )
            )

    for part in parts:
        part.add_done_callback(part_done)
    return joined


def _open(path: Path, advice: str, bypass_page_cache: bool = False) -> int:
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # Linux; macOS has no fadvise
        os.posix_fadvise(fd, 0, 0, getattr(os, advice))
    if bypass_page_cache and hasattr(fcntl, "F_NOCACHE"):  # macOS: reads skip the page cache
        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
    return fd


def _to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def convert_into(source: np.ndarray, dtype: str, slot: np.ndarray) -> None:
    """Write `source` (safetensors `dtype`) into `slot` in the slot's dtype, rounding as MLX's
    `astype` does (bfloat16 slots are stored as uint16: round to nearest even)."""
    if slot.dtype == source.dtype:  # a bank that widens bf16: its floats' high halves, as they are
        slot[...] = source
    elif slot.dtype == np.uint16:  # bfloat16: the top half of a float32, rounded
        bits = _to_float32(source, dtype).view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        nan = np.isnan(bits.view(np.float32))
        slot[...] = np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)
    elif slot.dtype == np.float32 and dtype == "BF16":  # widened in place, no temporary
        # (Copying the halves with two strided writes is no faster for the demo's small scales
        # and slower for the wall's larger ones: docs/notebook/figures-from-code-comments.md.)
        np.left_shift(source, 16, out=slot.view(np.uint32), dtype=np.uint32)
    elif slot.dtype in (np.float32, np.float16):
        slot[...] = _to_float32(source, dtype)
    else:
        raise ValueError(f"no conversion from {dtype} to {slot.dtype}")


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

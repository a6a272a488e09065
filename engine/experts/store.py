"""The expert store: routed experts on demand from the checkpoint, through the bounded pool.

`fetch` returns the experts a layer routes to, reading the missing ones in parallel (the forward
waits, and that wait is blocked-on-load time). `whole_layer` serves prefill chunks that touch most of
a layer: it reads the layer's stacked tensors whole, and starts reading the next MoE layer while this
one computes. Whole-layer buffers live outside the pool's budget and are released after their layer.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx

from ..checkpoint.index import DTYPE_SIZES, CheckpointIndex
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..trace import NO_TRACE, Tracer
from .page_cache_budget import CAN_EVICT_RANGES, PageCacheBudget
from .pool import ExpertKey, ExpertPool, ResidentExpert
from .read_pacing import ReadPacer
from .reader_core import pin_threads, reader_cores, unpin_all_threads
from .reads import ExpertReader, ReadResult, to_mlx


@dataclass
class LoadCounters:
    """What the expert store did during one step."""

    loads: int = 0  # experts read from the checkpoint
    hits: int = 0  # routed experts found resident
    bytes_read: int = 0
    cold_bytes: int = 0  # of bytes_read, those not in the page cache before the read
    read_ms: float = 0.0  # sum of per-read wall times (reads overlap on the reader threads)
    blocked_ms: float = 0.0  # time the forward waited for expert bytes
    whole_layer_reads: int = 0
    whole_layer_bytes: int = 0  # bytes read as whole layers (prefill), outside the cache budget
    transient_peak_bytes: int = 0  # most whole-layer buffer bytes held at once
    prefetch_issued: int = 0  # expert reads issued ahead for this step (prerouter)
    prefetch_in_time: int = 0  # of those, already read when the layer needed them
    prefetch_late: int = 0  # of those, still being read when the layer needed them (blocked)
    page_cache_evicted_bytes: int = 0  # expert bytes dropped from the page cache (its budget)


class ExpertStore:
    def __init__(
        self,
        index: CheckpointIndex,
        config: EngineConfig,
        float_dtype: mx.Dtype | None,
        tracer: Tracer = NO_TRACE,
    ):
        self.index = index
        self.tracer = tracer
        self.float_dtype = float_dtype
        self.whole_layer_fraction = config.whole_layer_fraction
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        # (compute cores, reader cores), or None: nothing pinned (see reader_core.py).
        self._cores = reader_cores() if config.reader_core else None
        self._process_cores = os.sched_getaffinity(0) if self._cores else None
        self.reader = ExpertReader(
            index,
            config.reader_threads,
            widen_to_float32=float_dtype == mx.float32,
            build_arrays=on_cpu,
            # Without range eviction (macOS), a page-cache budget means reads bypass the cache.
            bypass_page_cache=config.page_cache_bytes is not None and not CAN_EVICT_RANGES,
            tracer=tracer,
            pacer=ReadPacer(config.read_pace_bps) if config.read_pace_bps else None,
        )
        self._reader_core_on = False
        # Set by the loader once the resident weights are read (`set_page_cache_budget`).
        self.page_cache: PageCacheBudget | None = None
        self.pool = ExpertPool(config.expert_cache_bytes, config.eviction)
        self.counters = LoadCounters()
        self._moe_layers = sorted(index.layers)
        self._pending_layers: dict[int, Future[ReadResult]] = {}
        # Reads issued ahead for a coming step's predicted experts, with the step they are for.
        # Each holds a reservation of its expert's bytes in the pool until it is used or dropped.
        self._staged: dict[ExpertKey, tuple[int, Future[ReadResult]]] = {}
        self._issued_for_next_step = 0
        self._expert_nbytes: dict[int, int] = {}  # per layer, see `resident_expert_nbytes`
        # When a list, every fetch appends (step, layer, experts): the routing trace that the eviction
        # benchmark replays.
        self.trace: list[tuple[int, int, list[int]]] | None = None

    def set_page_cache_budget(self, budget_bytes: int | None) -> None:
        """Keep at most `budget_bytes` of expert bytes in the OS page cache (None: no budget).
        A new budget starts cold: every expert page is dropped first."""
        if budget_bytes is None:
            if self.page_cache is not None:
                self.page_cache.close()
            self.page_cache = None
            return
        if self.page_cache is None:
            self.page_cache = PageCacheBudget(self.index, budget_bytes)
            self.page_cache.evict_all()
        else:
            self.page_cache.set_budget(budget_bytes)

    def trace_to(self, tracer: Tracer) -> None:
        """Record reads and blocked waits in `tracer` from now on."""
        self.tracer = self.reader.tracer = tracer

    def resident_expert_nbytes(self, layer: int) -> int:
        """MLX bytes one expert of `layer` takes once resident (floating parts in compute dtype)."""
        known = self._expert_nbytes.get(layer)
        if known is not None:
            return known
        total = 0
        for tensor in self.index.layers[layer].tensors:
            nbytes = tensor.expert_nbytes
            if self.float_dtype is not None and tensor.entry.dtype in ("BF16", "F16", "F32"):
                nbytes = nbytes // DTYPE_SIZES[tensor.entry.dtype] * self.float_dtype.size
            total += nbytes
        self._expert_nbytes[layer] = total
        return total

    def check_budget(self, top_k: int) -> None:
        """Refuse a budget that cannot hold one layer's routed set."""
        need = max(self.resident_expert_nbytes(layer) for layer in self._moe_layers) * top_k
        if self.pool.budget_bytes < need:
            raise Edge0Error(
                f"{self.index.model_dir}: an expert cache of {format_bytes(self.pool.budget_bytes)} "
                f"cannot hold the {top_k} experts one layer routes to; the minimum is "
                f"{format_bytes(need)} ({need} bytes)"
            )

    # -- steps -----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.counters = LoadCounters(prefetch_issued=self._issued_for_next_step)
        self._issued_for_next_step = 0
        self.pool.step += 1

    def end_step(self) -> LoadCounters:
        pending, self._pending_layers = self._pending_layers, {}
        for future in pending.values():
            if future.exception() is None:
                self._account(future.result())  # a read already issued still cost its bytes
        self.pool.unpin_through(self.pool.step)
        self._drop_unused_reads_ahead()
        self._enforce_page_cache()
        return self.counters

    def _drop_unused_reads_ahead(self) -> None:
        """Forget reads ahead made for this step that it did not use. In prefetch mode the true
        router routes, so a mispredicted expert's read is never consumed; kept, its bytes sat
        outside the pool's budget until the request ended (2.5 MiB per miss: a 384 MiB wall was
        killed within a few steps). One not started is cancelled (its disk time is not wasted); one
        in flight finishes on its own and is dropped."""
        step = self.pool.step
        stale = [key for key, (for_step, _) in self._staged.items() if for_step <= step]
        for key in stale:
            self._staged.pop(key)[1].cancel()
            self.pool.release(self.resident_expert_nbytes(key[0]))

    def reset(self) -> None:
        """Forget per-request state; resident experts stay (they are still the checkpoint's)."""
        self.end_step()
        for layer, _ in self._staged:  # reads in flight finish on their own; their bytes unused
            self.pool.release(self.resident_expert_nbytes(layer))
        self._staged.clear()
        self._issued_for_next_step = 0

    # -- reads ahead (prerouter) -------------------------------------------------------------------

    def stage(self, layer: int, experts: list[int]) -> None:
        """The next step routes `layer` to `experts`: pin the resident ones, start reading the rest
        (after this step's own reads ahead, if this step is still running)."""
        for expert in experts:
            key = (layer, expert)
            if key in self.pool:
                self.pool.pin(key, self.pool.step + 1)
            elif key not in self._staged:
                # Room in the budget first: a read ahead lands in memory the pool accounts for.
                # Without room (a budget below one step's reads) the layer reads it when it runs.
                if not self.pool.reserve(self.resident_expert_nbytes(layer)):
                    continue
                step = self.pool.step + 1
                self._staged[key] = (
                    step,
                    self.reader.submit_expert(layer, expert, ahead=True, step=step),
                )
                self._issued_for_next_step += 1
                if self.page_cache is not None:  # in the cache once read, used or not
                    self.page_cache.note_read(layer, expert)

    def layer_computed(self, layer: int) -> None:
        """`layer` has computed this step: the experts pinned for it may be evicted again, which
        makes room for the next step's reads ahead while this step still runs."""
        self.pool.unpin_layer(layer)

    def load_all(self) -> None:
        """Read every expert into the pool (budget permitting): for the bench's compute-only arm,
        whose steps then read nothing and measure the compute a step cannot go below."""
        for layer in self._moe_layers:
            self.fetch(layer, list(range(self.index.layers[layer].num_experts)))
        self.end_step()

    # -- per-expert path ---------------------------------------------------------------------------

    def fetch(self, layer: int, experts: list[int]) -> list[ResidentExpert]:
        """The resident experts for `experts` of `layer`, reading those that are missing."""
        if self.trace is not None:
            self.trace.append((self.pool.step, layer, list(experts)))
        keys = [(layer, e) for e in experts]
        found: dict[ExpertKey, ResidentExpert] = {}
        missing = []
        for key in keys:
            resident = self.pool.get(key)
            if resident is None:
                missing.append(key)
            else:
                found[key] = resident
        self.counters.hits += len(found)
        if missing:
            start = time.perf_counter()
            futures = [self._staged_or_submit(key) for key in missing]
            for key, (future, how) in zip(missing, futures):
                waited = self.tracer.now()
                self.reader.wait(future)
                result = _result_or_error(future, f"layer {layer} expert {key[1]}")
                self.tracer.complete(
                    f"blocked {layer}.{key[1]}", "blocked", waited, self.tracer.now(), read=how
                )
                arrays = to_mlx(result, self.float_dtype)
                expert = ResidentExpert(arrays, sum(a.nbytes for a in arrays.values()))
                self.pool.put(key, expert, protected=keys)
                found[key] = expert
                self._account(result)
                self.counters.loads += 1
            self.counters.blocked_ms += (time.perf_counter() - start) * 1e3
        return [found[key] for key in keys]

    def _staged_or_submit(self, key: ExpertKey) -> tuple[Future[ReadResult], str]:
        """The read of a missing expert and how it was issued: "ahead, in time" / "ahead, late"
        (staged by the prerouter) or "on demand" (submitted now)."""
        staged = self._staged.pop(key, None)
        if staged is None:
            return self.reader.submit_expert(*key), "on demand"
        future = staged[1]
        self.pool.release(self.resident_expert_nbytes(key[0]))  # `fetch` puts it in the pool
        if future.done():
            self.counters.prefetch_in_time += 1
            return future, "ahead, in time"
        self.counters.prefetch_late += 1
        return future, "ahead, late"

    # -- whole-layer path (prefill) ----------------------------------------------------------------

    def wants_whole_layer(self, layer: int, distinct_experts: int) -> bool:
        """Read the layer whole if its read is already under way or the chunk touches enough of it."""
        if layer in self._pending_layers:
            return True
        return distinct_experts > self.whole_layer_fraction * self.index.layers[layer].num_experts

    def whole_layer(self, layer: int) -> dict[str, mx.array]:
        """The layer's stacked expert tensors; starts reading the next MoE layer before returning."""
        start = time.perf_counter()
        future = self._pending_layers.pop(layer, None) or self.reader.submit_layer(layer)
        self.reader.wait(future)
        result = _result_or_error(future, f"layer {layer} (whole)")
        self.tracer.complete(f"blocked {layer}.all", "blocked", start, self.tracer.now())
        arrays = to_mlx(result, self.float_dtype)
        self._account(result)
        self.counters.whole_layer_reads += 1
        self.counters.whole_layer_bytes += result.nbytes
        self._enforce_page_cache()  # a prefill reads layer after layer: keep the wall as it goes
        self.counters.blocked_ms += (time.perf_counter() - start) * 1e3

        # The previous layer's buffers are released once its output is computed; at most this
        # layer's arrays and the next layer's read are held.
        held = sum(a.nbytes for a in arrays.values())
        following = [n for n in self._moe_layers if n > layer]
        if following:
            self._pending_layers[following[0]] = self.reader.submit_layer(following[0], ahead=True)
            held += self.index.layers[following[0]].nbytes
        self.counters.transient_peak_bytes = max(self.counters.transient_peak_bytes, held)
        return arrays

    def _account(self, result: ReadResult) -> None:
        self.counters.bytes_read += result.nbytes
        self.counters.cold_bytes += result.cold_bytes
        self.counters.read_ms += result.wall_ms
        if self.page_cache is not None:
            self.page_cache.note_read(result.layer, result.expert)

    def _enforce_page_cache(self) -> None:
        if self.page_cache is not None:
            self.counters.page_cache_evicted_bytes += self.page_cache.enforce()

    def use_reader_core(self, on: bool) -> None:
        """Readers on a core of their own (`on`, prerouter mode), or every thread anywhere."""
        if not self._cores or on == self._reader_core_on:
            return
        if on:
            pin_threads(*self._cores, self.reader.native_ids)
        else:
            unpin_all_threads(self._process_cores)
        self._reader_core_on = on

    def close(self) -> None:
        self._pending_layers.clear()
        self.reader.close()
        self.use_reader_core(False)
        self.set_page_cache_budget(None)
        self.pool.clear()


def _result_or_error(future: Future[ReadResult], what: str) -> ReadResult:
    """The read's result; a failed read becomes an Edge0Error naming the file and the expert."""
    try:
        return future.result()
    except OSError as e:
        where = e.filename or "checkpoint"
        raise Edge0Error(f"{where}: read error while loading {what} ({e.strerror or e})") from None

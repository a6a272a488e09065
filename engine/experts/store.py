"""The expert store: routed experts on demand from the checkpoint, through the bounded pool.

`fetch` returns the slots of the experts a layer routes to, reading the missing ones in parallel
(the forward waits, and that wait is blocked-on-load time); the layer computes them over its slot
bank (`bank`). `whole_layer` serves prefill chunks that touch most of a layer: it reads the layer's
stacked tensors whole, and starts reading the next MoE layer while this one computes. Whole-layer
buffers live outside the pool's budget and are released after their layer.

Slot banks (`slot_bank.py`) are allocated at the first fetch, one per expert layout (usually one
for the whole model), sized to the expert cache (`capacity`). The pool decides what is evicted
and whether a read ahead is made; a slot is taken before its read is issued, evicting in the
bank's layout when none is free.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx

from ..checkpoint.index import CheckpointIndex
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..trace import NO_TRACE, Tracer
from .page_cache import LIBC
from .page_cache_budget import CAN_EVICT_RANGES, PageCacheBudget
from .pool import ExpertKey, ExpertPool, ResidentExpert
from .read_pacing import ReadPacer
from .reader_core import pin_threads, reader_cores, unpin_all_threads
from .reads import MLX_DTYPES, ExpertReader, ReadResult, to_mlx
from .slot_bank import SlotBank, SlotPart


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
    prefetch_given_up: int = 0  # reads ahead dropped to make room for a layer's misses
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
        self.pool = ExpertPool(config.expert_cache_bytes, config.eviction, on_drop=self._free_slot)
        self.counters = LoadCounters()
        self._moe_layers = sorted(index.layers)
        self._pending_layers: dict[int, Future[ReadResult]] = {}
        # Reads issued ahead for a coming step's predicted experts, with the step they are for and
        # the slot they land in. Each holds a reservation of its expert's bytes in the pool until
        # it is used or dropped.
        self._staged: dict[ExpertKey, tuple[int, Future[ReadResult], int]] = {}
        self._issued_for_next_step = 0
        self._given_up_for_next_step = 0
        self._layouts = {layer: self._layout(layer) for layer in self._moe_layers}
        self._expert_nbytes = {n: sum(p.nbytes for p in lay) for n, lay in self._layouts.items()}
        # Every layout's expert bytes in the checkpoint, and the layers of each.
        self._layout_bytes: dict[tuple[SlotPart, ...], int] = {}
        for layer, layout in self._layouts.items():
            nbytes = self.index.layers[layer].num_experts * self._expert_nbytes[layer]
            self._layout_bytes[layout] = self._layout_bytes.get(layout, 0) + nbytes
        # By layer, the layers whose experts share its bank (keyed by layer, not by layout: hashing
        # a layout's parts on every slot taken cost more than a small expert's pread).
        self._bank_layers = {
            layer: frozenset(n for n, other in self._layouts.items() if other == layout)
            for layer, layout in self._layouts.items()
        }
        # Allocated at the first fetch of each layout (`bank`), once the routing width is known
        # (`check_budget`): a prompt read as whole layers allocates none.
        self._banks: dict[tuple[SlotPart, ...], SlotBank] = {}
        self._bank_of: dict[int, SlotBank] = {}  # by layer
        self._min_slots = 1  # every layout's bank holds at least one layer's routed set
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

    def _layout(self, layer: int) -> tuple[SlotPart, ...]:
        """One expert of `layer` as it is resident: each tensor's shape, floating ones in the
        compute dtype."""
        parts = []
        for tensor in self.index.layers[layer].tensors:
            dtype = MLX_DTYPES[tensor.entry.dtype]
            if self.float_dtype is not None and tensor.entry.dtype in ("BF16", "F16", "F32"):
                dtype = self.float_dtype
            key = f"{tensor.projection}.{tensor.part}"
            parts.append(SlotPart(key, tuple(tensor.expert_shape), dtype, tensor.entry.dtype))
        return tuple(parts)

    def resident_expert_nbytes(self, layer: int) -> int:
        """MLX bytes one expert of `layer` takes once resident (floating parts in compute dtype)."""
        return self._expert_nbytes[layer]

    def check_budget(self, top_k: int) -> None:
        """Refuse a budget that cannot hold one layer's routed set."""
        need = max(self.resident_expert_nbytes(layer) for layer in self._moe_layers) * top_k
        if self.pool.budget_bytes < need:
            raise Edge0Error(
                f"{self.index.model_dir}: an expert cache of {format_bytes(self.pool.budget_bytes)} "
                f"cannot hold the {top_k} experts one layer routes to; the minimum is "
                f"{format_bytes(need)} ({need} bytes)"
            )
        # Recorded only: this may run on any thread (`Engine.request_k`); a bank too small for
        # the new K is made again, larger, at the next step (`begin_step`, the engine's thread).
        self._min_slots = max(self._min_slots, top_k)

    # -- slot banks --------------------------------------------------------------------------------

    def bank(self, layer: int) -> SlotBank:
        """The slot bank `layer`'s experts live in, allocated at the first call for its layout."""
        bank = self._bank_of.get(layer)
        if bank is None:
            layout = self._layouts[layer]
            bank = self._banks.get(layout)
            if bank is None:
                # A prompt read as whole layers left their buffers behind: give them back first,
                # or the process holds both (on the 384 MiB wall: 445 MiB RSS, killed).
                release_freed_memory()
                bank = self._banks[layout] = SlotBank(layout, self.capacity(layer))
            self._bank_of[layer] = bank
        return bank

    def capacity(self, layer: int) -> int:
        """How many experts of `layer`'s layout the expert cache holds: the byte budget's share
        for the layout (its share of the checkpoint's expert bytes), at least one routed set, at
        most every expert of the layout."""
        layout = self._layouts[layer]
        slot_nbytes = self._expert_nbytes[layer]
        total = sum(self._layout_bytes.values())
        share = self.pool.budget_bytes * self._layout_bytes[layout] // total
        experts = self._layout_bytes[layout] // slot_nbytes
        return min(experts, max(share // slot_nbytes, self._min_slots))

    @property
    def bank_bytes(self) -> int:
        """MLX bytes held by the slot banks (the expert cache, allocated)."""
        return sum(bank.nbytes for bank in self._banks.values())

    def _drop_banks(self) -> None:
        """Forget every resident expert and its bank (made again at the next fetch)."""
        self.pool.clear()
        self._banks.clear()
        self._bank_of.clear()

    def _free_slot(self, key: ExpertKey, expert: ResidentExpert) -> None:
        """The pool dropped `key`: its slot is free for another expert."""
        if self._banks:
            self.bank(key[0]).give(expert.slot)

    def _take_slot(self, layer: int, protected, now: bool) -> int | None:
        """A free slot in `layer`'s bank, evicting an expert of the same layout if none is. A read
        ahead (`now` False) gets None when every expert there is pinned or in use, and is not
        made. The forward (`now`) never fails: it waits for the layers before it to compute and
        takes their experts' slots, then drops the predictions' pins, then the reads ahead (their
        experts are read again when used)."""
        bank = self.bank(layer)
        layers = self._bank_layers[layer]
        while True:
            slot = bank.take()
            if slot is not None:
                return slot
            if self.pool.evict_one(layers, protected):
                continue
            if not now:
                return None
            if any(k[0] < layer for k in self.pool.in_use):
                # Slots held by layers of this step that may still be queued. Every earlier layer
                # was submitted (evaluated, or `mx.async_eval`'d at decode: moe_block.py), so
                # once the stream is drained they have computed and their slots are free to take.
                mx.synchronize()
                self.pool.unpin_computed(layer - 1)
                continue
            # Then, one at a time, what is needed latest: a prediction's pin (its expert is read
            # again if used), else a read ahead (given up; its slot comes back once written).
            pins = [
                (step, key)
                for key, step in self.pool.pinned.items()
                if key[0] in layers and key not in protected and key not in self.pool.in_use
            ]
            if pins:
                del self.pool.pinned[max(pins, key=lambda p: (p[0], p[1][0]))[1]]
                continue
            staged = [key for key in self._staged if key[0] in layers]
            if staged:
                key = max(staged, key=lambda k: (self._staged[k][0], k[0]))
                if self._staged[key][0] > self.pool.step:  # counted with the step it was for
                    self._given_up_for_next_step += 1
                else:
                    self.counters.prefetch_given_up += 1
                self._forget_read_ahead(key)
                continue
            raise RuntimeError(
                f"layer {layer}: all {bank.capacity} slots of its bank are in use at once"
            )

    # -- steps -----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        if any(bank.capacity < self._min_slots for bank in self._banks.values()):
            self.reset()  # a wider K than the banks were made for
            self._drop_banks()
        self.counters = LoadCounters(
            prefetch_issued=self._issued_for_next_step,
            prefetch_given_up=self._given_up_for_next_step,
        )
        self._issued_for_next_step = self._given_up_for_next_step = 0
        self.pool.step += 1

    def end_step(self) -> LoadCounters:
        pending, self._pending_layers = self._pending_layers, {}
        for future in pending.values():
            if future.exception() is None:
                self._account(future.result())  # a read already issued still cost its bytes
        self.pool.unpin_through(self.pool.step)
        pending = None  # (its buffers, for the cache clear below)
        if self.counters.whole_layer_reads:
            # A prefill chunk's whole-layer buffers are free now; MLX's cache and the C heap
            # would keep them (a layer or two of expert bytes, outside the expert cache).
            release_freed_memory()
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
        stale = [key for key, (for_step, _, _) in self._staged.items() if for_step <= step]
        for key in stale:
            self._forget_read_ahead(key)

    def _forget_read_ahead(self, key: ExpertKey) -> None:
        """Drop a read ahead: its reservation ends, and its slot is free once it is not written."""
        _, future, slot = self._staged.pop(key)
        future.cancel()  # not started: never runs; in flight: finishes on its own
        self.pool.release(self.resident_expert_nbytes(key[0]))
        self.bank(key[0]).give(slot, writing=future)

    def reset(self) -> None:
        """Forget per-request state; resident experts stay (they are still the checkpoint's)."""
        self.end_step()
        for key in list(self._staged):  # reads in flight finish on their own; their bytes unused
            self._forget_read_ahead(key)
        self._issued_for_next_step = self._given_up_for_next_step = 0

    # -- reads ahead (prerouter) -------------------------------------------------------------------

    def stage(self, layer: int, experts: list[int]) -> None:
        """The next step routes `layer` to `experts`: pin the resident ones, start reading the rest
        (after this step's own reads ahead, if this step is still running)."""
        for expert in experts:
            key = (layer, expert)
            if key in self.pool:
                self.pool.pin(key, self.pool.step + 1)
            elif key not in self._staged:
                # A slot first: a read ahead lands in memory the pool accounts for. Without one
                # (a budget below one step's reads) the layer reads it when it runs.
                nbytes = self.resident_expert_nbytes(layer)
                if not self.pool.reserve(nbytes):
                    continue
                slot = self._take_slot(layer, (), now=False)
                if slot is None:
                    self.pool.release(nbytes)
                    continue
                step = self.pool.step + 1
                into = self.bank(layer).views(slot)
                read = self.reader.submit_expert(layer, expert, ahead=True, step=step, into=into)
                self._staged[key] = (step, read, slot)
                self._issued_for_next_step += 1
                if self.page_cache is not None:  # in the cache once read, used or not
                    self.page_cache.note_read(layer, expert)

    def layer_computed(self, layer: int) -> None:
        """`layer` (and so every layer before it) has computed this step: the experts pinned for
        them may be evicted again, which makes room for the next step's reads ahead while this
        step still runs."""
        self.pool.unpin_computed(layer)

    def load_all(self) -> None:
        """Read every expert into the pool (budget permitting): for the bench's compute-only arm,
        whose steps then read nothing and measure the compute a step cannot go below."""
        for layer in self._moe_layers:
            experts = list(range(self.index.layers[layer].num_experts))
            batch = self.bank(layer).capacity
            for start in range(0, len(experts), batch):
                self.fetch(layer, experts[start : start + batch])
                self.pool.unpin_computed(layer)  # nothing computes with them here
        self.end_step()

    # -- per-expert path ---------------------------------------------------------------------------

    def fetch(self, layer: int, experts: list[int]) -> list[int]:
        """The slots of `experts` of `layer` in its bank, reading those that are missing. They
        stay in use (never evicted) until the layer is known computed (`layer_computed`) or the
        step ends: a layer still queued on the MLX stream reads its slots then."""
        if self.trace is not None:
            self.trace.append((self.pool.step, layer, list(experts)))
        keys = [(layer, e) for e in experts]
        slots: dict[ExpertKey, int] = {}
        missing = []
        for key in keys:
            resident = self.pool.get(key)
            if resident is None:
                missing.append(key)
            else:
                slots[key] = resident.slot
            self.pool.use(key)
        self.counters.hits += len(slots)
        if missing:
            start = time.perf_counter()
            nbytes = self.resident_expert_nbytes(layer)
            reads: list[tuple[ExpertKey, Future[ReadResult], str, int]] = []
            try:
                for key in missing:
                    reads.append((key, *self._staged_or_submit(key, keys)))
                while reads:
                    key, future, how, slot = reads[0]
                    waited = self.tracer.now()
                    self.reader.wait(future)
                    result = _result_or_error(future, f"layer {layer} expert {key[1]}")
                    self.tracer.complete(
                        f"blocked {layer}.{key[1]}", "blocked", waited, self.tracer.now(), read=how
                    )
                    self.pool.put(key, ResidentExpert(slot, nbytes), protected=keys)
                    reads.pop(0)
                    slots[key] = slot
                    self._account(result)
                    self.counters.loads += 1
            finally:
                # A failed read (the error goes up): the reads not admitted are cancelled, and
                # their slots come back once nothing writes into them.
                for _, future, _, slot in reads:
                    future.cancel()  # not started: never runs; running: finishes on its own
                    self.bank(layer).give(slot, writing=future)
            self.counters.blocked_ms += (time.perf_counter() - start) * 1e3
        return [slots[key] for key in keys]

    def _staged_or_submit(self, key: ExpertKey, protected) -> tuple[Future[ReadResult], str, int]:
        """The read of a missing expert, how it was issued ("ahead, in time" / "ahead, late":
        staged by the prerouter; "on demand": submitted now) and the slot it lands in."""
        staged = self._staged.pop(key, None)
        if staged is None:
            slot = self._take_slot(key[0], protected, now=True)
            into = self.bank(key[0]).views(slot)
            return self.reader.submit_expert(*key, into=into), "on demand", slot
        _, future, slot = staged
        self.pool.release(self.resident_expert_nbytes(key[0]))  # `fetch` puts it in the pool
        if future.done():
            self.counters.prefetch_in_time += 1
            return future, "ahead, in time", slot
        self.counters.prefetch_late += 1
        return future, "ahead, late", slot

    # -- whole-layer path (prefill) ----------------------------------------------------------------

    def wants_whole_layer(self, layer: int, distinct_experts: int) -> bool:
        """Read the layer whole if its read is already under way or the chunk touches enough of it."""
        if layer in self._pending_layers:
            return True
        # More experts than the bank holds at once: only the whole layer can serve the chunk.
        if distinct_experts > self.capacity(layer):
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
        self._drop_banks()


def release_freed_memory() -> None:
    """Hand freed buffers back to the OS: MLX's buffer cache, then glibc's heap, which keeps what
    reader threads freed in their arenas (on the 384 MiB wall, after a prompt read as whole
    layers: 445 MiB RSS for 100 MiB of live MLX arrays, 232 MiB once trimmed). Other C libraries
    (macOS, musl) have no `malloc_trim`."""
    mx.clear_cache()
    if hasattr(LIBC, "malloc_trim"):
        LIBC.malloc_trim(0)


def _result_or_error(future: Future[ReadResult], what: str) -> ReadResult:
    """The read's result; a failed read becomes an Edge0Error naming the file and the expert."""
    try:
        return future.result()
    except OSError as e:
        where = e.filename or "checkpoint"
        raise Edge0Error(f"{where}: read error while loading {what} ({e.strerror or e})") from None

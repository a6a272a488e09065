"""The expert store: routed experts on demand from the checkpoint, into the expert pool.

`fetch` returns the slots of the experts a layer routes to, reading the missing ones in parallel
(the forward waits, and that wait is blocked-on-load time); the layer computes them over its slot
bank (`bank`). `stage` reads a coming step's predicted experts ahead. `whole_layer` serves prefill
chunks that touch most of a layer: it reads the layer's stacked tensors whole, and starts reading
the next MoE layer while this one computes. Whole-layer buffers live outside the pool's budget and
are released after their layer. `hold_layers` keeps whole layers in the pool, their routing
mapped to slots on the device (`slot_table`): such a layer never waits for the host.

The store does the reading and counts it; which expert sits in which slot, and what may be
evicted, belongs to the pool (`pool.py`): the store asks it for a slot before a read is issued
and hands it the expert once read.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..checkpoint.index import CheckpointIndex
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..host_reads import HostReads
from ..trace import NO_TRACE, Tracer
from .counters import LayerRouted, LoadCounters
from .eviction import ExpertKey
from .freed_memory import release_freed_memory
from .heat import ExpertEvent, ExpertHeat, HeatPicture
from .ledger import ReadsAheadLedger
from .page_cache_budget import CAN_EVICT_RANGES, PageCacheBudget
from .pool import ExpertPool, expert_layout
from .prefill_seed import by_recent_use, seed_from_whole_layer
from .read_pacing import ReadPacer
from .reader_core import pin_threads, reader_cores, unpin_all_threads
from .reads import ExpertReader, ReadResult, to_mlx
from .share import ExpertShare
from .slot_bank import SlotBank


class NextLayerGuesses(Protocol):
    """What the store asks of the exact lookahead (`routing/lookahead.py`): the next MoE layer's
    guess (`.layer`, `.indices` on the device, `.host`, `.likely`) from a layer's input."""

    def guess_after(self, layer: int): ...


@dataclass
class LayerSlots:
    """Where a layer's routed experts are for one forward, as `StreamingSwitchGLU.compute` takes
    them: the bank holding them and the routing as rows of it, on the device (`device`) and, where
    the host knows it, on the host (`host`); or, for a prefill chunk routed to more experts than
    the bank holds, `groups`: bankfuls (experts, their slots, the bank), each read as the caller
    asks for it, once the group before has computed."""

    bank: dict[str, mx.array] | None = None
    device: mx.array | None = None
    host: np.ndarray | None = None
    groups: Iterator[tuple[list[int], list[int], dict[str, mx.array]]] | None = None


class ExpertStore:
    def __init__(
        self,
        index: CheckpointIndex,
        config: EngineConfig,
        float_dtype: mx.Dtype | None,
        tracer: Tracer = NO_TRACE,
        host_reads: HostReads | None = None,
    ):
        self.index = index
        self.tracer = tracer
        self.host_reads = host_reads or HostReads()
        self.float_dtype = float_dtype
        self.whole_layer_fraction = config.whole_layer_fraction
        # Prefill may hold a layer's experts and read the next one's (outside the expert cache);
        # else a chunk's experts go through the bank, a bankful at a time.
        self.whole_layer_prefill = config.whole_layer_prefill is not False
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        # (compute cores, reader cores), or None: nothing pinned (see reader_core.py). Not for
        # ranks: each would take the same cores of a machine they share.
        pin = config.reader_core and not config.expert_parallel
        self._cores = reader_cores() if pin else None
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
        self._moe_layers = sorted(index.layers)
        self.pool = ExpertPool(
            {layer: expert_layout(index, layer, float_dtype) for layer in self._moe_layers},
            {layer: index.layers[layer].num_experts for layer in self._moe_layers},
            config.expert_cache_bytes,
            config.eviction,
            self.host_reads,
        )
        self.counters = LoadCounters()
        # What each expert did in the latest step, for the app's heat view (`heat_picture`).
        self.heat = ExpertHeat(
            {layer: index.layers[layer].num_experts for layer in self._moe_layers}
        )
        self._pending_layers: dict[int, Future[ReadResult]] = {}
        # In a layer-major pass (`layer_pass`): the layer read whole that the pass is on, kept
        # for the pass's next batches, and whether a pass runs.
        self._in_pass = False
        self._pass_layer: tuple[int, dict[str, mx.array]] | None = None
        # What the heads and the lookahead expected of each (step, layer), their reads ahead and
        # their scores, with the gate on the heads' reads in prefetch mode (`ledger.py`).
        self.ledger = ReadsAheadLedger()
        # False: the lookahead's guesses are only scored, not read ahead (the engine decides:
        # EngineConfig.prefetch_min_expert_bytes).
        self.lookahead_reads = True
        # The exact lookahead (`routing/lookahead.py`), set by the engine where it guesses: a
        # layer whose routing is read back brings the next layer's guess in the same wait.
        self.lookahead: NextLayerGuesses | None = None
        # Layers to hold (`hold_layers`), and the routing of held layers this step, still on the
        # device: read with the step's token (`routed_on_device`, `settle`).
        self._hold_wanted: frozenset[int] = frozenset()
        self._routed_on_device: list[tuple[int, mx.array]] = []
        # When a list, every fetch appends (step, layer, experts): the routing trace that the eviction
        # benchmark replays.
        self.trace: list[tuple[int, int, list[int]]] | None = None
        # With several ranks (`share.py`): the experts this rank reads, caches and computes. The
        # routing the layers hand the store names only those (`ExpertShare.own_routing`); the
        # predictions and guesses read ahead are cut to them here.
        self.share: ExpertShare | None = None

    def _own(self, experts: list[int]) -> list[int]:
        return experts if self.share is None else self.share.own(experts)

    def _experts_of(self, layer: int) -> list[int]:
        """Every expert of `layer` this rank holds (all of them in one process)."""
        return self._own(list(range(self.index.layers[layer].num_experts)))

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

    def resident_expert_nbytes(self, layer: int) -> int:
        """MLX bytes one expert of `layer` takes once resident (floating parts in compute dtype)."""
        return self.pool.expert_nbytes[layer]

    def set_top_k(self, top_k: int) -> None:
        """Route `top_k` experts a layer from the next step. Refuses an expert cache that cannot
        hold one layer's routed set; else the pool makes its banks hold one. Safe from any thread
        (`Engine.request_k`)."""
        need = max(self.resident_expert_nbytes(layer) for layer in self._moe_layers) * top_k
        if self.pool.budget_bytes < need:
            raise Edge0Error(
                f"{self.index.model_dir}: an expert cache of {format_bytes(self.pool.budget_bytes)} "
                f"cannot hold the {top_k} experts one layer routes to; the minimum is "
                f"{format_bytes(need)} ({need} bytes)"
            )
        self.pool.require_slots(top_k)

    # -- slot banks (the pool's) -----------------------------------------------------------------

    def bank(self, layer: int) -> SlotBank:
        """The slot bank `layer`'s experts live in."""
        return self.pool.bank(layer)

    @property
    def bank_bytes(self) -> int:
        """MLX bytes held by the slot banks (the expert cache, allocated)."""
        return self.pool.bank_bytes

    # -- steps -----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        started_again = self.pool.begin_step()  # (a wider K: every read ahead was dropped)
        if started_again:
            self.heat.forget_reads_ahead()
        self.heat.begin_step(self.pool.step)
        step, ledger = self.pool.step, self.ledger
        issued = 0 if started_again else ledger.issued(step, "heads")
        guesses = 0 if started_again else ledger.issued(step, "lookahead")
        self.counters = LoadCounters(prefetch_issued=issued, lookahead_issued=guesses)
        ledger.begin(step)
        self._routed_on_device = []
        missing = self._hold_wanted - self.pool.held_layers  # (a wider K dropped them)
        if missing:
            self._hold(sorted(missing))

    def end_step(self) -> LoadCounters:
        pending, self._pending_layers = self._pending_layers, {}
        for future in pending.values():
            if future.exception() is None:
                self._account(future.result())  # a read already issued still cost its bytes
        self.pool.end_step()
        self.heat.end_step()
        self.counters.prefetch_given_up += self.pool.pop_given_up(self.pool.step)
        pending = None  # (its buffers, for the cache clear below)
        if self.counters.whole_layer_reads:
            # A prefill chunk's whole-layer buffers are free now; MLX's cache and the C heap
            # would keep them (a layer or two of expert bytes, outside the expert cache).
            release_freed_memory()
        self._enforce_page_cache()
        return self.counters

    def reset(self) -> None:
        """Forget per-request state; resident experts stay (they are still the checkpoint's)."""
        self.end_step()
        self.pool.forget_reads_ahead()  # reads in flight finish on their own; their bytes unused
        self.heat.forget_reads_ahead()
        self.ledger.forget_after(self.pool.step)

    # -- held layers: routing that stays on the device ---------------------------------------------

    def can_hold(self, layers: set[int], top_k: int) -> bool:
        """Whether the expert cache holds every expert of `layers` and still has room for a routed
        set of `top_k` for each other layer sharing their banks: the least the memory plan
        gives any layer (a step's uses end before the next step's reads ahead start)."""
        banks = {self.pool.bank_layers(layer) for layer in self._moe_layers}
        for members in banks:
            members = sorted(members)
            need = sum(len(self._experts_of(n)) if n in layers else top_k for n in members)
            if need > self.pool.capacity(members[0], top_k):
                return False
        return True

    def hold_layers(self, layers: set[int]) -> None:
        """From the next step, keep every expert of `layers` resident (read at that step's start)
        and route them on the device; the layers held before and not in `layers` are released."""
        self._hold_wanted = frozenset(layers)
        self.pool.release(self.pool.held_layers - self._hold_wanted)

    def slot_table(self, layer: int) -> mx.array | None:
        """A held layer's slot by expert id, on the device; None when the layer is not held."""
        return self.pool.slot_table(layer)

    @property
    def every_layer_held(self) -> bool:
        """Every MoE layer is held: a step reads nothing, and never waits for its routing."""
        return self.pool.held_layers == frozenset(self._moe_layers)

    def _hold(self, layers: list[int]) -> None:
        for layer in layers:
            self._read_every_expert(layer)
            self.pool.hold(layer, self.index.layers[layer].num_experts, self._experts_of(layer))

    def _read_every_expert(self, layer: int) -> None:
        """Every expert of `layer` into the pool (as far as its budget keeps them), a bankful of
        reads at a time."""
        experts = self._experts_of(layer)
        batch = self.bank(layer).capacity
        for start in range(0, len(experts), batch):
            self.fetch(layer, experts[start : start + batch])
            self.pool.layer_computed(layer)  # nothing computes with them here

    def routed_on_device(self, layer: int, indices: mx.array) -> None:
        """A held `layer` routed to `indices` (lazy): counted once the step's values are read."""
        self._routed_on_device.append((layer, indices))

    def device_routing(self) -> list[tuple[int, mx.array]]:
        """This step's routing of held layers, to read with the step's token, then `settle`."""
        routed, self._routed_on_device = self._routed_on_device, []
        return routed

    def settle(
        self, counters: LoadCounters, routed: list[tuple[int, np.ndarray]], step: int
    ) -> None:
        """Count held layers' routing of step `step` once it is on the host: hits into
        `counters`, uses into the heat picture of the step now under way."""
        for layer, experts in routed:
            distinct = self._own(sorted(set(experts.reshape(-1).tolist())))
            counters.hits += len(distinct)
            self._layer_counts_in(counters, layer).resident += len(distinct)
            if self.trace is not None:
                self.trace.append((step, layer, distinct))
            for expert in distinct:
                self.heat.used((layer, expert), ExpertEvent.HIT)
            self.heat.routed(layer, distinct)

    def heat_picture(self) -> HeatPicture:
        """The latest step's expert heat picture (`heat.py`), with the experts in the cache now.
        Engine thread only; a few arrays of layers x experts, so callers take one a few times a
        second at most, never per step."""
        return self.heat.picture(self.pool.resident_mask(), self.counters.blocked_ms)

    # -- reads ahead (prerouter) -------------------------------------------------------------------

    def stage(self, layer: int, experts: list[int]) -> None:
        """The next step routes `layer` to `experts` (a prediction): pin the resident ones and
        start reading the rest, unless the ledger's gate keeps the heads off for `layer`.
        A held layer needs neither: its every expert stays resident."""
        if self.pool.slot_table(layer) is not None:  # held: every expert is resident
            return
        experts = self._own(experts)
        step = self.pool.step + 1
        self.ledger.expect(step, layer, "heads", experts)
        read = self.ledger.heads_read(layer)
        self.ledger.count_issued(
            step, "heads", self._read_ahead(layer, experts, step, "heads", read)
        )
        if not read:
            self.counters.heads_not_read += len(experts)

    def look_ahead(self, layer: int, experts: list[int], next_step: bool = False) -> None:
        """This step's (or with `next_step`, the next step's) `layer` is guessed to route to
        `experts` (the lookahead): pin the resident ones for that step and start reading the
        rest below every read the forward waits for. The layer still routes by its own router;
        `routing_known` then drops the wrong reads."""
        step = self.pool.step + next_step
        experts = self._own(experts)
        self.ledger.expect(step, layer, "lookahead", experts)
        if self.lookahead_reads:
            issued = self._read_ahead(layer, experts, step, "lookahead")
            if next_step:
                self.ledger.count_issued(step, "lookahead", issued)
            else:
                self.counters.lookahead_issued += issued

    def _read_ahead(
        self, layer: int, experts: list[int], step: int, source: str, read: bool = True
    ) -> int:
        """Pin the resident `experts` of `layer` for `step` and (`read`) read the others ahead
        for it, as far as the expert cache has room that nothing in use or pinned holds. Returns
        how many reads were issued."""
        issued = 0
        for expert in experts:
            key = (layer, expert)
            if key in self.pool:
                self.pool.pin(key, step)
                continue
            if not read or self.pool.is_read_ahead(key):
                continue
            submit = partial(self.reader.submit_expert, layer, expert, ahead=True, step=step)
            if self.pool.read_ahead(key, step, submit, source):
                issued += 1
                self.heat.read_ahead(key, step)
                if self.page_cache is not None:  # in the cache once read, used or not
                    self.page_cache.note_read(layer, expert)
        return issued

    def routing_known(self, layer: int, experts: list[int]) -> None:
        """This step's `layer` routes to `experts` (one-token forwards): its reads ahead for other
        experts are dropped now (a queued one is never read: the disk is the misses'), and the
        lookahead's guess of it is scored."""
        keys = {(layer, e) for e in experts}
        self.heat.routed(layer, experts)
        self.counters.lookahead_dropped += self.pool.drop_unused_reads_ahead(layer, keys)
        guessed = self.ledger.routed(self.pool.step, layer, experts)
        if guessed is not None:
            routed = self._layer_counts(layer)
            routed.guessed_of += len(experts)
            routed.guessed_right += len(guessed.intersection(experts))

    def _layer_counts(self, layer: int) -> LayerRouted:
        return self._layer_counts_in(self.counters, layer)

    @staticmethod
    def _layer_counts_in(counters: LoadCounters, layer: int) -> LayerRouted:
        return counters.layers.setdefault(layer, LayerRouted())

    def layer_computed(self, layer: int) -> None:
        """`layer` (and so every layer before it) has computed this step: the experts it used or
        that were pinned for it may be evicted again, which makes room for the next step's reads
        ahead while this step still runs."""
        self.pool.layer_computed(layer)

    def load_all(self) -> None:
        """Read every expert into the pool (budget permitting): for the bench's compute-only arm,
        whose steps then read nothing and measure the compute a step cannot go below."""
        for layer in self._moe_layers:
            self._read_every_expert(layer)
        self.end_step()

    # -- one layer's experts for one forward -------------------------------------------------------

    def layer_slots(
        self, layer: int, indices: mx.array, routed: np.ndarray | None = None
    ) -> tuple[LayerSlots, np.ndarray | mx.array]:
        """Where `layer`'s experts routed to `indices` are for this forward, reading what is
        missing; and the routing as now known: on the host where it is known there, else the
        device array (a held layer at decode).

        `routed` is the routing already on the host (a prediction): no wait on the device. A held
        layer at decode maps the routing to slots on the device: no wait either. Otherwise the
        reads need the routing on the host, and reading it back waits for the device: the one
        host read a layer may cost."""
        tokens = indices.size // indices.shape[-1]
        table = self.slot_table(layer) if tokens == 1 else None
        if table is not None:
            if routed is None:
                self.routed_on_device(layer, indices)
            else:
                self.routing_known(layer, self._own(_distinct(routed)))
            known = indices if routed is None else routed
            return LayerSlots(self.bank(layer).arrays, device=table[indices]), known
        guess = None
        if routed is None:
            routed, guess = self._read_routing(layer, indices, tokens)
        # Another rank's experts are neither read nor computed here: their rows of the routing
        # point at slot 0, and their outputs are zeroed before the ranks' sum (`share.py`).
        distinct = self._own(_distinct(routed))
        if tokens == 1:
            self.routing_known(layer, distinct)
        if tokens > 1 and self.wants_whole_layer(layer, distinct):
            # The layer's stacked tensors are indexed by expert id: the routing is its own slots.
            whole = self.whole_layer(layer)
            if not self._in_pass:  # a prompt, whose last token comes next through the pool
                seed_from_whole_layer(self.pool, layer, self._own(by_recent_use(routed)), whole)
            return LayerSlots(whole, device=indices, host=routed), routed
        if len(distinct) > self.pool.room(layer):
            return LayerSlots(groups=self.bankfuls(layer, distinct)), routed
        slot_of = np.zeros(self.index.layers[layer].num_experts, dtype=np.uint32)
        slot_of[distinct] = self.fetch(layer, distinct)
        if guess is not None:
            # Issued once this layer's own misses are in: the guess's reads never delay them,
            # and land while this layer computes and the next one runs its attention.
            self.look_ahead(guess.layer, guess.likely)
        return LayerSlots(self.bank(layer).arrays, host=slot_of[routed]), routed

    def _read_routing(
        self, layer: int, indices: mx.array, tokens: int
    ) -> tuple[np.ndarray, object]:
        """The layer's routing read back to the host, with the next layer's guess (decode, in the
        modes that read ahead) in the same wait. The wait computes every layer before, so their
        experts' slots may be reused."""
        lookahead = self.lookahead
        guess = lookahead.guess_after(layer) if lookahead is not None and tokens == 1 else None
        with self.tracer.span(f"router sync {layer}", "compute"):
            wanted = [indices] if guess is None else [indices, guess.indices]
            host = self.host_reads.read(wanted, "the routing a layer's reads need")
        if guess is not None:
            guess.host = host[1]
        self.layer_computed(layer - 1)
        return host[0], guess

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
            slot = self.pool.use(key)
            if slot is None:
                missing.append(key)
            else:
                slots[key] = slot
        self.counters.hits += len(slots)
        for key in slots:
            self.heat.used(key, ExpertEvent.HIT)
        routed = self._layer_counts(layer)
        routed.resident += len(slots)
        if missing:
            start = time.perf_counter()
            reads: list[tuple[ExpertKey, Future[ReadResult], str, int]] = []
            try:
                for key in missing:
                    reads.append((key, *self._staged_or_submit(key, keys, routed)))
                while reads:
                    key, future, how, slot = reads[0]
                    waited = self.tracer.now()
                    self.reader.wait(future)
                    result = _result_or_error(future, f"layer {layer} expert {key[1]}")
                    self.tracer.complete(
                        f"blocked {layer}.{key[1]}", "blocked", waited, self.tracer.now(), read=how
                    )
                    self.pool.admit(key, slot, protected=keys)
                    reads.pop(0)
                    slots[key] = slot
                    self._account(result)
                    self.counters.loads += 1
                    self.heat.used(key, _read_event(how, result))
            finally:
                # A failed read (the error goes up): the reads not admitted are cancelled, and
                # their slots come back once nothing writes into them.
                for _, future, _, slot in reads:
                    future.cancel()  # not started: never runs; running: finishes on its own
                    self.pool.give_back(layer, slot, writing=future)
            self.counters.blocked_ms += (time.perf_counter() - start) * 1e3
        return [slots[key] for key in keys]

    def bankfuls(
        self, layer: int, experts: list[int]
    ) -> Iterator[tuple[list[int], list[int], dict[str, mx.array]]]:
        """`experts` of `layer` (more than its bank holds at once) a bankful at a time: yields
        each group, its slots and the bank's arrays. The caller computes with a group,
        evaluated, before it asks for the next: the group's slots then take the next group."""
        size = self.pool.room(layer)
        for start in range(0, len(experts), size):
            group = experts[start : start + size]
            slots = self.fetch(layer, group)
            yield group, slots, self.bank(layer).arrays
            self.pool.layer_computed(layer)

    def _staged_or_submit(
        self, key: ExpertKey, protected, routed: LayerRouted
    ) -> tuple[Future[ReadResult], str, int]:
        """The read of a missing expert, how it was issued ("heads, in time" / "lookahead, late"
        ...: read ahead; "on demand": submitted now) and the slot it lands in."""
        ahead = self.pool.claim_read_ahead(key)
        if ahead is None:
            routed.missed += 1
            slot = self.pool.slot_for_miss(key[0], protected)
            into = self.pool.views(key[0], slot)
            return self.reader.submit_expert(*key, into=into), "on demand", slot
        future, slot, source = ahead.read, ahead.slot, ahead.source
        in_time = future.done()
        counters = self.counters
        if source == "lookahead":
            routed.lookahead += 1
            counters.lookahead_in_time += in_time
            counters.lookahead_late += not in_time
        else:
            routed.heads += 1
            counters.prefetch_in_time += in_time
            counters.prefetch_late += not in_time
        return future, f"{source}, {'in time' if in_time else 'late'}", slot

    # -- whole-layer path (prefill) ----------------------------------------------------------------

    @contextlib.contextmanager
    def layer_pass(self):
        """A layer-major pass (`runtime/layer_major.py`): every batch of the pass runs a layer
        before any runs the next, so a layer read whole is kept until the pass moves on to the
        next layer (whose read it started): each layer read once a pass. The memory is the
        whole-layer prefill's: this layer's tensors and the next one's read."""
        self._in_pass = True
        try:
            yield
        finally:
            self._in_pass = False
            self._pass_layer = None

    def wants_whole_layer(self, layer: int, distinct: list[int]) -> bool:
        """Read the layer whole if its read is under way (or a layer-major pass runs), or more
        of it is missing than the fraction: a few positions (verify) read only their misses."""
        if not self.whole_layer_prefill:  # it does not fit the memory plan: through the bank
            return False
        if self.pool.slot_table(layer) is not None:  # held: every expert is in the bank already
            return False
        if layer in self._pending_layers or self._in_pass:
            return True
        if len(distinct) > self.pool.room(layer):  # the bank cannot hold them at once: one read
            return True
        missing = sum((layer, expert) not in self.pool for expert in distinct)
        return missing > self.whole_layer_fraction * self.index.layers[layer].num_experts

    def whole_layer(self, layer: int) -> dict[str, mx.array]:
        """The layer's stacked expert tensors; starts reading the next MoE layer before returning."""
        if self._pass_layer is not None and self._pass_layer[0] == layer:
            return self._pass_layer[1]
        self._pass_layer = None  # (its buffers go once the layer's last batch is computed)
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
        if self._in_pass:
            self._pass_layer = (layer, arrays)
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
        self.pool.close()


def _distinct(routed: np.ndarray) -> list[int]:
    """The experts a routing names, each once, in order (cheaper than np.unique for a decode
    step's few)."""
    return sorted(set(routed.ravel().tolist()))


def _read_event(how: str, result: ReadResult) -> ExpertEvent:
    """A routed expert's read as the heat picture shows it: read ahead, or read when needed
    from the page cache or (any cold bytes) from disk."""
    if how != "on demand":
        return ExpertEvent.AHEAD_USED
    return ExpertEvent.READ_COLD if result.cold_bytes else ExpertEvent.READ_WARM


def _result_or_error(future: Future[ReadResult], what: str) -> ReadResult:
    """The read's result; a failed read becomes an Edge0Error naming the file and the expert."""
    try:
        return future.result()
    except OSError as e:
        where = e.filename or "checkpoint"
        raise Edge0Error(f"{where}: read error while loading {what} ({e.strerror or e})") from None

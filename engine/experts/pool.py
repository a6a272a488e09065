"""The expert pool: the one owner of the expert cache.

The pool knows, for every routed expert in memory, which slot of which slot bank it sits in; and
for every slot, why it may or may not be given to another expert:
- **in use**: a layer of this step computes with it and may still be queued on the MLX stream;
- **pinned**: a coming step is known to route to it (a prediction);
- **read ahead**: a read for a coming step is writing into it (with its bytes reserved);
- **kept**: its layer's misses block the forward, so it is evicted after the others;
- **held**: every expert of its layer is resident and stays (`hold`): the layer's routing maps to
  slots on the device (`slot_table`), so it never makes the host wait on the device.
One byte budget covers every layer. Which expert to evict among those that may go is the eviction
policy's answer (`eviction.py`); everything else about residency is decided here, and the store
(`store.py`), the engine and the routing state change it only through these methods.

Slot banks (`slot_bank.py`) are allocated at the first slot taken for each expert layout (usually
one for the whole model), sized to the budget's share for the layout and to at least one routed
set (`require_slots`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..checkpoint.index import CheckpointIndex
from ..host_reads import HostReads
from .eviction import ExpertKey, make_policy
from .freed_memory import release_freed_memory
from .reads import MLX_DTYPES
from .slot_bank import SlotBank, SlotPart

Layout = tuple[SlotPart, ...]


@dataclass
class ReadAhead:
    """A read issued ahead of an expert's use: the step it is for, the read, its slot, and who
    guessed it ("heads": a prerouter prediction for the next step; "lookahead": the next layer's
    router on this layer's input, for this step)."""

    step: int
    read: Future
    slot: int
    source: str = "heads"


class ExpertPool:
    def __init__(
        self,
        layouts: dict[int, Layout],
        experts_per_layer: dict[int, int],
        budget_bytes: int,
        policy: str = "lfu-aging",
        host_reads: HostReads | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.host_reads = host_reads or HostReads()
        self.policy = make_policy(policy)
        self.step = 0
        self.evictions = 0
        self.resident_bytes = 0
        # Bytes promised to reads ahead in flight or waiting for their step: they count against
        # the budget from the moment they are issued, so experts read ahead never take memory
        # beyond it.
        self.reserved_bytes = 0
        self._slots: dict[ExpertKey, int] = {}  # resident expert -> its slot in its layer's bank
        # The same, as a [layers (in order), experts] mask: read whole a few times a second (the
        # app's heat view) where walking the keys of a large pool would cost milliseconds.
        self._row = {layer: row for row, layer in enumerate(sorted(layouts))}
        self._resident_mask = np.zeros(
            (len(self._row), max(experts_per_layer.values(), default=0)), bool
        )
        self._pinned: dict[ExpertKey, int] = {}  # -> the step that routes to it
        self._in_use: dict[ExpertKey, int] = {}  # -> the step whose layer computes with it
        self._reads_ahead: dict[ExpertKey, ReadAhead] = {}
        self._given_up: Counter[int] = Counter()  # reads ahead given up, by the step they were for
        self._kept_layers: frozenset[int] = frozenset()
        # Held layers: expert id -> slot as a device array, for routing that stays on the device.
        self._held: dict[int, mx.array] = {}

        self._layouts = layouts
        self.expert_nbytes = {layer: sum(p.nbytes for p in lay) for layer, lay in layouts.items()}
        # Every layout's expert bytes in the checkpoint, and by layer the layers sharing its bank
        # (keyed by layer, not by layout: hashing a layout's parts on every slot taken is slow).
        self._layout_bytes: Counter[Layout] = Counter()
        for layer, layout in layouts.items():
            self._layout_bytes[layout] += experts_per_layer[layer] * self.expert_nbytes[layer]
        self._bank_layers = {
            layer: frozenset(n for n, other in layouts.items() if other == layout)
            for layer, layout in layouts.items()
        }
        self._banks: dict[Layout, SlotBank] = {}
        self._bank_of: dict[int, SlotBank] = {}  # by layer
        self._min_slots = 1  # every bank holds at least one layer's routed set

    # -- what is resident ---------------------------------------------------------------------------

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[ExpertKey]:
        return list(self._slots)

    def resident_mask(self) -> np.ndarray:
        """A copy of the residency mask: `[MoE layers in order, experts]`, True where resident."""
        return self._resident_mask.copy()

    def slot_of(self, key: ExpertKey) -> int | None:
        """The slot `key` sits in (None: not resident), without counting a use."""
        return self._slots.get(key)

    @property
    def in_use(self) -> bool:
        """Whether any layer of this step still computes with a slot."""
        return bool(self._in_use)

    def is_read_ahead(self, key: ExpertKey) -> bool:
        return key in self._reads_ahead

    # -- slot banks ---------------------------------------------------------------------------------

    def bank(self, layer: int) -> SlotBank:
        """The slot bank `layer`'s experts live in, allocated at the first call for its layout."""
        bank = self._bank_of.get(layer)
        if bank is None:
            layout = self._layouts[layer]
            bank = self._banks.get(layout)
            if bank is None:
                # A prompt read as whole layers left their buffers behind: give them back first,
                # or the process holds both.
                release_freed_memory()
                bank = self._banks[layout] = SlotBank(layout, self.capacity(layer))
            self._bank_of[layer] = bank
        return bank

    def bank_layers(self, layer: int) -> frozenset[int]:
        """The layers whose experts share `layer`'s slot bank (`layer` among them)."""
        return self._bank_layers[layer]

    def views(self, layer: int, slot: int) -> dict[str, np.ndarray]:
        """Writable host views of `slot` in `layer`'s bank: where a read lands."""
        return self.bank(layer).views(slot)

    def capacity(self, layer: int, routed: int | None = None) -> int:
        """How many experts of `layer`'s layout the cache holds: the budget's share for the
        layout (its share of the checkpoint's expert bytes), at least one routed set (of
        `routed` experts; default: what `require_slots` asked), at most every expert of the
        layout."""
        layout = self._layouts[layer]
        slot_nbytes = self.expert_nbytes[layer]
        share = self.budget_bytes * self._layout_bytes[layout] // sum(self._layout_bytes.values())
        experts = self._layout_bytes[layout] // slot_nbytes
        floor = max(self._min_slots, routed or 0)
        return min(experts, max(share // slot_nbytes, floor))

    def room(self, layer: int) -> int:
        """How many experts of `layer` its bank can hold at once: its capacity less the slots
        other layers' held experts keep for good (a prefill chunk goes through the bank in
        groups of this many)."""
        held = sum(
            self._held[other].size
            for other in self._bank_layers[layer]
            if other != layer and other in self._held
        )
        return self.capacity(layer) - held

    def planned_bytes(self, routed: int) -> int:
        """The banks' bytes once allocated with one routed set of `routed` experts a layer."""
        first_of_layout = {layout: layer for layer, layout in self._layouts.items()}
        return sum(
            self.capacity(layer, routed) * self.expert_nbytes[layer]
            for layer in first_of_layout.values()
        )

    @property
    def bank_bytes(self) -> int:
        """MLX bytes held by the slot banks (the expert cache, allocated)."""
        return sum(bank.nbytes for bank in self._banks.values())

    def require_slots(self, routed: int) -> None:
        """Every bank must hold `routed` experts (one layer's routed set at a new K). May be called
        from any thread: a bank too small is made again at the next `begin_step`, on the engine's."""
        self._min_slots = max(self._min_slots, routed)

    # -- steps --------------------------------------------------------------------------------------

    def begin_step(self) -> bool:
        """A step starts. True when the pool started again, empty: its banks were made for a
        narrower K than `require_slots` now asks (every resident expert and read ahead dropped)."""
        self.step += 1
        if all(bank.capacity >= self._min_slots for bank in self._banks.values()):
            return False
        self.close()
        return True

    def layer_computed(self, layer: int) -> None:
        """`layer`, and so every layer before it (MLX's stream runs in order), has computed this
        step: its experts are no longer in use, and this step's pins of them end (pins for
        later steps stay)."""
        for held in (self._pinned, self._in_use):
            done = [k for k, step in held.items() if k[0] <= layer and step <= self.step]
            for key in done:
                del held[key]

    def end_step(self) -> None:
        """The step is over: every use and pin for it ends, and the reads ahead made for it that
        it did not use are dropped. In prefetch mode the true router routes, so a mispredicted
        expert's read is never consumed; kept, its slot and bytes would stay taken until the
        request ended. One not started is cancelled (its disk time is not wasted); one in
        flight finishes on its own and is dropped."""
        self._pinned = {k: s for k, s in self._pinned.items() if s > self.step}
        self._in_use = {k: s for k, s in self._in_use.items() if s > self.step}
        for key in [k for k, ahead in self._reads_ahead.items() if ahead.step <= self.step]:
            self._forget_read_ahead(key)

    def keep_layers(self, layers: Collection[int]) -> None:
        """Evict experts of `layers` last: layers whose misses block the forward while others' are
        read a step ahead (prerouter mode: the layers that route by their own router)."""
        self._kept_layers = frozenset(layers)

    def hold(self, layer: int, experts: int, held: list[int]) -> mx.array:
        """Keep `held`, of `layer`'s `experts` (all resident: the caller read them), in the pool
        for good, and return their slots as a device array indexed by expert id. An expert not
        held (another rank's) maps to slot 0: that rank's routing never names it."""
        mine = set(held)
        slots = [self._slots[(layer, e)] if e in mine else 0 for e in range(experts)]
        self._held[layer] = mx.array(np.array(slots, dtype=np.uint32))
        return self._held[layer]

    def slot_table(self, layer: int) -> mx.array | None:
        """A held layer's slots by expert id, on the device (None: the layer is not held)."""
        return self._held.get(layer)

    @property
    def held_layers(self) -> frozenset[int]:
        return frozenset(self._held)

    def release(self, layers: Collection[int]) -> None:
        """`layers` are held no more: their experts may be evicted again."""
        for layer in layers:
            self._held.pop(layer, None)

    def pop_given_up(self, through_step: int) -> int:
        """How many reads ahead for steps up to `through_step` were given up for a miss's slot."""
        done = [step for step in self._given_up if step <= through_step]
        return sum(self._given_up.pop(step) for step in done)

    # -- the forward --------------------------------------------------------------------------------

    def use(self, key: ExpertKey) -> int | None:
        """A layer of this step computes with `key`: its slot, or None when it is not resident
        (then it is read into `slot_for_miss`). Either way its slot stays in use until the layer
        is known computed or the step ends."""
        self._in_use[key] = self.step
        slot = self._slots.get(key)
        if slot is not None:
            self.policy.touch(key, self.step)
        return slot

    def claim_read_ahead(self, key: ExpertKey) -> ReadAhead | None:
        """The read ahead of `key`, if one was made: it is the forward's now (`admit` it)."""
        ahead = self._reads_ahead.pop(key, None)
        if ahead is not None:
            self._release(self.expert_nbytes[key[0]])
        return ahead

    def slot_for_miss(self, layer: int, protected: Collection[ExpertKey]) -> int:
        """A slot for a miss of `layer` that the forward waits for. It never fails: it evicts an
        expert of the same bank (never a `protected` one, the layer's own routed set), else waits
        for the layers before it to compute and takes their experts' slots, else drops a
        prediction's pin (its expert is read again if used), else gives up a read ahead."""
        bank, layers = self.bank(layer), self._bank_layers[layer]
        while True:
            slot = bank.take()
            if slot is not None:
                return slot
            if self._evict_one(layers, protected):
                continue
            if any(key[0] < layer for key in self._in_use):
                # Slots held by layers of this step that may still be queued. Every earlier
                # layer was submitted (evaluated, or `mx.async_eval`'d at decode: moe_block.py),
                # so once the stream is drained they have computed and their slots are free.
                self.host_reads.synchronize("a miss waits for earlier layers' slots")
                self.layer_computed(layer - 1)
                continue
            if self._drop_latest_pin(layers, protected) or self._give_up_latest_read(layers):
                continue
            raise RuntimeError(
                f"layer {layer}: all {bank.capacity} slots of its bank are in use at once"
            )

    def admit(self, key: ExpertKey, slot: int, protected: Collection[ExpertKey] = ()) -> None:
        """`key` has been read into `slot`: it is resident, evicting others (never `protected`
        ones) until the budget holds. If only protected experts remain the pool runs over budget
        until they are released: the experts a layer routes to are always all there."""
        if key in self._slots:
            self._drop(key)
        nbytes = self.expert_nbytes[key[0]]
        self._make_room(nbytes, protected)
        self._slots[key] = slot
        self._resident_mask[self._row[key[0]], key[1]] = True
        self.resident_bytes += nbytes
        self.policy.touch(key, self.step)

    def seed(self, layer: int, experts: Sequence[int], write: Callable[[int, dict], None]) -> int:
        """Admit `experts` of `layer` (most wanted first) whose bytes are at hand without a read
        (a prefill's whole-layer buffer): `write(expert, views)` copies one into its slot. At most
        the layer's share of the cache (its room over the layers sharing its bank), so that a
        prompt's last layer does not push out its first; never evicting an expert in use, pinned
        or held, and none of those seeded here. Resident ones are only counted as used. Returns
        how many were copied."""
        share = max(1, self.room(layer) // len(self._bank_layers[layer]))
        wanted = [(layer, e) for e in experts[:share]]
        protected = set(wanted)
        nbytes, copied = self.expert_nbytes[layer], 0
        for key in wanted:
            if key in self._slots:
                self.policy.touch(key, self.step)
                continue
            self._make_room(nbytes, protected)
            if self.resident_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
                break
            slot = self._free_slot(layer, protected)
            if slot is None:
                break
            write(key[1], self.views(layer, slot))
            self.admit(key, slot, protected)
            copied += 1
        return copied

    def _free_slot(self, layer: int, protected: Collection[ExpertKey]) -> int | None:
        """A slot of `layer`'s bank, evicting by the policy if none is free (None: every slot is
        held by an expert that may not go)."""
        bank, layers = self.bank(layer), self._bank_layers[layer]
        slot = bank.take()
        while slot is None and self._evict_one(layers, protected):
            slot = bank.take()
        return slot

    def give_back(self, layer: int, slot: int, writing: Future | None = None) -> None:
        """A slot taken for a read that was not admitted (it failed, or was cancelled); with
        `writing`, the read that may still be writing into it."""
        self.bank(layer).give(slot, writing=writing)

    # -- reads ahead --------------------------------------------------------------------------------

    def pin(self, key: ExpertKey, step: int) -> None:
        """Step `step` routes to the resident `key`: it stays until that step's layer computed."""
        self._pinned[key] = max(step, self._pinned.get(key, step))

    def read_ahead(
        self, key: ExpertKey, step: int, submit: Callable[..., Future], source: str = "heads"
    ) -> bool:
        """Start reading `key` for step `step`: reserve its bytes, take a slot and call
        `submit(into=views)` with the slot's host views. False, reading nothing, when the budget or the bank has no room
        that is not pinned or in use: the layer then reads it when it runs, rather than a read
        ahead taking memory beyond the budget."""
        nbytes = self.expert_nbytes[key[0]]
        self._make_room(nbytes, ())
        if self.resident_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            return False
        self.reserved_bytes += nbytes
        slot = self._free_slot(key[0], ())
        if slot is None:
            self._release(nbytes)
            return False
        self._reads_ahead[key] = ReadAhead(
            step, submit(into=self.views(key[0], slot)), slot, source
        )
        return True

    def drop_unused_reads_ahead(self, layer: int, used: Collection[ExpertKey]) -> int:
        """`layer` has routed this step: its reads ahead for this step (or before) that it does not
        use are dropped now rather than at the step's end, so that a wrong guess queued behind
        others is never read and its slot and bytes are free for the layers after. One already
        read is kept as a cached expert instead (its bytes are paid for, and an expert a guess
        nearly chose is often routed soon), evicting by the policy as any admitted expert does.
        Returns how many were not used."""
        unused = [
            key
            for key, ahead in self._reads_ahead.items()
            if key[0] == layer and ahead.step <= self.step and key not in used
        ]
        for key in unused:
            ahead = self._reads_ahead[key]
            if ahead.read.done() and ahead.read.exception() is None:
                self.claim_read_ahead(key)
                self.admit(key, ahead.slot)
            else:
                self._forget_read_ahead(key)
        return len(unused)

    def forget_reads_ahead(self) -> None:
        """Drop every read ahead (a new request): reads in flight finish on their own."""
        for key in list(self._reads_ahead):
            self._forget_read_ahead(key)
        self._given_up.clear()

    def _forget_read_ahead(self, key: ExpertKey) -> None:
        """Drop a read ahead: its reservation ends, and its slot is free once it is not written."""
        ahead = self._reads_ahead.pop(key)
        ahead.read.cancel()  # not started: never runs; in flight: finishes on its own
        self._release(self.expert_nbytes[key[0]])
        self.bank(key[0]).give(ahead.slot, writing=ahead.read)

    def _release(self, nbytes: int) -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)

    def _drop_latest_pin(self, layers: frozenset[int], protected: Collection[ExpertKey]) -> bool:
        """Unpin the pinned expert of `layers` needed latest (it becomes evictable)."""
        pins = [
            (step, key)
            for key, step in self._pinned.items()
            if key[0] in layers and key not in protected and key not in self._in_use
        ]
        if not pins:
            return False
        del self._pinned[max(pins, key=lambda p: (p[0], p[1][0]))[1]]
        return True

    def _give_up_latest_read(self, layers: frozenset[int]) -> bool:
        """Give up the read ahead of `layers` needed latest; its slot comes back once written."""
        candidates = [key for key in self._reads_ahead if key[0] in layers]
        if not candidates:
            return False
        key = max(candidates, key=lambda k: (self._reads_ahead[k].step, k[0]))
        self._given_up[self._reads_ahead[key].step] += 1
        self._forget_read_ahead(key)
        return True

    # -- eviction -----------------------------------------------------------------------------------

    def _evict_one(self, layers: Collection[int] | None, protected: Collection[ExpertKey]) -> bool:
        """Evict one expert of `layers` (None: any layer), never a protected, pinned or in-use
        one, kept layers' last. False when there is none to evict."""
        excluded = _Excluded(self, protected, layers, self._kept_layers)
        victim = self.policy.victim(excluded)
        if victim is None and self._kept_layers:
            excluded.kept_layers = frozenset()
            victim = self.policy.victim(excluded)
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        return True

    def _make_room(self, nbytes: int, protected: Collection[ExpertKey]) -> None:
        """Evict until `nbytes` more fit in the budget, or only experts that may not go are left."""
        while self.resident_bytes + self.reserved_bytes + nbytes > self.budget_bytes:
            if not self._evict_one(None, protected):
                break

    def _drop(self, key: ExpertKey) -> None:
        """`key` leaves the pool: its slot is free for another expert."""
        slot = self._slots.pop(key)
        self._resident_mask[self._row[key[0]], key[1]] = False
        self.resident_bytes -= self.expert_nbytes[key[0]]
        self.policy.remove(key)
        self.bank(key[0]).give(slot)

    def clear(self) -> None:
        """Forget every resident expert (their slots go back to their banks)."""
        self._held.clear()
        for key in list(self._slots):
            self._drop(key)

    def close(self) -> None:
        """Drop every read ahead, resident expert and bank."""
        self.forget_reads_ahead()
        self.clear()
        self._banks.clear()
        self._bank_of.clear()


class _Excluded:
    """The experts `_evict_one` must not pick (`in` only): protected, pinned, in use, of a held
    layer, of a kept layer, or of a layer outside `layers` (None: every layer is in)."""

    def __init__(self, pool: ExpertPool, protected, layers, kept_layers: frozenset[int]) -> None:
        self.pool = pool
        self.protected = protected
        self.layers = layers
        self.kept_layers = kept_layers

    def __contains__(self, key: object) -> bool:
        return (
            key in self.protected
            or key in self.pool._pinned
            or key in self.pool._in_use
            or key[0] in self.pool._held
            or key[0] in self.kept_layers
            or (self.layers is not None and key[0] not in self.layers)
        )


def expert_layout(
    index: CheckpointIndex, layer: int, float_dtype: mx.Dtype | None
) -> tuple[SlotPart, ...]:
    """One expert of `layer` as it is resident: each tensor's shape, floating ones in the compute
    dtype."""
    parts = []
    for tensor in index.layers[layer].tensors:
        dtype = MLX_DTYPES[tensor.entry.dtype]
        if float_dtype is not None and tensor.entry.dtype in ("BF16", "F16", "F32"):
            dtype = float_dtype
        key = f"{tensor.projection}.{tensor.part}"
        parts.append(SlotPart(key, tuple(tensor.expert_shape), dtype, tensor.entry.dtype))
    return tuple(parts)

"""The streaming replacement for mlx-lm's `SwitchGLU`: routed experts come from the expert store.

Routing is chosen before this module is called (`routing.moe_block.RoutedMoE`: the true router,
or at decode a consumer layer's prediction); only `block.switch_mlp` is swapped for
`StreamingSwitchGLU`, which is called the same way, `switch_mlp(x, indices)`, and returns the same
`[..., k, hidden]` per-expert outputs.

How the experts are computed is decided here, in one place:
- decode (one token) and short prefill chunks: mlx-lm's own `gather_qmm` math over the store's slot
  bank (`slot_bank.py`), the routing remapped from expert ids to slots: one product per projection
  for the layer's whole routed set, bit-identical to resident mode (a row's product does not depend
  on which other rows the kernel is given). On the demo this cut a step's layers against each
  expert's own three `quantized_matmul`s and a stack (docs/design.md, "Slot banks").
- prefill (many tokens): the same over the layer's whole stacked tensors when the chunk touches
  most experts (or more than the bank holds).
  On the CPU with a fast BLAS (`runtime.blas`) the 4-bit kernel's cost is linear in rows, while
  dequantizing the expert costs a couple of rows' worth and the fp32 GEMM is then far cheaper per
  row (docs/notebook/figures-from-code-comments.md): an expert with at least
  `dense_rows` rows in the chunk is
  dequantized (one expert at a time: the fp32 copy lives only until its product is computed) and
  multiplied densely; the others keep `gather_qmm`, bit-identical row by row. `dense_rows=None`
  (`EngineConfig.exact_kernels`, or no fast BLAS) keeps today's kernels everywhere.
  `DensePrefillSwitchGLU` gives resident mode (stock mlx-lm's SwitchGLU) the same path, and
  `dense_prefill_linears` the model's other 4-bit projections (attention, shared experts, routers):
  once the experts ran at GEMM speed those were most of a prefill (on the demo, traced).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwitchGLU,
    _gather_sort,
    _scatter_unsort,
)

from ..errors import Edge0Error
from ..host_reads import HostReads
from .store import ExpertStore, LayerSlots

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# An expert with at least this many rows in a prefill chunk is dequantized and multiplied in fp32
# (crossover measured with `python -m engine.measure.microbench prefill`: dequantizing one
# projection costs a couple of rows of the 4-bit kernel, for the wall's and the demo's experts
# alike; docs/notebook/figures-from-code-comments.md).
DENSE_MIN_ROWS = 4


@dataclass(frozen=True)
class ProjectionSpec:
    name: str
    group_size: int
    bits: int
    mode: str
    has_biases: bool  # quantization biases (affine mode)
    has_bias: bool  # additive output bias
    weights: int = 0  # one expert's weights in this projection (out x in)

    def parts(self) -> tuple[str, ...]:
        return ("weight", "scales") + ("biases",) * self.has_biases + ("bias",) * self.has_bias


def projection_specs(switch: SwitchGLU, where: str) -> tuple[ProjectionSpec, ...]:
    specs = []
    for name in PROJECTIONS:
        proj = getattr(switch, name)
        if not isinstance(proj, QuantizedSwitchLinear):
            raise Edge0Error(
                f"{where}: routed experts must be quantized to stream them (e.g. 4-bit with "
                "`python -m mlx_lm convert -q`)"
            )
        if proj.global_scale is not None:
            raise Edge0Error(f"{where}: experts with a global scale (nvfp4) are not supported yet")
        specs.append(
            ProjectionSpec(
                name,
                proj.group_size,
                proj.bits,
                proj.mode,
                has_biases=proj.get("biases") is not None,
                has_bias="bias" in proj,
                weights=proj["weight"].shape[-2] * proj["weight"].shape[-1] * 32 // proj.bits,
            )
        )
    return tuple(specs)


class StreamingSwitchGLU(nn.Module):
    """Drop-in for `SwitchGLU` whose expert weights live in the expert store's slot banks.

    `compute` is pure compute, as mlx-lm's `SwitchGLU` is: the routed experts' outputs over the
    slots the store gives (`ExpertStore.layer_slots`). The engine's MoE block
    (`routing.moe_block.RoutedMoE`) routes, asks the store for the slots, then computes; a
    family whose own block routes calls `switch_mlp(x, indices)`, which does both."""

    def __init__(
        self,
        store: ExpertStore,
        layer: int,
        num_experts: int,
        specs: tuple[ProjectionSpec, ...],
        activation: nn.Module,
        dense_rows: int | None = None,
    ) -> None:
        super().__init__()
        # Plain attributes (not arrays/modules): none of this is a model parameter.
        self._store = store
        self._layer = layer
        self._num_experts = num_experts
        self._specs = {s.name: s for s in specs}
        self._dense_rows = dense_threshold(dense_rows, specs)
        self._host_reads = store.host_reads
        self.activation = activation

    @property
    def store(self) -> ExpertStore:
        """The expert store this layer's experts are read through."""
        return self._store

    @property
    def layer(self) -> int:
        return self._layer

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """As mlx-lm's `SwitchGLU`: a family's own block calls the streamed experts so."""
        slots, routed = self._store.layer_slots(self._layer, indices)
        return self.compute(x, routed, slots)

    def compute(self, x: mx.array, routed: np.ndarray | mx.array, slots: LayerSlots) -> mx.array:
        """The routed experts' outputs, `[..., k, hidden]`, for `x` routed to `routed` (on the
        host, or the device array of a held layer), whose experts are at `slots`."""
        if slots.groups is not None:
            return self._by_expert_groups(x, routed, slots.groups)
        if slots.host is not None and self._goes_dense(routed):
            return mixed_glu(self, x, routed, slots.bank, slots.host)
        rows = slots.device if slots.device is not None else mx.array(slots.host)
        return self._gather_glu(x, rows, slots.bank)

    def _goes_dense(self, routed: np.ndarray) -> bool:
        return self._dense_rows is not None and goes_dense(routed.size, self._num_experts, self)

    def _by_expert_groups(self, x: mx.array, routed: np.ndarray, groups) -> mx.array:
        """A prefill chunk routed to more experts than the bank holds, when whole-layer reads do
        not fit the memory plan: the experts go through the bank a bankful at a time, and each
        group's assignments are computed (and evaluated, freeing its slots) before the next
        group is read. Every assignment is computed as the whole chunk would compute it (the
        sorted kernel, or the dense path for experts with enough rows), so the values are the
        same; the memory is the bank's."""
        k = routed.shape[-1]
        dense = self._goes_dense(routed)
        flat_x = x.reshape(-1, x.shape[-1])
        experts = routed.reshape(-1)
        outputs: list[mx.array] = []
        done: list[np.ndarray] = []
        for group, slots, bank in groups:
            slot_of = np.zeros(self._num_experts, dtype=np.uint32)
            slot_of[group] = slots
            ids = np.flatnonzero(np.isin(experts, group))
            ids = ids[np.argsort(experts[ids], kind="stable")]  # grouped by expert, in order
            # The dense path computes one expert at a time; the 4-bit kernel in blocks of rows
            # whose activations stay within GATHER_ACTIVATION_BYTES.
            width = bank["up_proj.weight"].shape[-2]
            block = len(ids) if dense else gather_activation_tokens(1, width, x.dtype.size)
            for first in range(0, len(ids), block):
                part = ids[first : first + block]
                rows = flat_x[mx.array((part // k).astype(np.uint32))]
                if dense:
                    routed_part = experts[part][:, None]
                    y = mixed_glu(self, rows, routed_part, bank, slot_of[routed_part])
                else:
                    y = sorted_glu(self, rows[:, None, :], mx.array(slot_of[experts[part]]), bank)
                y = y.reshape(len(part), -1)
                self._host_reads.wait(y, "a prefill group's slots are reused")
                outputs.append(y)
            done.append(ids)
        return _in_routing_order(outputs, done, routed, x)

    # -- a bank of stacked experts (mirrors mlx-lm's SwitchGLU exactly) ----------------------------

    def _gather_glu(self, x: mx.array, indices: mx.array, bank: dict[str, mx.array]) -> mx.array:
        """The routed experts' outputs, `[..., k, hidden]`. A long chunk is computed in blocks of
        tokens, each evaluated before the next: its `[tokens, k, intermediate]` activations would
        otherwise all be alive at once (`gather_activation_tokens`). A row's product does not
        depend on the other rows given to the kernel, so blocks change no value."""
        k = indices.shape[-1]
        tokens = indices.size // k
        block = gather_activation_tokens(k, bank["up_proj.weight"].shape[-2], x.dtype.size)
        if tokens <= block:
            return self._gather_glu_block(x, indices, bank)
        flat_x, flat_indices = x.reshape(tokens, x.shape[-1]), indices.reshape(tokens, k)
        blocks = tokens // block  # equal blocks of at least `block` tokens: none runs unsorted
        bounds = [tokens * i // blocks for i in range(blocks + 1)]
        outputs = []
        for start, end in zip(bounds, bounds[1:]):
            y = self._gather_glu_block(flat_x[start:end], flat_indices[start:end], bank)
            self._host_reads.wait(y, "a prefill block's activations are freed")
            outputs.append(y)
        y = mx.concatenate(outputs, axis=0)
        return y.reshape(*indices.shape, y.shape[-1])

    def _gather_glu_block(
        self, x: mx.array, indices: mx.array, bank: dict[str, mx.array]
    ) -> mx.array:
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= SORTED_MIN_ROWS
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, indices)
        x_up = self._gather_project(x, idx, bank, self._specs["up_proj"], do_sort)
        x_gate = self._gather_project(x, idx, bank, self._specs["gate_proj"], do_sort)
        x = self._gather_project(
            self.activation(x_up, x_gate), idx, bank, self._specs["down_proj"], do_sort
        )
        if do_sort:
            x = _scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)

    @staticmethod
    def _gather_project(
        x: mx.array, idx: mx.array, bank: dict[str, mx.array], spec: ProjectionSpec, do_sort: bool
    ) -> mx.array:
        p = spec.name
        y = mx.gather_qmm(
            x,
            bank[f"{p}.weight"],
            bank[f"{p}.scales"],
            bank.get(f"{p}.biases"),
            rhs_indices=idx,
            transpose=True,
            group_size=spec.group_size,
            bits=spec.bits,
            mode=spec.mode,
            sorted_indices=do_sort,
        )
        if spec.has_bias:
            y = y + mx.expand_dims(bank[f"{p}.bias"][idx], -2)
        return y


# At most this many bytes of one block's expert activations (the up and gate projections and
# their product, `[tokens, k, intermediate]` each) are alive at once in a prefill chunk computed
# on the 4-bit kernels: the memory plan's activation term. Wide experts at a native K of 8 would
# otherwise hold several times the expert cache during one layer of a long chunk.
GATHER_ACTIVATION_BYTES = 32 << 20
# The kernel sorts its rows by expert from this many routed rows on (as mlx-lm's SwitchGLU does):
# a block keeps at least this many, so that it runs the same sorted kernel as the whole chunk (and
# the resident model) would.
SORTED_MIN_ROWS = 64


def gather_activation_tokens(k: int, intermediate: int, itemsize: int) -> int:
    """The fewest tokens in a block of a prefill chunk's 4-bit expert products: as many as
    `GATHER_ACTIVATION_BYTES` of activations hold, and enough rows to run sorted."""
    per_token = 3 * k * intermediate * itemsize
    return max(-(-SORTED_MIN_ROWS // k), GATHER_ACTIVATION_BYTES // per_token)


# -- prefill at GEMM speed ---------------------------------------------------------------------------


def dense_threshold(dense_rows: int | None, specs) -> int | None:
    """The fewest rows an expert of these projections takes the dense path with: the configured
    minimum, or more where its costs say so (None: the dense path is off)."""
    if dense_rows is None:
        return None
    return max(dense_rows, _rows_worth_dequantizing(specs))


def goes_dense(assignments: int, num_experts: int, glu) -> bool:
    """Whether a prefill chunk takes the dense path: only when its average expert has enough rows
    to be worth dequantizing. Below that, few experts would go dense and splitting the chunk by
    expert (and, resident, reading the routing back every layer) costs more than it saves (a
    short prompt on the demo was slower dense than on the 4-bit kernels:
    docs/notebook/figures-from-code-comments.md). Decided from sizes alone, so resident and
    streamed modes agree."""
    return assignments >= glu._dense_rows * num_experts


def mixed_glu(
    glu: StreamingSwitchGLU | DensePrefillSwitchGLU,
    x: mx.array,
    routed: np.ndarray,
    bank: dict[str, mx.array],
    slots: np.ndarray,
) -> mx.array:
    """`switch_mlp(x, indices)` for a prefill chunk: `routed` [..., k] the experts on the host,
    `slots` the same routing as rows of `bank` (stacked [n, ...] tensors). Experts with at least
    the GLU's threshold of rows: dequantized, fp32 GEMMs; the rest: `gather_qmm` (as the exact
    path)."""
    dense_rows = glu._dense_rows
    k = routed.shape[-1]
    flat_x = x.reshape(-1, x.shape[-1])
    experts = routed.reshape(-1)
    slots = slots.reshape(-1)
    order = np.argsort(experts, kind="stable")  # assignments grouped by expert, tokens in order
    _, starts, counts = np.unique(experts[order], return_index=True, return_counts=True)
    done: list[np.ndarray] = []  # assignment ids, in the order of `outputs`
    outputs: list[mx.array] = []
    small: list[np.ndarray] = []
    pending: list[mx.array] = []
    pending_bytes = 0
    for start, count in zip(starts.tolist(), counts.tolist()):
        ids = order[start : start + count]
        if count < dense_rows:
            small.append(ids)
            continue
        rows = flat_x[mx.array((ids // k).astype(np.uint32))]
        outputs.append(dense_expert_glu(glu, rows, bank, int(slots[ids[0]])))
        done.append(ids)
        # Computed in groups of DENSE_EVAL_BYTES of fp32 copies: left to one evaluation at the
        # end, every copy of the layer could be alive at once (every expert's copy, on the wall);
        # one evaluation per expert costs more than small experts' products.
        pending.append(outputs[-1])
        pending_bytes += 4 * _expert_weights(glu._specs.values())
        if pending_bytes >= DENSE_EVAL_BYTES:
            glu._host_reads.wait(pending, "dense prefill copies are freed")
            pending, pending_bytes = [], 0
    if small:
        ids = np.concatenate(small)  # still grouped by expert: sorted slots
        rows = flat_x[mx.array((ids // k).astype(np.uint32))][:, None, :]
        idx = mx.array(slots[ids].astype(np.uint32))
        outputs.append(sorted_glu(glu, rows, idx, bank).squeeze(-2))
        done.append(ids)
    return _in_routing_order(outputs, done, routed, x)


def _in_routing_order(
    outputs: list[mx.array], done: list[np.ndarray], routed: np.ndarray, x: mx.array
) -> mx.array:
    """Per-assignment outputs computed in pieces (`outputs[i]` for the flat assignment ids
    `done[i]`), back in the routing's order: `[..., k, hidden]`. An assignment not computed
    (another rank's expert) is a row of zeros."""
    ids = np.concatenate(done)
    position = np.full(routed.size, len(ids), dtype=np.uint32)
    position[ids] = np.arange(len(ids), dtype=np.uint32)
    y = mx.concatenate([*outputs, mx.zeros((1, x.shape[-1]), x.dtype)], axis=0)[mx.array(position)]
    return y.reshape(*routed.shape, y.shape[-1])


def sorted_glu(
    glu: StreamingSwitchGLU | DensePrefillSwitchGLU,
    rows: mx.array,
    idx: mx.array,
    bank: dict[str, mx.array],
) -> mx.array:
    """The GLU of `rows` `[n, 1, hidden]`, row i through the bank's expert `idx[i]`, with `idx`
    sorted: the kernel a whole chunk's sorted assignments run (`_gather_glu`)."""
    x_up = glu._gather_project(rows, idx, bank, glu._specs["up_proj"], True)
    x_gate = glu._gather_project(rows, idx, bank, glu._specs["gate_proj"], True)
    return glu._gather_project(
        glu.activation(x_up, x_gate), idx, bank, glu._specs["down_proj"], True
    )


# The cost model of the dense path, per format: what the 4-bit kernel costs per weight per row,
# what dequantizing costs per weight, and the fixed cost of taking one expert down the dense path
# (a dozen MLX ops and their dispatch). The values were measured on the 2-core box (microbench
# products and formats, prefill on the demo; docs/notebook/figures-from-code-comments.md and
# docs/notebook/2026-12-mxfp4.md). With them small experts (the demo's) need more
# rows than DENSE_MIN_ROWS to be worth it, large ones do not; mxfp4's kernel is cheaper and its
# dequantize far dearer, so only experts with many more rows go dense. Other modes (nvfp4,
# mxfp8) are taken as mxfp4.
QMM_NS_PER_WEIGHT_ROW = {"affine": 0.87, "mxfp4": 0.64}
DEQUANTIZE_NS_PER_WEIGHT = {"affine": 1.3, "mxfp4": 12.0}
DENSE_EXPERT_OVERHEAD_NS = 500_000


def _rows_worth_dequantizing(specs) -> int:
    """The fewest rows for which one expert's dense path beats the 4-bit kernel."""
    weights = _expert_weights(specs)
    mode = next(iter(specs)).mode
    mode = mode if mode in QMM_NS_PER_WEIGHT_ROW else "mxfp4"
    dense = DEQUANTIZE_NS_PER_WEIGHT[mode] * weights + DENSE_EXPERT_OVERHEAD_NS
    return math.ceil(dense / (QMM_NS_PER_WEIGHT_ROW[mode] * weights))


# At most this many bytes of dequantized (fp32) expert weights wait for one evaluation: a wall
# expert's copy is then used while in the cache (faster than larger groups on the wall's prefill:
# docs/notebook/figures-from-code-comments.md), and the demo's small copies go about
# twenty at a time.
DENSE_EVAL_BYTES = 8 << 20


def _expert_weights(specs) -> int:
    """One expert's weights over its projections."""
    return sum(spec.weights for spec in specs)


def dense_expert_glu(
    glu: StreamingSwitchGLU | DensePrefillSwitchGLU,
    rows: mx.array,
    bank: dict[str, mx.array],
    slot: int,
) -> mx.array:
    up = _dense_project(rows, bank, slot, glu._specs["up_proj"])
    gate = _dense_project(rows, bank, slot, glu._specs["gate_proj"])
    return _dense_project(glu.activation(up, gate), bank, slot, glu._specs["down_proj"])


def _dense_project(x: mx.array, bank: dict[str, mx.array], slot: int, spec: ProjectionSpec):
    p = spec.name
    biases = bank.get(f"{p}.biases")
    weight = mx.dequantize(
        bank[f"{p}.weight"][slot],
        bank[f"{p}.scales"][slot],
        None if biases is None else biases[slot],
        group_size=spec.group_size,
        bits=spec.bits,
        mode=spec.mode,
    )
    y = mx.matmul(x, weight.astype(x.dtype).T)
    if spec.has_bias:
        y = y + bank[f"{p}.bias"][slot]
    return y


class DensePrefillSwitchGLU(SwitchGLU):
    """Resident mode's `SwitchGLU` (the same projection modules, so the same parameter names) with
    the dense prefill path: stock mlx-lm for decode and for the exact setting."""

    def __init__(
        self,
        switch: SwitchGLU,
        specs: tuple[ProjectionSpec, ...],
        dense_rows: int,
        host_reads: HostReads,
    ):
        nn.Module.__init__(self)
        self._host_reads = host_reads
        self.gate_proj = switch.gate_proj
        self.up_proj = switch.up_proj
        self.down_proj = switch.down_proj
        self.activation = switch.activation
        self._specs = {s.name: s for s in specs}
        self._dense_rows = dense_threshold(dense_rows, specs)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if (
            indices.size // indices.shape[-1] <= 1
            or not isinstance(self.gate_proj, QuantizedSwitchLinear)
            or not goes_dense(indices.size, self.gate_proj["weight"].shape[0], self)
        ):
            # Decode, or a chunk with too few rows an expert: the 4-bit kernels. Or the model was
            # dequantized since (the training student's `dequantize_model`): mlx-lm's float path.
            return super().__call__(x, indices)
        # The routing on the host decides expert by expert.
        routed = self._host_reads.read([indices], "a dense prefill chunk's routing")[0]
        bank = {}
        for spec in self._specs.values():
            proj = getattr(self, spec.name)
            for part in spec.parts():
                bank[f"{spec.name}.{part}"] = proj[part]
        return mixed_glu(self, x, routed, bank, routed)

    _gather_project = staticmethod(StreamingSwitchGLU._gather_project)


class DensePrefillQuantizedLinear(nn.QuantizedLinear):
    """A `QuantizedLinear` that multiplies `DENSE_MIN_ROWS`+ rows (prefill) by its dequantized
    weight with a fp32 GEMM, and fewer (decode) with the 4-bit kernel. Set as the class of the
    model's own instances (`dense_prefill_linears`): names, freezing and wrappers stay as they are."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < DENSE_MIN_ROWS:
            return super().__call__(x)
        weight = mx.dequantize(
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        y = mx.matmul(x, weight.astype(x.dtype).T)
        if "bias" in self:
            y = y + self["bias"]
        return y


# A projection whose fp32 copy would be larger keeps the 4-bit kernel (e.g. the output head of a
# large vocabulary); a prefill chunk does not compute the head anyway.
DENSE_LINEAR_MAX_BYTES = 64 << 20


def dense_prefill_linears(model: nn.Module) -> int:
    """Give every plain `QuantizedLinear` of `model` the dense prefill path; returns how many.
    Embeddings (a gather, not a product), global-scale modes (nvfp4) and projections larger than
    `DENSE_LINEAR_MAX_BYTES` in fp32 are left as they are."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is not nn.QuantizedLinear or "global_scale" in module:
            continue
        out_dims, packed = module["weight"].shape
        if out_dims * packed * (32 // module.bits) * 4 <= DENSE_LINEAR_MAX_BYTES:
            module.__class__ = DensePrefillQuantizedLinear
            count += 1
    return count

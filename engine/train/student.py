"""The student path: the served model as one differentiable function of whole sequences.

Phases 2 and 3 train the recovery LoRA through what decode computes, on a frozen base:

- **Base.** The dequantized reconstruction of the served 4-bit checkpoint (mlx-lm's
  `dequantize_model`): every quantized linear, embedding and expert bank becomes its float twin
  holding exactly the values the 4-bit kernels compute with. Frozen.
- **Prediction is the routing.** The head owned by layer N reads [x_N,t; onehot_K(A_N,t);
  onehot_K(A_N,t-1)], A being the experts layer N *executed* (a predicted set when N is itself a
  consumer), and predicts layer N+1's router logits for token t+1. Layer N+1 routes position t+1
  by them through `routing.route` at width K, with its own expert bias, as the engine's head flush
  does. Every other layer, and every position before `gate_prefix`, routes with its own gate at K.
- **LoRA** (`lora.LoRALinear`) on attention, linear-attention and shared-expert projections; the
  only trainable parameters. Routed experts are never adapted (they are streamed).

Teacher forcing against the engine: the engine prefills a prompt with the true routers (every
prompt position but the last) and routes each later position by the prediction flushed after the
position before it. `gate_prefix=g` routes positions < g by the gate and every later position by
the prediction from the position before, so with g = len(prompt) - 1 (at least 1) the student is
the engine on that prompt, position for position (tests/test_train_lora_distill.py checks it).
The one difference in training sequences: position 0 has no position before it, so it always uses
the gate (g >= 1), where at decode the first generated position of a request is predicted from the
prefill tail. A one-token prompt at decode is g = 1 exactly.

Beside it, shared by phases 2 and 3 and `edge0 eval`: `teacher.py` (the unquantized float model),
`data.py` (batched sampling, prompts drawn from a corpus) and `run.py` (the resumable run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

from ..adapters.lora import AppliedLoRA, LoRAAdapter, LoRALinear, linear_dims, load_lora, save_lora
from ..adapters.profiles import discover_profiles
from ..checkpoint.index import base_fingerprint
from ..config import EngineConfig
from ..errors import Edge0Error
from ..routing.functions import route
from ..routing.moe_block import RoutedMoE, ops_for
from ..routing.prerouter import (
    PrerouterHeads,
    head_forward,
    sequence_features,
)
from ..runtime.loader import LoadedModel, load

# LoRA targets by kind: a linear layer whose module path holds one of these markers. Routers
# (`mlp.gate`), the shared expert's scalar gate (`mlp.shared_expert_gate`), routed experts, dense FFN
# layers, embeddings and the LM head are not targets.
LORA_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", (".self_attn.", ".attention.")),
    ("linear attention", (".linear_attn.",)),
    ("shared expert", (".shared_expert.", ".shared_experts.")),
)


def lora_kind(module_path: str) -> str | None:
    """The kind of LoRA target a module path is ("attention", "linear attention", "shared expert"),
    or None for a module LoRA never adapts."""
    for kind, markers in LORA_KINDS:
        if any(marker in module_path for marker in markers):
            return kind
    return None


@dataclass(frozen=True)
class LoRAInit:
    """A fresh adapter: A uniform in +-1/sqrt(in) (mlx-lm's LoRA init), B zero, so training starts
    exactly at the base model."""

    r: int = 16
    alpha: float = 32.0
    seed: int = 0


# -- the student path --------------------------------------------------------------------------------


def head_logits(heads: PrerouterHeads, row: int, z: mx.array) -> mx.array:
    """`PrerouterHeads` maths for one owner over many positions: features [..., H+2E] -> [..., E]."""
    return head_forward(heads.fc1[row], heads.fc2[row], heads.linear_init[row], z)


class _Plan:
    """What the MoE blocks of one forward share: the width K, which positions route by prediction,
    the predictions in flight from owner to consumer, and (for `edge0 eval`) a routing record."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.predicted_positions: mx.array | None = None  # [B, T, 1] bool
        self.predicted: dict[int, mx.array] = {}  # consumer layer -> logits [B, T, E]
        self.record: dict[int, tuple[mx.array, mx.array, bool]] | None = None


class StudentMoE(RoutedMoE):
    """A family's MoE block on the student path: the engine's `RoutedMoE` (same children, names and
    routing function), routed over whole sequences by the forward's `_Plan`."""

    def __init__(self, block: nn.Module, layer: int, ops, plan: _Plan) -> None:
        super().__init__(block, layer, ops, plan)
        self._head: tuple[PrerouterHeads, int] | None = None  # set on owner layers

    def __call__(self, x: mx.array) -> mx.array:
        plan, bias = self._state, self.expert_bias()
        true_inds, weights = route(self.gate_logits(x), self.routing_spec, plan.k, bias)
        inds = true_inds
        predicted = plan.predicted.pop(self.layer, None)
        if predicted is not None:
            # The consumer's own routing function and expert bias, as in `RoutingState.flush`.
            p_inds, p_weights = route(predicted, self.routing_spec, plan.k, bias)
            inds = mx.where(plan.predicted_positions, p_inds, inds)
            weights = mx.where(plan.predicted_positions, p_weights, weights)
        y = self._ops.combine(self, x, self.switch_mlp(x, inds), weights)
        if self._head is not None:
            plan.predicted[self.layer + 1] = self._predict(x, inds)
        if plan.record is not None:
            plan.record[self.layer] = (inds, true_inds, predicted is not None)
        return y

    def _predict(self, x: mx.array, inds: mx.array) -> mx.array:
        """Next layer's logits at every position, from this layer's state one position earlier."""
        heads, row = self._head
        experts = self.routing_spec.num_experts
        z = sequence_features(x.astype(heads.fc1.dtype), inds, experts)
        logits = head_logits(heads, row, z).astype(x.dtype)
        # Position t's head output routes position t+1; position 0 has none (zeros, never used).
        return mx.concatenate([mx.zeros_like(logits[:, :1]), logits[:, :-1]], axis=1)


class Student:
    """The served model as a function of whole token sequences: `student(tokens) -> logits`."""

    def __init__(
        self,
        loaded: LoadedModel,
        k: int,
        heads: PrerouterHeads | None,
        lora: LoRAAdapter | None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.fingerprint = base_fingerprint(loaded.index)
        self.k = k
        self.heads = heads
        self.lora = lora
        self._plan = _Plan(k)
        ops = ops_for(loaded.family.router)
        self.blocks: dict[int, StudentMoE] = {}
        for site in loaded.sites:
            block = StudentMoE(site.parent, site.layer, ops, self._plan)
            setattr(site.decoder_layer, site.block_attribute, block)
            self.blocks[site.layer] = block
        for row, owner in enumerate(heads.owners if heads is not None else []):
            self.blocks[owner]._head = (heads, row)
        # Layers routed by prediction (at positions >= gate_prefix).
        self.consumers = [o + 1 for o in heads.owners] if heads is not None else []

    def __call__(
        self,
        tokens: mx.array,
        gate_prefix: int | mx.array = 1,
        record: dict | None = None,
    ) -> mx.array:
        """Logits [B, T, V] for tokens [B, T]. Positions < gate_prefix (an int or one per row, at
        least 1) route consumer layers by their gate; later ones by the prediction. With `record`,
        fills layer -> (executed indices, true-router indices, routed by prediction) per MoE layer."""
        batch, length = tokens.shape
        prefix = mx.broadcast_to(mx.array(gate_prefix), (batch,))
        if mx.min(prefix).item() < 1:
            raise Edge0Error("gate_prefix must be at least 1: position 0 has no prediction")
        plan = self._plan
        plan.predicted_positions = (mx.arange(length)[None, :] >= prefix[:, None])[..., None]
        plan.predicted, plan.record = {}, record
        try:
            return self.model(tokens)
        finally:
            plan.predicted, plan.record = {}, None

    # -- the adapter ----------------------------------------------------------------------------------

    def lora_modules(self) -> dict[str, LoRALinear]:
        return {p: m for p, m in self.model.named_modules() if isinstance(m, LoRALinear)}

    def lora_weights(self) -> dict[str, tuple[mx.array, mx.array]]:
        return {p: (m.lora_a, m.lora_b) for p, m in self.lora_modules().items()}

    def save_lora(self, path: Path) -> None:
        """`lora_k{K}.safetensors` for the engine (fp16, the base's fingerprint)."""
        if self.lora is None:
            raise Edge0Error("this student has no LoRA to save")
        save_lora(path, self.lora_weights(), self.lora.r, self.lora.alpha, self.k, self.fingerprint)


def load_student(
    model_dir: str | Path,
    k: int | None = None,
    heads: bool = True,
    lora: Path | LoRAInit | None = None,
) -> Student:
    """The student for width K: dequantized base, the K profile's heads (when `heads`), and a LoRA
    read from a file or freshly initialized; only the LoRA is trainable."""
    model_dir = Path(model_dir)
    loaded = load(model_dir, EngineConfig(mode="resident"))
    dequantize_model(loaded.model)
    mx.eval(loaded.model.parameters())  # drop the packed weights now, not at the first forward
    k = loaded.top_k if k is None else k
    if not 1 <= k <= loaded.num_experts:
        raise Edge0Error(f"K={k} must be between 1 and the {loaded.num_experts} routed experts")
    fingerprint = base_fingerprint(loaded.index)
    prerouter = _profile_heads(model_dir, loaded, k, fingerprint) if heads else None

    adapter = None
    if isinstance(lora, LoRAInit):
        adapter = _fresh_lora(loaded.model, lora)
    elif lora is not None:
        adapter = load_lora(Path(lora), fingerprint)
    student = Student(loaded, k, prerouter, adapter)
    if adapter is not None:
        AppliedLoRA(student.model, adapter, loaded.float_dtype)
    student.model.freeze()
    for module in student.lora_modules().values():
        module.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
    return student


def _profile_heads(model_dir: Path, loaded: LoadedModel, k: int, fingerprint: str):
    """The heads of `prerouter_k{K}`, exactly as the engine loads them."""
    files = discover_profiles(model_dir).get(k)
    if files is None or files.prerouter is None:
        raise Edge0Error(
            f"{model_dir}: no prerouter heads for K={k}; train them with `edge0 train heads`"
        )
    return loaded.load_heads(files.prerouter, fingerprint, k)


def _fresh_lora(model: nn.Module, init: LoRAInit) -> LoRAAdapter:
    mx.random.seed(init.seed)
    weights = {}
    for path, module in model.named_modules():
        if lora_kind(path) and isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            d_in, d_out = linear_dims(module)
            bound = 1.0 / math.sqrt(d_in)
            a = mx.random.uniform(-bound, bound, (init.r, d_in))
            weights[path] = (a, mx.zeros((d_out, init.r)))
    if not weights:
        raise Edge0Error(
            "this model has no attention, linear-attention or shared-expert projection"
        )
    return LoRAAdapter(Path("<new LoRA>"), init.r, init.alpha, None, weights)

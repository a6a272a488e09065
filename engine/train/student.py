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

import contextlib
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

from ..adapters.lora import AppliedLoRA, LoRAAdapter, LoRALinear, linear_dims, load_lora, save_lora
from ..adapters.profiles import AdapterFiles, ProfileSearch
from ..checkpoint.index import CheckpointIndex
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..experts.freed_memory import release_freed_memory
from ..routing.functions import route
from ..routing.moe_block import RoutedMoE, ops_for
from ..routing.prerouter import (
    PrerouterHeads,
    head_forward,
    sequence_features,
)
from ..runtime.layer_major import layer_major
from ..runtime.linux_memory import available_memory_bytes
from ..runtime.loader import LoadedModel, compute_dtype, load, read_config, routed_top_k
from ..runtime.memory_plan import PlanRefused
from .streamed_student import LayerwiseGrad, make_experts_trainable, streaming_config

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


# `load_student(lora=PROFILE_LORA)`: the LoRA of the K profile, beside its heads.
PROFILE_LORA = "profile"


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
        self.base = False  # the checkpoint as it is: its own routers, no predictions (teacher)
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
        ops = self._ops
        y = ops.combine(
            self, x, self.routed_experts(ops.expert_input(self, x, weights), inds), weights
        )
        if self._head is not None and not plan.base:
            heads, row = self._head
            plan.predicted[heads.consumers[row]] = self._predict(x, inds)
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
        adapter_folder: Path | None = None,
    ) -> None:
        self.loaded = loaded
        # The folder the K profile's heads came from: phases 2 and 3 write the LoRA beside them
        # (a LoRA is trained on particular heads), None without heads.
        self.adapter_folder = adapter_folder
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        self.k = k
        self.heads = heads
        self.lora = lora
        self.planned_step: Step | None = None  # the training step the plan holds (`load_for_step`)
        self.routing_plan = _Plan(k)
        ops = ops_for(loaded.family.name)
        self.blocks: dict[int, StudentMoE] = {}
        for site in loaded.sites:
            block = StudentMoE(site.parent, site.layer, ops, self.routing_plan)
            setattr(site.decoder_layer, site.block_attribute, block)
            self.blocks[site.layer] = block
        for row, owner in enumerate(heads.owners if heads is not None else []):
            self.blocks[owner]._head = (heads, row)
        # Layers routed by prediction (at positions >= gate_prefix).
        self.consumers = list(heads.consumers) if heads is not None else []

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
        plan = self.routing_plan
        plan.predicted_positions = (mx.arange(length)[None, :] >= prefix[:, None])[..., None]
        plan.predicted, plan.record = {}, record
        try:
            with self.step():
                return self.model(tokens)
        finally:
            plan.predicted, plan.record = {}, None

    def layer_major(
        self,
        batches: list[mx.array],
        records: list[dict | None],
        score: Callable[[int, mx.array], None],
        after_layer: Callable[[int], None] | None = None,
    ) -> None:
        """`score(b, logits)` with each batch's logits as `self(batch, gate_prefix=1,
        record=records[b])` gives them, computed a decoder layer at a time over every batch
        (`runtime/layer_major.py`): each MoE layer's experts are read about once for them all.
        `after_layer(index)` runs once a layer has run every batch."""
        plan = self.routing_plan
        states = [
            ({}, (mx.arange(tokens.shape[1]) >= 1)[None, :, None], record)
            for tokens, record in zip(batches, records)
        ]

        def enter(b: int) -> None:
            plan.predicted, plan.predicted_positions, plan.record = states[b]

        def leave(b: int) -> list[mx.array]:
            predicted, _, record = states[b]  # (the same objects the blocks updated)
            routed = [a for kept in (record or {}).values() for a in kept[:2]]
            return list(predicted.values()) + routed

        try:
            layer_major(
                self.model, batches, self.model, score, self.loaded.store, enter, leave, after_layer
            )
        finally:
            plan.predicted, plan.record = {}, None

    def base_logits(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        """Logits of the checkpoint as it is: every layer routed by its own router at the model's
        native K, no LoRA; the 4-bit model's own outputs (its dequantized values, computed in
        float), with no gradient. The teacher of phases 2 and 3 when no float model is given."""
        plan = self.routing_plan
        lora_modules = self.lora_modules().values()
        scales = [m.scale for m in lora_modules]
        plan.base, plan.k, plan.predicted_positions = True, self.loaded.top_k, None
        for module in lora_modules:
            module.scale = 0.0
        try:
            with self.step():
                return mx.stop_gradient(self.model(tokens, cache=cache))
        finally:
            plan.base, plan.k = False, self.k
            for module, scale in zip(lora_modules, scales):
                module.scale = scale

    def describe(self, rows: int, length: int) -> str:
        """One line for a training run's start: which student, and (streamed) what a step of
        `rows` sequences of `length` tokens holds within the memory plan."""
        if not self.streamed:
            return "student: in memory (the base dequantized; the faster path where it fits)"
        plan = self.loaded.memory_plan
        kept = self.planned_step.kept_top_k if self.planned_step is not None else 0
        training = step_bytes(self.loaded.config, rows, length, self.k, kept)
        lora = sum(a.size + b.size for a, b in self.lora_weights().values())
        training["LoRA and AdamW"] = 4 * lora * 4  # weights, gradient and two moments, float32
        # The plan holds the step's layer inputs and logits already (`held_bytes`).
        total = plan.total_bytes - plan.held_bytes + sum(training.values())
        limit = f" of {format_bytes(plan.limit_bytes)}" if plan.limit_bytes is not None else ""
        terms = ", ".join(f"{name} {format_bytes(n)}" for name, n in training.items())
        return (
            f"student: streamed (routed experts stay 4-bit, read through a "
            f"{format_bytes(plan.expert_cache_bytes)} expert cache, again in backward); a step "
            f"holds about {format_bytes(total)}{limit}: the model's plan "
            f"{format_bytes(plan.total_bytes - plan.held_bytes)}, {terms}"
        )

    def value_and_grad(self, loss_fn):
        """`loss_fn`'s value and its LoRA gradients: by autograd over the whole model in memory;
        a layer at a time on the streamed student (`streamed_student.LayerwiseGrad`), whose
        memory is then one layer's."""
        if self.streamed:
            return LayerwiseGrad(self, loss_fn)
        return nn.value_and_grad(self.model, loss_fn)

    def close(self) -> None:
        """Give back what the student holds outside Python's reach: the streamed student's expert
        cache and reader threads, and freed buffers. A command that loads one student after
        another (`edge0 eval --profiles`) plans each load with what the process holds then."""
        if self.loaded.store is not None:
            self.loaded.store.close()
        gc.collect()
        release_freed_memory()

    @property
    def streamed(self) -> bool:
        """Routed experts read through the expert cache (`streamed_student.py`), not in memory."""
        return self.loaded.store is not None

    @contextlib.contextmanager
    def step(self):
        """One forward is one step of the expert cache (its uses and pins end with it); a
        backward's reads follow in their own groups (`streamed_student.expert_input_grad`)."""
        store = self.loaded.store
        if store is None:
            yield
            return
        store.begin_step()
        try:
            yield
        finally:
            store.end_step()

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


def step_bytes(
    model_config: dict, rows: int, length: int, k: int = 0, kept_top_k: int = 0
) -> dict[str, int]:
    """What one streamed training step of `rows` sequences of `length` tokens holds beyond the
    engine: each layer's input and its routed experts' output at K kept for the backward, the
    logits (student, teacher and their gradient; with the teacher's `kept_top_k` tokens read
    from disk instead of its logits, those targets), and one layer's backward
    (`streamed_student.expert_input_grad`): one expert's dequantized weights with their
    gradient's work, and the routed experts' activations of the step's tokens at the wider of K
    and the native K (the teacher's). From config.json, so the plan can count them before
    loading.

    Checked against a layer's measured backward on a wide wall, which it bounds
    (docs/notebook/2026-12-memory-lookahead-training.md, "The streamed student within its plan
    in the cgroup")."""
    text = model_config.get("text_config", model_config)
    itemsize = 4  # float32 on the CPU; an upper bound elsewhere
    tokens = rows * length
    layers, hidden = int(text.get("num_hidden_layers", 0)), int(text.get("hidden_size", 0))
    vocab = int(text.get("vocab_size", 0))
    width = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 0)
    assignments = tokens * max(k, routed_top_k(model_config))
    return {
        "layer inputs": layers * tokens * hidden * itemsize,
        "expert outputs": layers * tokens * (k or routed_top_k(model_config)) * hidden * itemsize,
        "logits": (2 * vocab + 3 * kept_top_k if kept_top_k else 3 * vocab) * tokens * itemsize,
        "layer backward": 2 * (3 * hidden * width + assignments * width) * itemsize,
    }


def load_student(
    model_dir: str | Path,
    k: int | None = None,
    heads: bool = True,
    lora: Path | LoRAInit | str | None = None,
    engine_config: EngineConfig | None = None,
    extra_bytes: int = 0,
    streamed: bool | None = None,
    step: Step | tuple[int, int] | None = None,
) -> Student:
    """The student for width K: the base, the K profile's heads (when `heads`, found over
    `engine_config`'s adapter search), and a LoRA read from a file, the profile's own
    (`PROFILE_LORA`) or freshly initialized; only the LoRA is trainable.

    The base is dequantized in memory where it fits (with `extra_bytes`, e.g. a float teacher),
    else streamed: routed experts packed, read through the expert cache (`streamed_student.py`;
    slower, bounded by the memory plan). `streamed` True or False forces one; False is refused
    up front where the dequantized model cannot fit. `step`: (rows, tokens) of a training step,
    whose layer inputs and logits the streamed student's memory plan holds beside the engine
    (its context is one row: no KV cache is kept), so the expert cache leaves room for them;
    where the plan does not hold it, the step that `Step` lets be made smaller and does fit
    (`student.planned_step`), else a refusal naming what would make it fit."""
    model_dir = Path(model_dir)
    engine_config = engine_config or EngineConfig()
    if streamed is None:
        streamed = student_bytes(model_dir, engine_config, extra_bytes) > (
            available_memory_bytes() or float("inf")
        )
    step = Step(*step) if isinstance(step, tuple) else step
    if streamed:
        config = streaming_config(engine_config)
        if step is None:
            loaded = load(model_dir, config)
        else:
            loaded, step = load_for_step(model_dir, config, step, k or 0)
    else:
        check_student_fits(model_dir, engine_config, extra_bytes)
        loaded = load(model_dir, replace(engine_config, mode="resident"))
        dequantize_model(loaded.model)
        mx.eval(loaded.model.parameters())  # drop the packed weights now, not at the first forward
    k = loaded.top_k if k is None else k
    if not 1 <= k <= loaded.num_experts:
        raise Edge0Error(f"K={k} must be between 1 and the {loaded.num_experts} routed experts")
    if streamed:
        loaded.store.set_top_k(max(k, loaded.top_k))  # the teacher routes at the native K
        make_experts_trainable(loaded)
    fingerprint = loaded.fingerprint
    prerouter, folder = None, None
    if heads or lora == PROFILE_LORA:
        files = _profile(model_dir, k, loaded.profiles, lora == PROFILE_LORA)
        prerouter = loaded.load_heads(files.prerouter, fingerprint, k) if heads else None
        folder = files.prerouter.parent
        if lora == PROFILE_LORA:
            lora = files.lora

    adapter = None
    if isinstance(lora, LoRAInit):
        adapter = _fresh_lora(loaded.model, lora)
    elif lora is not None:
        adapter = load_lora(Path(lora), fingerprint)
    student = Student(loaded, k, prerouter, adapter, folder)
    student.planned_step = step
    if adapter is not None:
        AppliedLoRA(student.model, adapter, loaded.float_dtype)
    student.model.freeze()
    for module in student.lora_modules().values():
        module.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
    return student


# -- a training step that fits the plan -------------------------------------------------------------

# The teacher's tokens a position kept on disk where its whole distribution does not fit a step.
FALLBACK_TOP_K = 64


@dataclass(frozen=True)
class Step:
    """A training step as the streamed student's plan holds it: `rows` sequences of `length`
    tokens, the teacher's `kept_top_k` tokens a position read from disk (0: its whole
    distribution computed in the step). `fit_rows`: fewer rows may be taken where the plan does
    not hold `rows`; `fit_top_k`: the teacher's top `FALLBACK_TOP_K` may be kept where no
    number of rows fits with its whole distribution. `prompt`: the tokens of a row that are
    its prompt (for the refusal's --continuation-tokens); `top_k_option`: the phase takes
    --teacher-top-k (for the refusal)."""

    rows: int
    length: int
    kept_top_k: int = 0
    fit_rows: bool = False
    fit_top_k: bool = False
    prompt: int = 0
    top_k_option: bool = False

    def held(self, model_config: dict, k: int) -> int:
        return sum(step_bytes(model_config, self.rows, self.length, k, self.kept_top_k).values())


def load_for_step(
    model_dir: Path, config: EngineConfig, step: Step, k: int
) -> tuple[LoadedModel, Step]:
    """The streamed model loaded with a plan that holds `step`, or the largest step it may be
    lowered to that fits (each refusal comes before any weight is read); else an Edge0Error
    naming every knob that would make it fit."""
    model_config = read_config(model_dir)
    while True:
        planned = replace(config, held_bytes=step.held(model_config, k), context_tokens=step.length)
        try:
            return load(model_dir, planned), step
        except PlanRefused as refused:
            room = step_room(refused, config.expert_cache_auto)
            smaller = fitting_step(step, room, model_config, k)
            if smaller is None or smaller == step:
                why = step_refusal(refused, step, room, model_config, k, config)
                raise Edge0Error(f"{model_dir}: the memory plan {why}") from None
            step = smaller


def step_room(refused: PlanRefused, auto_cache: bool) -> int:
    """What a refused plan leaves for a training step: the limit less every other term, the
    expert cache at its smallest where it is automatic."""
    plan = refused.plan
    cache = refused.smallest_cache_bytes if auto_cache else plan.expert_cache_bytes
    others = plan.total_bytes - plan.held_bytes - plan.expert_cache_bytes + cache
    return (plan.limit_bytes or 0) - others


def fitting_step(step: Step, room: int, model_config: dict, k: int) -> Step | None:
    """The largest step `step` may be lowered to whose bytes fit `room`: the most rows (with
    the teacher's whole distribution, then with its top tokens kept); None where none fits."""
    rows = range(step.rows, 0, -1) if step.fit_rows else [step.rows]
    kept = [step.kept_top_k]
    if step.fit_top_k and not step.kept_top_k and FALLBACK_TOP_K < _vocab(model_config):
        kept.append(FALLBACK_TOP_K)
    for top_k in kept:
        for n in rows:
            candidate = replace(step, rows=n, kept_top_k=top_k)
            if candidate.held(model_config, k) <= room:
                return candidate
    return None


def step_refusal(
    refused: PlanRefused, step: Step, room: int, model_config: dict, k: int, config: EngineConfig
) -> str:
    """Why the plan refuses a training step (after "MODEL: the memory plan "), with every knob
    that would make it fit."""
    plan, smallest = refused.plan, refused.smallest_cache_bytes
    need = plan.total_bytes - plan.held_bytes + step.held(model_config, k)
    over = need - (plan.limit_bytes or 0)
    knobs = []
    if step.rows > 1 and (fit := fitting_step(replace(step, fit_rows=True), room, model_config, k)):
        knobs.append(f"--batch {fit.rows}")
    for rows in dict.fromkeys((step.rows, 1)):  # at the rows asked, else at one
        shorter = (
            replace(step, rows=rows, length=n) for n in range(step.length - 1, step.prompt, -1)
        )
        if fit := next((c for c in shorter if c.held(model_config, k) <= room), None):
            at = f" at --batch {rows}" if rows != step.rows else ""
            knobs.append(f"--continuation-tokens {fit.length - step.prompt + 1}{at}")
            break
    if step.top_k_option and not step.kept_top_k and FALLBACK_TOP_K < _vocab(model_config):
        kept = replace(step, kept_top_k=FALLBACK_TOP_K, fit_rows=True, fit_top_k=False)
        if fit := fitting_step(kept, room, model_config, k):
            at = f" at --batch {fit.rows}" if fit.rows != step.rows else ""
            knobs.append(f"--teacher-top-k {FALLBACK_TOP_K}{at}")
    if not config.expert_cache_auto and plan.expert_cache_bytes - over >= smallest:
        knobs.append(f"--expert-cache {format_bytes(plan.expert_cache_bytes - over)}")
    if smallest and over <= smallest - smallest // max(k, 1):
        knobs.append("a lower --k (the expert cache holds K experts a layer)")
    knobs.append(f"a machine with {format_bytes(max(over, 0))} more memory")
    return (
        f"needs {format_bytes(need)} for a step of {step.rows} rows of "
        f"{step.length} tokens but {format_bytes(plan.limit_bytes or 0)} is available "
        f"({plan.limit_source}); it would fit with {'; or '.join(knobs)} "
        "(`edge0 info MODEL --memory` shows every term)"
    )


def _vocab(model_config: dict) -> int:
    return int(model_config.get("text_config", model_config).get("vocab_size") or 0)


def _profile(model_dir: Path, k: int, search: ProfileSearch, needs_lora: bool) -> AdapterFiles:
    """The K profile's files, from the adapter search the load made (the engine's own)."""
    files = search.profiles.get(k)
    if files is None or files.prerouter is None:
        raise Edge0Error(
            f"{model_dir}: no prerouter heads for K={k} in any adapter folder; train them with "
            "`edge0 train heads`"
        )
    if needs_lora and files.lora is None:
        raise Edge0Error(
            f"{files.prerouter.parent}: no lora_k{k}.safetensors beside the K={k} heads; phase 3 "
            "starts from the phase-2 LoRA (`edge0 train lora`)"
        )
    return files


def dequantized_bytes(model_dir: Path, float_size: int) -> int:
    """Bytes of the checkpoint with every quantized weight dequantized to floats of `float_size`
    bytes (and every other floating tensor in that size): what the student path holds."""
    config = read_config(model_dir)
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    tensors = CheckpointIndex(model_dir).tensors
    total = 0
    for name, entry in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{module}.scales" in tensors:
            continue  # a quantized weight's own scales and biases: counted with the weight
        elements = math.prod(entry.shape)
        if name.endswith(".weight") and f"{module}.scales" in tensors:
            override = quantization.get(module)
            bits = (override if isinstance(override, dict) else quantization).get("bits", 4)
            elements = elements * 32 // max(int(bits), 1)  # packed in uint32 words
        elif entry.dtype not in ("BF16", "F16", "F32", "F64"):
            total += entry.nbytes
            continue
        total += elements * float_size
    return total


# Besides the weights: one batch's activations, the LoRA with its gradients and AdamW state.
STUDENT_MARGIN_BYTES = 512 << 20


def float_size(engine_config: EngineConfig) -> int:
    """Bytes of one float the student computes in: float32 on CPU, else the checkpoint's (2)."""
    dtype = compute_dtype(engine_config)
    return dtype.size if dtype is not None else 2


def student_bytes(model_dir: Path, engine_config: EngineConfig, extra_bytes: int = 0) -> int:
    """What the in-memory student needs: the model dequantized, `extra_bytes`, and a margin."""
    size = float_size(engine_config)
    return dequantized_bytes(model_dir, size) + extra_bytes + STUDENT_MARGIN_BYTES


def check_student_fits(model_dir: Path, engine_config: EngineConfig, extra_bytes: int = 0) -> None:
    """Refuse, before loading anything, an in-memory student that cannot fit: it holds the
    whole model dequantized (backward needs every expert a batch touched, and a batch touches
    nearly all of them), so it needs the model's float size in memory."""
    size = float_size(engine_config)
    need = student_bytes(model_dir, engine_config, extra_bytes)
    available = available_memory_bytes()
    if available is not None and need > available:
        raise Edge0Error(
            f"{model_dir}: training the LoRA needs about {format_bytes(need)} of memory (the "
            f"model dequantized to {8 * size}-bit floats for backward"
            + (f", the float teacher {format_bytes(extra_bytes)}" if extra_bytes else "")
            + f", and a margin), but {format_bytes(available)} is available; phase 1 "
            "(`edge0 train heads`) streams and needs far less"
        )


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

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

Also here, shared by phases 2 and 3 and `edge0 eval`: the teacher (the unquantized float model),
batched sampling, prompts drawn from a corpus, and the resumable training state.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load_model as mlx_lm_load_model
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..adapters.lora import AppliedLoRA, LoRAAdapter, LoRALinear, linear_dims, load_lora, save_lora
from ..adapters.profiles import discover_profiles
from ..checkpoint.index import base_fingerprint
from ..config import EngineConfig, GenerationConfig
from ..errors import Edge0Error
from ..routing.functions import route
from ..routing.moe_block import RoutedMoE, ops_for
from ..routing.prerouter import PrerouterHeads, head_forward, load_profile_heads
from ..runtime.generation import Engine
from ..runtime.loader import LoadedModel, load, read_config

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
        experts = mx.arange(self.routing_spec.num_experts)
        now = (inds[..., None] == experts).any(axis=-2).astype(heads.fc1.dtype)  # multi-hot
        before = mx.concatenate([mx.zeros_like(now[:, :1]), now[:, :-1]], axis=1)
        z = mx.concatenate([x.astype(heads.fc1.dtype), now, before], axis=-1)
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
    return load_profile_heads(
        files.prerouter,
        loaded.num_layers,
        loaded.hidden,
        loaded.num_experts,
        fingerprint,
        k,
        {site.layer for site in loaded.sites},
        loaded.float_dtype or mx.float32,
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


# -- the teacher -------------------------------------------------------------------------------------


def load_teacher(teacher_dir: str | Path, student: Student) -> nn.Module:
    """The unquantized float model (mlx-lm format) the base was quantized from, frozen, computing in
    the student's float dtype. Refuses a quantized teacher and one with another vocabulary."""
    teacher_dir = Path(teacher_dir)
    config = read_config(teacher_dir)
    if "quantization" in config or "quantization_config" in config:
        raise Edge0Error(
            f"{teacher_dir}: the teacher is quantized; it must be the unquantized (bf16/fp32) model"
        )
    student_config = student.loaded.config
    for key in ("model_type", "vocab_size"):
        theirs, ours = _text_config_value(config, key), _text_config_value(student_config, key)
        if theirs != ours:
            raise Edge0Error(
                f"{teacher_dir}: teacher {key}={theirs!r} but the base model has {ours!r} "
                "(the teacher must be the same architecture and vocabulary)"
            )
    try:
        model, _ = mlx_lm_load_model(teacher_dir, lazy=True, strict=True)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise Edge0Error(f"{teacher_dir}: cannot load the teacher ({e})") from None
    if student.loaded.float_dtype is not None:
        model.set_dtype(student.loaded.float_dtype)
    model.freeze()
    mx.eval(model.parameters())
    return model


def _text_config_value(config: dict, key: str):
    return config.get("text_config", {}).get(key, config.get(key))


# -- sampling and data ---------------------------------------------------------------------------------


def sample(
    model: nn.Module,
    prompts: np.ndarray,
    max_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """Continuations [B, max_tokens] of equal-length prompts [B, P], sampled in one batch with
    mlx-lm's KV caches (fixed length; cut them at EOS with `continuation_mask`)."""
    mx.random.seed(seed)
    sampler = make_sampler(temperature, top_p=top_p)
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    out = []
    for _ in range(max_tokens):
        token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        out.append(token)
        logits = model(token[:, None], cache=cache)[:, -1, :]
        mx.async_eval(logits)
    return np.array(mx.stack(out, axis=1))


def sample_served(
    engine: Engine,
    prompts: np.ndarray,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> list[list[int]]:
    """One continuation per prompt from the engine, the served model (prompt i samples with seed
    seed + i); a continuation ends early at EOS."""
    continuations = []
    for i, prompt in enumerate(prompts):
        gen = GenerationConfig(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + i
        )
        continuations.append(engine.generate(prompt.tolist(), gen).tokens)
    return continuations


def continuation_mask(continuations: np.ndarray, eos_ids) -> np.ndarray:
    """[B, C] bool: each continuation up to and including its first end-of-sequence token."""
    eos = np.isin(continuations, list(eos_ids))
    after = np.cumsum(eos, axis=1) - eos  # EOS tokens strictly before this position
    return after == 0


def corpus_tokens(tokenizer, text: str, max_tokens: int) -> np.ndarray:
    """The first `max_tokens` tokens of `text` (a token is rarely longer than 16 characters)."""
    return np.array(tokenizer.encode(text[: 16 * max_tokens])[:max_tokens], dtype=np.int64)


def draw_prompts(tokens: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """`n` prompts [n, length]: windows of the corpus at random offsets."""
    if len(tokens) < length + 1:
        raise Edge0Error(f"the text is too short: {len(tokens)} tokens for prompts of {length}")
    starts = rng.integers(0, len(tokens) - length, size=n)
    return np.stack([tokens[s : s + length] for s in starts])


def masked_mean(values: mx.array, mask: mx.array) -> mx.array:
    mask = mask.astype(values.dtype)
    return (values * mask).sum() / mx.maximum(mask.sum(), 1.0)


# -- resumable training state --------------------------------------------------------------------------


def training_progress(enabled: bool) -> Progress:
    """The rich progress bar the training loops show (on stderr when it is a terminal)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


class TrainingRun:
    """What phases 2 and 3 share around their loops: AdamW on the LoRA (clipped gradients), the
    log, a held-out measure at step 0 and at every checkpoint, and the checkpoint in `out_dir`
    (LoRA, optimizer state, log) that a rerun with the same settings resumes from."""

    def __init__(self, out_dir: Path, student: Student, config, loss_fn, heldout, log: Log):
        self.out_dir, self.student, self.config, self.heldout, self.log = (
            out_dir,
            student,
            config,
            heldout,
            log,
        )
        self.loss_and_grad = nn.value_and_grad(student.model, loss_fn)
        self.optimizer = optim.AdamW(learning_rate=config.lr, weight_decay=config.weight_decay)
        self.state = self._resume()
        if self.state is None:
            self.state = {"config": asdict(config), "fingerprint": student.fingerprint, "step": 0}
            self.state["log"] = [{"step": 0, "heldout": round(heldout(), 6)}]
            log(f"held-out loss before training {self.state['log'][0]['heldout']:.5f}")
        else:
            log(f"resuming {out_dir} at step {self.state['step']}")

    @property
    def done(self) -> int:
        """Steps already taken (0, or where the checkpoint stopped)."""
        return self.state["step"]

    @property
    def history(self) -> list[dict]:
        return self.state["log"]

    def step(self, step: int, *batch) -> float:
        """One optimizer step on `batch` (the loss function's arguments); returns the loss."""
        config = self.config
        loss, grads = self.loss_and_grad(*batch)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        self.optimizer.update(self.student.model, grads)
        mx.eval(self.student.model.trainable_parameters(), self.optimizer.state, loss)
        entry = {"step": step, "loss": round(loss.item(), 6)}
        self.history.append(entry)
        self.state["step"] = step
        if step % config.checkpoint_every == 0 or step == config.steps:
            entry["heldout"] = round(self.heldout(), 6)
            self._save()
        if step % config.log_every == 0 or "heldout" in entry:
            held = f"  held-out {entry['heldout']:.5f}" if "heldout" in entry else ""
            self.log(f"step {step}/{config.steps}  loss {entry['loss']:.5f}{held}")
        return entry["loss"]

    def _save(self) -> None:
        """LoRA and optimizer state, and the state (config, log), written atomically."""
        model, out_dir = self.student.model, self.out_dir
        tensors = {f"lora.{n}": v for n, v in tree_flatten(model.trainable_parameters())}
        tensors.update({f"optimizer.{n}": v for n, v in tree_flatten(self.optimizer.state)})
        out_dir.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out_dir / "checkpoint.tmp.safetensors"), tensors)
        os.replace(out_dir / "checkpoint.tmp.safetensors", out_dir / "checkpoint.safetensors")
        (out_dir / "checkpoint.tmp.json").write_text(json.dumps(self.state, indent=1))
        os.replace(out_dir / "checkpoint.tmp.json", out_dir / "checkpoint.json")

    def _resume(self) -> dict | None:
        """Load the checkpoint in the out dir into the student and the optimizer; None when there
        is none. A run with other settings (except `steps`) or another base is refused."""
        meta_path = self.out_dir / "checkpoint.json"
        tensors_path = self.out_dir / "checkpoint.safetensors"
        if not (meta_path.exists() and tensors_path.exists()):
            return None
        state = json.loads(meta_path.read_text())
        ours = {k: v for k, v in asdict(self.config).items() if k != "steps"}
        theirs = {k: v for k, v in state.get("config", {}).items() if k != "steps"}
        if ours != theirs or state.get("fingerprint") != self.student.fingerprint:
            raise Edge0Error(
                f"{self.out_dir} holds a run with other settings or another base model; "
                "choose another --out-dir or delete it"
            )
        state["config"] = asdict(self.config)  # a new `steps` is the run's new length
        tensors = mx.load(str(tensors_path))
        model, optimizer = self.student.model, self.optimizer
        model.load_weights(
            [(n[5:], v) for n, v in tensors.items() if n.startswith("lora.")], strict=False
        )
        optimizer.init(model.trainable_parameters())
        current = dict(tree_flatten(optimizer.state))
        current.update({n[10:]: v for n, v in tensors.items() if n.startswith("optimizer.")})
        optimizer.state = tree_unflatten(list(current.items()))
        return state


Log = Callable[[str], None]

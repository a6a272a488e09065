"""Phase 3: on-policy distillation of the recovery LoRA (reverse KL on the student's own text).

    edge0 train distill MODEL --k K --text FILE [--teacher DIR] [--steps N] [--out-dir DIR]

Starts from the phase-2 LoRA (`lora_k{K}.safetensors` beside the K profile's heads; the paper's
order, heads -> SFT -> on-policy, is not a tunable: distillation-only adapters collapse). Each
step:

1. Roll out: the engine in prerouter mode (4-bit base, the K-profile's heads, the current LoRA)
   samples continuations of prompts drawn from the corpus: exactly what serving would write.
2. Score: the teacher (the unquantized float model, or the checkpoint itself) reads the same
   sequences.
3. Loss: reverse KL(student || teacher) at every generated position, restricted to the teacher's
   top-k tokens with the rest of the vocabulary as one tail bucket on both sides (the tail's mass is
   kept, not dropped), averaged over generated positions. The student's side is the student path
   with the prompt routed by the gate, as the engine prefilled it, so its logits are the ones the
   rollout sampled from. Only the LoRA is trained; the engine serves the updated LoRA next step.
4. Checkpoint every `checkpoint_every` steps (resumable, as phase 2), with the KL on a fixed set of
   held-out rollouts of the starting LoRA (the training loss is on fresh rollouts every step, so it
   is noisy; the held-out KL is the curve to read). Write the updated LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapters.lora import LoRALinear
from ..config import EngineConfig
from ..errors import Edge0Error
from ..runtime.generation import Engine
from ..runtime.metrics import peak_memory_line
from .data import corpus_tokens, draw_prompts, masked_mean, sample_served
from .lora import teacher_bytes
from .run import (
    Log,
    RunLock,
    TrainingRun,
    check_outputs,
    check_token_rows,
    read_cache,
    training_progress,
)
from .student import PROFILE_LORA, Step, Student, load_student
from .teacher import load_teacher


@dataclass
class TrainDistillConfig:
    k: int
    steps: int = 40
    prompts_per_step: int = 16  # rollouts per step
    prompt_tokens: int = 32
    gen_tokens: int = 64
    temperature: float = 1.0  # sampling the student: on-policy means its own distribution
    top_p: float = 1.0
    kl_top_k: int = 32  # teacher tokens the KL is taken over (16-64); the rest is one bucket
    heldout_prompts: int = 8  # fixed rollouts of the starting LoRA, scored at every checkpoint
    max_corpus_tokens: int = 200_000
    lr: float = 5e-5  # the demo at K=4: 2e-4 with 8 rollouts/step raised the held-out KL
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    log_every: int = 5
    checkpoint_every: int = 25
    expert_cache_bytes: int = 1 << 30  # the rollout engine's routed-expert budget
    seed: int = 0


def topk_reverse_kl(student_logits: mx.array, teacher_logits: mx.array, k: int) -> mx.array:
    """KL(student || teacher) per position [...], over the teacher's top-k tokens plus one bucket
    holding the rest of the vocabulary on each side. Exact when k covers the vocabulary's mass."""
    if not 1 <= k < teacher_logits.shape[-1]:
        raise Edge0Error(f"kl_top_k={k} must be between 1 and the vocabulary size - 1")
    teacher = nn.log_softmax(teacher_logits.astype(mx.float32), axis=-1)
    student = nn.log_softmax(student_logits.astype(mx.float32), axis=-1)
    top = mx.argpartition(-teacher, kth=k - 1, axis=-1)[..., :k]

    def split(logp: mx.array) -> tuple[mx.array, mx.array]:
        """Log-probabilities of the top-k tokens [..., k] and of the tail bucket [..., 1]."""
        rest = mx.put_along_axis(logp, top, mx.array(-mx.inf, logp.dtype), axis=-1)
        return mx.take_along_axis(logp, top, axis=-1), mx.logsumexp(rest, axis=-1, keepdims=True)

    s_top, s_tail = split(student)
    t_top, t_tail = split(teacher)
    s = mx.concatenate([s_top, s_tail], axis=-1)
    t = mx.concatenate([t_top, t_tail], axis=-1)
    return (mx.exp(s) * (s - t)).sum(axis=-1)


def train_distill(
    model_dir: str | Path,
    teacher_dir: str | Path | None,
    text: str,
    config: TrainDistillConfig,
    out: Path | None = None,
    out_dir: Path | None = None,
    log: Log = print,
    bar: bool = False,
    engine_config: EngineConfig | None = None,
    streamed: bool | None = None,
) -> tuple[Path, list[dict]]:
    """Distill the K=config.k LoRA on-policy; write it; return (path, log of {step, loss}).
    `teacher_dir` None: the checkpoint itself teaches. The K profile (heads and phase-2 LoRA) is
    found over `engine_config`'s adapter search, and the result written beside it unless `out`."""
    model_dir = Path(model_dir)
    engine_config = engine_config or EngineConfig()
    if config.prompt_tokens < 2:
        raise Edge0Error("prompts need at least 2 tokens")
    # Phase 3 starts from the phase-2 LoRA of the K profile (beside its heads).
    student = load_student(
        model_dir,
        config.k,
        True,
        PROFILE_LORA,
        engine_config,
        teacher_bytes(teacher_dir, engine_config),
        streamed,
        step=Step(
            config.prompts_per_step,
            config.prompt_tokens + config.gen_tokens - 1,
            prompt=config.prompt_tokens,
        ),
    )
    lora_path = student.lora.path
    log(student.describe(config.prompts_per_step, config.prompt_tokens + config.gen_tokens - 1))
    out_dir = Path(out_dir or student.adapter_folder / "train" / f"distill_k{config.k}")
    out = Path(out or lora_path)
    check_outputs(out, out_dir)  # before the rollouts and the steps, not after them
    # One run a folder: two would write its state and the adapter in turns.
    with RunLock(out_dir, f"edge0 train distill K={config.k}"):
        return _train(
            student, model_dir, teacher_dir, text, config, out, out_dir, log, bar, engine_config
        )


def _train(
    student: Student,
    model_dir: Path,
    teacher_dir: str | Path | None,
    text: str,
    config: TrainDistillConfig,
    out: Path,
    out_dir: Path,
    log: Log,
    bar: bool,
    engine_config: EngineConfig,
) -> tuple[Path, list[dict]]:
    """`train_distill` once its student is loaded and its outputs are checked (and locked)."""
    teacher = load_teacher(teacher_dir, student)
    corpus = corpus_tokens(student.tokenizer, text, config.max_corpus_tokens)
    p = config.prompt_tokens

    def loss_fn(inputs, teacher_logits, weights):
        logits = student(inputs, gate_prefix=p - 1)  # the engine prefilled prompt[:-1] by the gate
        return masked_mean(topk_reverse_kl(logits, teacher_logits, config.kl_top_k), weights)

    engine = rollout_engine(model_dir, config, engine_config)
    try:
        heldout = heldout_rollouts(out_dir, engine, teacher, corpus, config)
        run = TrainingRun(out_dir, student, config, loss_fn, lambda: loss_fn(*heldout).item(), log)
        with training_progress(bar) as progress:
            task = progress.add_task("on-policy", total=config.steps, completed=run.done, status="")
            for step in range(run.done + 1, config.steps + 1):
                serve_lora(engine, student)
                # The prompts and the sampling seed are functions of the step (resumable).
                rng = np.random.default_rng([config.seed, step])
                prompts = draw_prompts(corpus, config.prompts_per_step, p, rng)
                inputs, weights = rollouts(engine, prompts, config, int(rng.integers(0, 2**31)))
                loss = run.step(step, inputs, teacher(inputs), weights)
                progress.update(task, advance=1, status=f"reverse KL {loss:.4f}")
    finally:
        engine.close()

    student.save_lora(out)
    log(f"wrote {out}")
    log(peak_memory_line())  # what the run needed at most: a RAM limit must leave room for it
    return out, run.history


def rollout_engine(
    model_dir: Path, config: TrainDistillConfig, engine_config: EngineConfig | None = None
) -> Engine:
    """The served model the rollouts come from (4-bit base, heads, the LoRA as trained so far).
    It carries no KV cache from one rollout to the next: one computed with last step's LoRA would
    be stale."""
    return Engine(
        model_dir,
        replace(
            engine_config or EngineConfig(),
            mode="prerouter",
            k=config.k,
            expert_cache_bytes=config.expert_cache_bytes,
            reuse_prompt_cache=False,
        ),
    )


def serve_lora(engine: Engine, student: Student) -> None:
    """Point the engine's LoRA deltas at the student's current weights (same module paths)."""
    served = {p: m for p, m in engine.model.named_modules() if isinstance(m, LoRALinear)}
    for path, module in student.lora_modules().items():
        if path not in served:
            raise Edge0Error(f"the engine serves no LoRA on {path}")
        served[path].lora_a, served[path].lora_b = module.lora_a, module.lora_b


def heldout_rollouts(
    out_dir: Path, engine: Engine, teacher: nn.Module, corpus: np.ndarray, config
) -> tuple[mx.array, mx.array, mx.array]:
    """(inputs, teacher logits, weights) of fixed held-out rollouts: read from the out dir, or
    sampled now from the served model (the starting LoRA) and saved there."""
    path = out_dir / "heldout_rollouts.npz"
    settings = [config.heldout_prompts, config.prompt_tokens, config.gen_tokens, config.seed]
    saved = read_cache(path, "held-out rollouts cache", ("settings", "inputs", "weights"))
    if saved is not None and saved["settings"].tolist() == settings:
        width = config.prompt_tokens + config.gen_tokens - 1
        rows = check_token_rows(path, "held-out rollouts cache", saved["inputs"], "inputs", width)
        weights = saved["weights"]
        if weights.shape != rows.shape or not np.issubdtype(weights.dtype, np.floating):
            raise Edge0Error(
                f"{path}: not a held-out rollouts cache (weights {list(weights.shape)})"
            )
        inputs, weights = mx.array(rows.astype(np.int64)), mx.array(weights)
    else:
        rng = np.random.default_rng([config.seed, 0])  # step 0: no training step draws these
        prompts = draw_prompts(corpus, config.heldout_prompts, config.prompt_tokens, rng)
        inputs, weights = rollouts(engine, prompts, config, int(rng.integers(0, 2**31)))
        out_dir.mkdir(parents=True, exist_ok=True)
        np.savez(path, inputs=np.array(inputs), weights=np.array(weights), settings=settings)
    return inputs, teacher(inputs), weights


def rollouts(
    engine: Engine, prompts: np.ndarray, config: TrainDistillConfig, seed: int
) -> tuple[mx.array, mx.array]:
    """Sample one continuation per prompt with the engine. Returns the teacher-forcing inputs
    [B, P+C-1] (zero-padded after an early EOS) and the weights [B, P+C-1] of the positions whose
    next token was generated."""
    b, p = prompts.shape
    tokens = np.zeros((b, p + config.gen_tokens), dtype=np.int64)
    weights = np.zeros((b, p + config.gen_tokens - 1), dtype=np.float32)
    served = sample_served(
        engine, prompts, config.gen_tokens, config.temperature, config.top_p, seed
    )
    for i, (prompt, generated) in enumerate(zip(prompts, served)):
        tokens[i, :p] = prompt
        tokens[i, p : p + len(generated)] = generated
        weights[i, p - 1 : p - 1 + len(generated)] = 1.0
    return mx.array(tokens[:, :-1]), mx.array(weights)

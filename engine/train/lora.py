"""Phase 2: SFT of the recovery LoRA on the student path, on teacher-written text.

    edge0 train lora MODEL --k K --text FILE [--teacher DIR] [--generate N] [--steps N] [--out-dir DIR]

1. Data: prompts are windows of the corpus text; the teacher (the unquantized float model) writes a
   continuation of each. The rows do not depend on K: they are cached in `teacher_rows.npz` (by
   default in `MODEL/train/`, shared by every K profile's run) and reused, also by a run that asks
   for more rows (it generates only the missing ones).
2. Train on the continuation tokens through the student path (`student.py`): the dequantized 4-bit
   base, frozen, routing every layer after the first consumer by the K-profile's heads, exactly as
   decode does (the prompt is routed by the gate, as the engine prefills it). Only the LoRA (r=16,
   alpha=32; B starts at zero, so step 0 is the base) is trained, with AdamW.
   The target at each position is the teacher's whole next-token distribution on that text
   (`targets="teacher"`, loss KL(teacher || student)), or only the token it sampled
   (`targets="tokens"`, plain cross-entropy). On the demo model at K=4 (1,600 rows, 200 steps, lr
   1e-3) the sampled tokens made real held-out perplexity worse, 196.5 -> 201.8: one noisy token per
   position, sampled with top-p, teaches a sharper distribution than the teacher's. The teacher's
   distribution on the same rows took it to 184.5. This phase is what makes routing by prediction
   usable (the paper's heads-only checkpoints collapse into repetition; on the demo it wins back
   about half of the perplexity that prediction costs).
3. Every `checkpoint_every` steps the LoRA and the optimizer state go to the out dir; a rerun with
   the same settings resumes there (each step's batch is a function of the seed and the step, so a
   resumed run trains on the same batches as one that never stopped).
4. Write `MODEL/lora_k{K}.safetensors` for the engine, stamped with the base's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..checkpoint.index import checkpoint_shards
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..runtime.metrics import peak_memory_line
from .data import continuation_mask, corpus_tokens, draw_prompts, masked_mean, sample
from .run import (
    Log,
    ProgressLines,
    RunLock,
    TrainingRun,
    check_outputs,
    check_token_rows,
    read_cache,
    training_progress,
)
from .student import LoRAInit, Step, Student, dequantized_bytes, float_size, load_student
from .teacher import CheckpointTeacher, load_teacher
from .teacher_targets import teacher_targets, topk_forward_kl


@dataclass
class TrainLoRAConfig:
    k: int
    # data: teacher continuations of prompts drawn from the corpus
    rows: int = 1600  # continuations the teacher writes (`--generate`)
    prompt_tokens: int = 32
    gen_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 0.95
    gen_batch: int = 64  # continuations sampled together
    max_corpus_tokens: int = 200_000
    holdout_rows: int = 16  # kept out of training for the held-out loss
    # "sampled": the teacher writes each prompt's continuation (the default); "text": the
    # corpus's own next tokens, on which the teacher's distribution is the target as well
    # (no sampling; what held-out perplexity on text measures).
    continuations: str = "sampled"
    targets: str = "teacher"  # "teacher": its distribution at each position; "tokens": its samples
    # 0: the teacher's whole distribution, computed again at every step (the default); K: its K
    # likeliest tokens per position, computed once and kept on disk (`teacher_targets.py`): a
    # teacher forward less per step, for a loss that is exact only where K holds its mass.
    teacher_top_k: int = 0
    # adapter
    r: int = 16
    alpha: float = 32.0
    # optimization
    steps: int = 300
    batch: int = 8  # rows per step (the most, where `fit_batch`)
    # Where the streamed student's memory plan does not hold `batch` rows a step: take the most
    # that fit (else refuse), and where none fits with the teacher's whole distribution, keep
    # its top tokens on disk (`teacher_top_k`) if `fit_teacher_top_k`. The CLI's --batch and
    # --teacher-top-k turn them off: what a user asks for is refused, not changed.
    fit_batch: bool = True
    fit_teacher_top_k: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    log_every: int = 10
    checkpoint_every: int = 50
    seed: int = 0


def train_lora(
    model_dir: str | Path,
    teacher_dir: str | Path | None,
    text: str,
    config: TrainLoRAConfig,
    out: Path | None = None,
    out_dir: Path | None = None,
    log: Log = print,
    bar: bool = False,
    rows_path: Path | None = None,
    engine_config: EngineConfig | None = None,
    streamed: bool | None = None,
) -> tuple[Path, list[dict]]:
    """Train the LoRA for K=config.k; write it; return (path, log of {step, loss[, heldout]}).
    The student is streamed where the dequantized base does not fit (`streamed` None), or as
    `streamed` says.
    `teacher_dir` None: the checkpoint itself teaches (`teacher.CheckpointTeacher`). Written
    beside the K profile's heads (found over `engine_config`'s adapter search) unless `out`."""
    model_dir = Path(model_dir)
    if config.prompt_tokens < 2 or config.holdout_rows >= config.rows:
        raise Edge0Error("need prompts of at least 2 tokens and more rows than held-out rows")
    if config.targets not in ("teacher", "tokens"):
        raise Edge0Error(f"targets={config.targets!r}: must be 'teacher' or 'tokens'")
    if config.continuations not in ("sampled", "text"):
        raise Edge0Error(f"continuations={config.continuations!r}: must be 'sampled' or 'text'")
    lora = LoRAInit(config.r, config.alpha, config.seed)
    length = config.prompt_tokens + config.gen_tokens - 1
    whole = config.targets == "teacher" and not config.teacher_top_k
    step = Step(
        config.batch,
        length,
        config.teacher_top_k if config.targets == "teacher" else 0,
        fit_rows=config.fit_batch,
        fit_top_k=config.fit_teacher_top_k and whole,
        prompt=config.prompt_tokens,
        top_k_option=True,
    )
    student = load_student(
        model_dir,
        config.k,
        True,
        lora,
        engine_config,
        teacher_bytes(teacher_dir, engine_config),
        streamed,
        step=step,
    )
    config = fitted(config, step, student, log)
    log(student.describe(config.batch, length))
    if student.streamed and config.gen_batch > config.batch:
        # The plan holds a training step's rows, not more: a batch of 64 rows sampled at once
        # (its prompt's logits and whole-layer activations) is what overran it in a cgroup.
        config = replace(config, gen_batch=config.batch)
        log(f"teacher rows are sampled {config.batch} at a time (a step's rows: the plan's)")
    folder = student.adapter_folder
    out_dir = Path(out_dir or folder / "train" / f"lora_k{config.k}")
    out = Path(out or folder / f"lora_k{config.k}.safetensors")
    check_outputs(out, out_dir)  # before the teacher rows and the steps, not after them
    rows_path = Path(rows_path or folder / "train" / "teacher_rows.npz")
    # One run a folder: two would write its state and the adapter in turns.
    with RunLock(out_dir, f"edge0 train lora K={config.k}"):
        return _train(
            student, model_dir, teacher_dir, text, config, out, out_dir, rows_path, log, bar
        )


def _train(
    student: Student,
    model_dir: Path,
    teacher_dir: str | Path | None,
    text: str,
    config: TrainLoRAConfig,
    out: Path,
    out_dir: Path,
    rows_path: Path,
    log: Log,
    bar: bool,
) -> tuple[Path, list[dict]]:
    """`train_lora` once its student is loaded and its outputs are checked (and locked)."""
    teacher = load_teacher(teacher_dir, student)
    log(f"teacher: {teacher_dir or 'the checkpoint itself (its own routers, native K, no LoRA)'}")

    # -- 1. data -----------------------------------------------------------------------------------
    corpus = corpus_tokens(student.tokenizer, text, config.max_corpus_tokens)
    if config.continuations == "text":
        prompts, continuations = text_rows(corpus, config)
        log(
            f"{config.rows} rows of the text itself ({config.prompt_tokens} + {config.gen_tokens} tokens)"
        )
    else:
        prompts, continuations = teacher_rows(
            student, teacher_dir or model_dir, corpus, config, rows_path, log, bar, teacher
        )
    p = config.prompt_tokens
    tokens = np.concatenate([prompts, continuations], axis=1)
    inputs, targets = mx.array(tokens[:, :-1]), mx.array(tokens[:, 1:])
    # Position j predicts token j+1: the continuation's tokens are the targets of positions >= p-1.
    weights = np.zeros(targets.shape, dtype=np.float32)
    weights[:, p - 1 :] = continuation_mask(continuations, student.tokenizer.eos_token_ids)
    weights = mx.array(weights)
    held = config.holdout_rows
    train_rows = np.arange(held, len(tokens))
    gate_prefix = p - 1  # the engine prefills prompt[:-1] with the gate
    kept = None  # the teacher's top-k targets on disk
    if config.targets == "teacher" and config.teacher_top_k:
        text_config = student.loaded.config.get("text_config", student.loaded.config)
        # The logits' width: every mlx-lm model sizes its embedding and head by it.
        vocab = int(text_config.get("vocab_size") or 0)
        if not 1 <= config.teacher_top_k < vocab:
            raise Edge0Error(
                f"teacher_top_k={config.teacher_top_k} must be between 1 and the vocabulary size"
            )
        key = {
            "rows": hashlib.sha256(tokens.tobytes()).hexdigest()[:16],
            "teacher": _teacher_digest(Path(teacher_dir or model_dir), teacher_dir is None),
        }
        folder = rows_path.with_name(rows_path.stem + ".targets")
        kept = teacher_targets(
            teacher, tokens[:, :-1], p - 1, config.teacher_top_k, folder, key, config.batch,
            vocab, log, bar,
        )  # fmt: skip

    # -- 2. train ----------------------------------------------------------------------------------
    def loss_fn(x, w, *target):
        """`target`: the sampled tokens, the teacher's kept top-k targets, or its logits (all
        computed outside, so that the student's forward is all the gradient runs through)."""
        logits = student(x, gate_prefix)
        if config.targets == "tokens":
            return masked_mean(nn.losses.cross_entropy(logits, target[0]), w)
        if kept is not None:  # the continuation's positions only: the targets kept
            return masked_mean(topk_forward_kl(logits[:, p - 1 :], *target), w[:, p - 1 :])
        return masked_mean(forward_kl(target[0], logits), w)

    def batch(rows: np.ndarray) -> tuple[mx.array, ...]:
        x, w = inputs[mx.array(rows)], weights[mx.array(rows)]
        if config.targets == "tokens":
            return x, w, targets[mx.array(rows)]
        if kept is not None:
            return x, w, *kept.batch(rows)
        return x, w, teacher(x)

    def heldout_loss() -> float:
        """The held-out rows' loss, `config.batch` rows at a time: no larger than a step."""
        total = count = 0.0
        for first in range(0, held, config.batch):
            rows = np.arange(first, min(first + config.batch, held))
            part = weights[mx.array(rows)].sum().item()
            total += loss_fn(*batch(rows)).item() * max(part, 1.0)
            count += max(part, 1.0)
        return total / count

    run = TrainingRun(out_dir, student, config, loss_fn, heldout_loss, log)
    with training_progress(bar) as progress:
        task = progress.add_task("SFT", total=config.steps, completed=run.done, status="")
        for step in range(run.done + 1, config.steps + 1):
            # The batch is a function of the seed and the step: a resumed run sees the same data.
            rng = np.random.default_rng([config.seed, step])
            size = min(config.batch, len(train_rows))
            rows = rng.choice(train_rows, size=size, replace=False)
            loss = run.step(step, *batch(rows))
            progress.update(task, advance=1, status=f"loss {loss:.4f}")

    # -- 3. save -----------------------------------------------------------------------------------
    student.save_lora(out)
    log(f"wrote {out}")
    log(peak_memory_line())  # what the run needed at most: a RAM limit must leave room for it
    return out, run.history


def fitted(config: TrainLoRAConfig, asked: Step, student: Student, log: Log) -> TrainLoRAConfig:
    """`config` with the step the memory plan holds (`load_for_step`), and a line for what
    it changed."""
    step = student.planned_step
    if step is None or step == asked:
        return config
    plan = student.loaded.memory_plan
    of = f" of {format_bytes(plan.limit_bytes)}" if plan.limit_bytes is not None else ""
    if step.rows != asked.rows:
        log(
            f"batch {step.rows}: the most rows a step (of {asked.rows}) that the memory plan "
            f"holds ({format_bytes(plan.total_bytes)}{of}); --batch sets it"
        )
    if step.kept_top_k != asked.kept_top_k:
        log(
            f"teacher targets: its top {step.kept_top_k} tokens a position, kept on disk: its "
            "whole distribution does not fit the memory plan at 1 row a step; "
            "--teacher-top-k sets it"
        )
    return replace(config, batch=step.rows, teacher_top_k=step.kept_top_k)


def forward_kl(teacher_logits: mx.array, student_logits: mx.array) -> mx.array:
    """KL(teacher || student) per position [...]: the cross-entropy against the teacher's whole
    distribution, less the teacher's entropy (so a perfect student scores 0)."""
    teacher = nn.log_softmax(teacher_logits.astype(mx.float32), axis=-1)
    student = nn.log_softmax(student_logits.astype(mx.float32), axis=-1)
    return (mx.exp(teacher) * (teacher - student)).sum(axis=-1)


def text_rows(corpus: np.ndarray, config: TrainLoRAConfig) -> tuple[np.ndarray, np.ndarray]:
    """`config.rows` windows of the corpus as (prompt [P], its own continuation [C]) pairs, at
    offsets that are a function of the seed."""
    rng = np.random.default_rng([config.seed, 2])
    windows = draw_prompts(corpus, config.rows, config.prompt_tokens + config.gen_tokens, rng)
    windows = windows.astype(np.int32)
    return windows[:, : config.prompt_tokens], windows[:, config.prompt_tokens :]


def teacher_rows(
    student: Student,
    teacher_dir: str | Path,
    corpus: np.ndarray,
    config: TrainLoRAConfig,
    path: Path,
    log: Log = print,
    bar: bool = False,
    teacher: nn.Module | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`config.rows` (prompt [P], teacher continuation [C]) pairs, from the cache at `path` when it
    was written with these settings; the missing ones are generated (by `teacher`, or the model
    loaded from `teacher_dir`) and added to it."""
    settings = {
        "teacher": _teacher_digest(Path(teacher_dir), isinstance(teacher, CheckpointTeacher)),
        "corpus": hashlib.sha256(corpus.tobytes()).hexdigest()[:16],
        **{
            k: getattr(config, k)
            for k in ("prompt_tokens", "gen_tokens", "temperature", "top_p", "gen_batch", "seed")
        },
    }
    prompts = np.zeros((0, config.prompt_tokens), dtype=np.int32)
    continuations = np.zeros((0, config.gen_tokens), dtype=np.int32)
    what = "teacher rows cache"
    cached = read_cache(path, what, ("settings", "prompts", "continuations"))
    if cached is not None:
        try:
            saved = json.loads(str(cached["settings"]))
        except ValueError:
            saved = None
        if saved == settings:
            prompts = check_token_rows(
                path, what, cached["prompts"], "prompts", config.prompt_tokens
            )
            continuations = check_token_rows(
                path, what, cached["continuations"], "continuations", config.gen_tokens
            )
            if len(prompts) != len(continuations):
                raise Edge0Error(
                    f"{path}: not a {what} ({len(prompts)} prompts but {len(continuations)} "
                    "continuations); delete it to start over, or name another file"
                )
        else:
            log(f"{path}: written with other settings; generating again")
    if len(prompts) >= config.rows:
        return prompts[: config.rows], continuations[: config.rows]

    if teacher is None:
        teacher = load_teacher(teacher_dir, student)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ProgressLines(log, "teacher rows", "rows", config.rows, len(prompts))
    with training_progress(bar) as progress:
        task = progress.add_task(
            "teacher rows", total=config.rows, completed=len(prompts), status=""
        )
        while len(prompts) < config.rows:
            # Batch b is a function of the seed and b: a resumed generation writes the same rows.
            b = len(prompts) // config.gen_batch
            rng = np.random.default_rng([config.seed, 1, b])
            batch = draw_prompts(corpus, config.gen_batch, config.prompt_tokens, rng)
            seed = int(rng.integers(0, 2**31))
            cont = sample(teacher, batch, config.gen_tokens, config.temperature, config.top_p, seed)
            prompts = np.concatenate([prompts, batch.astype(np.int32)])
            continuations = np.concatenate([continuations, cont.astype(np.int32)])
            tmp = path.with_name(path.stem + ".tmp.npz")
            np.savez(
                tmp, prompts=prompts, continuations=continuations, settings=json.dumps(settings)
            )
            os.replace(tmp, path)
            progress.update(task, completed=len(prompts))
            lines.advance(min(len(prompts), config.rows))
    log(
        f"{config.rows} teacher rows of {config.gen_tokens} tokens ({len(prompts)} cached in {path})"
    )
    return prompts[: config.rows], continuations[: config.rows]


def _teacher_digest(teacher_dir: Path, itself: bool = False) -> str:
    """Names a teacher checkpoint: its config and its weight shards' names and sizes (and whether
    the checkpoint teaches as itself, so rows of a float teacher are never taken for its own).
    Only the shards: adapter files beside them (lora_k4.safetensors, which training K=4 writes
    there) change no teacher, and counting them made the next run generate its rows again."""
    if not (teacher_dir / "config.json").exists():
        raise Edge0Error(
            f"{teacher_dir}: no config.json (the teacher must be an mlx-lm checkpoint)"
        )
    digest = hashlib.sha256((teacher_dir / "config.json").read_bytes())
    for shard in sorted(checkpoint_shards(teacher_dir)):
        digest.update(f"{shard.name}|{shard.stat().st_size}\n".encode())
    if itself:
        digest.update(b"the checkpoint itself")
    return digest.hexdigest()[:16]


def teacher_bytes(teacher_dir: str | Path | None, engine_config: EngineConfig | None) -> int:
    """Memory a float teacher takes once loaded in the compute dtype; 0 for the checkpoint itself
    (it is the student's own base)."""
    if teacher_dir is None:
        return 0
    return dequantized_bytes(Path(teacher_dir), float_size(engine_config or EngineConfig()))

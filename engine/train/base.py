"""Phase 0: train the demo model's teacher, a small qwen3_moe, from scratch on the CPU.

    edge0 train base OUT [--steps N] [--resume] [--seed S]

1. Data: Shakespeare's works (engine/corpus.py), 5% of the works held out; a byte-level BPE trained
   on the train split; the train works as one token stream plus ChatML exchanges (speech -> reply)
   so the teacher knows the chat format; fixed windows, shuffled per epoch from (seed, epoch).
2. Model: mlx-lm's own qwen3_moe classes, float32, with each MoE block swapped for
   `CapacityMoeBlock`: the same parameters under the same names, but the experts run by capacity
   dispatch (tokens sorted by expert into C = 1.25 * T * k / E slots per expert, then batched dense
   matmuls [E, C, d] @ [E, d, f]); mlx-lm's gather_mm is several times slower to train on CPU.
   Assignments past an expert's capacity are dropped (counted; a balance loss keeps them rare).
3. Train: AdamW, warmup + cosine, grad clipping. Every `save_every` steps OUT/train_state.safetensors
   holds model + optimizer + step (the step is the data position: batches are a function of
   (seed, step)); a run finds it and resumes, and ends where an uninterrupted run ends.
   OUT/loss.csv is the loss curve (with held-out loss every `eval_every` steps).
4. Export: OUT/teacher (bf16 float weights, the distillation teacher of later phases) and
   OUT/base (mlx-lm's quantizer: 4-bit g64, routers 8-bit, bf16 scales: the served demo model).

Training BLAS: MLX's bundled reference BLAS is many times slower than OpenBLAS for dense matmuls;
the `edge0` command preloads a fast one for every command (`engine.runtime.blas`). Without it
training runs, slower.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config
from tokenizers import Tokenizer

from ..errors import Edge0Error
from ..routing.functions import RoutingSpec, score_topk
from ..runtime.blas import blas_in_use
from ..runtime.metrics import peak_memory_line
from . import corpus
from .run import changed_settings, read_state, restore, save_state, training_progress
from .synth import (
    BITS,
    EOS_TOKEN_ID,
    GROUP_SIZE,
    MAX_SHARD_BYTES,
    build_tokenizer,
    write_weights,
)
from .synth_families import qwen3_moe_config


@dataclass
class TrainBaseConfig:
    # -- model (mlx-lm qwen3_moe) ------------------------------------------------------------------
    # Size of the served 4-bit base: 4-bit g64 with a bf16 scale and bias per 64 weights is
    # 4 + 32/64 = 4.5 bits = 0.5625 bytes per weight.
    #   experts   6 layers * 32 experts * 3 * 256 * 128 = 18.87 M
    #   attention 6 * (256*256 + 2*256*128 + 256*256)   =  1.18 M   (4 heads / 2 kv heads of 64)
    #   embed + lm_head 2 * 8192 * 256                   =  4.19 M
    #   -> 24.25 M * 0.5625 B = 13.6 MB, routers (6 * 32 * 256, 8-bit) 0.05 MB, norms ~0.02 MB:
    #   ~13.7 MB, leaving ~26 MB of the 40 MB assets budget for 3 prerouter + 3 LoRA files.
    # Compute per token is set by top_k * moe_int (active experts), not by the expert count;
    # 6 layers, not 8: 2 shared cores train few tokens an hour, and tokens matter more.
    layers: int = 6
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 32
    top_k: int = 8
    moe_int: int = 128
    vocab: int = 8192
    # -- data --------------------------------------------------------------------------------------
    seq_len: int = 256
    batch: int = 8  # windows per step: 2048 tokens
    chat_every: int = 8  # every 8th speech pair of a play becomes a ChatML exchange
    # -- optimisation ------------------------------------------------------------------------------
    steps: int = 720  # 1.47 M tokens, ~1 epoch (its time on 2 shared cores: assets/README.md)
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    capacity_factor: float = 1.25
    # Switch-Transformer load-balancing loss; 0.01 let routing collapse (many assignments over
    # capacity within the first steps), 0.1 keeps the kept share high.
    balance_weight: float = 0.1
    # -- bookkeeping -------------------------------------------------------------------------------
    save_every: int = 25
    eval_every: int = 100
    eval_windows: int = 32  # held-out windows in loss.csv (all of them: held_out_perplexity)
    seed: int = 0


STATE_NAME = "train_state"  # OUT/train_state.safetensors (+ .json): see run.py
STATE_FILE = f"{STATE_NAME}.safetensors"
LOSS_CSV = "loss.csv"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# -- the model ---------------------------------------------------------------------------------------


def capacity_glu(glu: nn.Module, x: mx.array, inds: mx.array, capacity: int):
    """SwitchGLU experts by capacity dispatch: [N, d] tokens, [N, k] experts -> [N, k, d], kept.

    Assignments are sorted by expert; expert e's first `capacity` assignments fill rows e*C.. of a
    [E, C, d] buffer (empty rows read a zero token), three batched matmuls run every expert on its
    rows, and each assignment gathers its output back (a dropped one gets zeros)."""
    n, k = inds.shape
    w_gate, w_up, w_down = glu.gate_proj.weight, glu.up_proj.weight, glu.down_proj.weight
    experts, d = w_gate.shape[0], x.shape[-1]
    flat = inds.reshape(-1)
    order = mx.argsort(flat)  # assignment indices, grouped by expert
    sorted_experts = flat[order]
    counts = mx.zeros((experts,), mx.int32).at[flat].add(1)
    starts = mx.cumsum(counts) - counts
    slot = mx.arange(capacity)
    source = mx.minimum(starts[:, None] + slot[None], n * k - 1)  # [E, C] sorted positions
    tokens = mx.where(slot[None] < counts[:, None], order[source] // k, n)  # n: the zero row
    xe = mx.concatenate([x, mx.zeros((1, d), x.dtype)])[tokens]  # [E, C, d]
    h = swiglu(xe @ w_gate.swapaxes(1, 2), xe @ w_up.swapaxes(1, 2))
    ye = (h @ w_down.swapaxes(1, 2)).reshape(experts * capacity, d)
    rank = mx.arange(n * k) - starts[sorted_experts]  # place within its expert
    kept = rank < capacity
    target = mx.where(kept, sorted_experts * capacity + rank, experts * capacity)
    target = target[mx.argsort(order)]  # back to assignment order
    y = mx.concatenate([ye, mx.zeros((1, d), ye.dtype)])[target]
    return y.reshape(n, k, d), kept.sum()


class CapacityMoeBlock(Qwen3MoeSparseMoeBlock):
    """mlx-lm's qwen3_moe MoE block (same parameters and names) with capacity-dispatch experts."""

    def __init__(self, args, capacity_factor: float) -> None:
        super().__init__(args)
        self.capacity_factor = capacity_factor

    def __call__(self, x: mx.array) -> mx.array:
        return self.forward_with_stats(x)[0]

    def forward_with_stats(self, x: mx.array):
        """(y, balance loss, kept assignments, assignments)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        k, experts = self.top_k, self.num_experts
        spec = RoutingSpec("softmax-topk", experts, k, self.norm_topk_prob)
        inds, scores = score_topk(logits, spec, k)  # the served routing
        gates = mx.softmax(logits, axis=-1, precise=True)  # for the balance loss
        capacity = math.ceil(self.capacity_factor * x.shape[0] * k / experts)
        y, kept = capacity_glu(self.switch_mlp, x, inds, capacity)
        y = (y * scores[..., None]).sum(axis=-2)
        share = mx.zeros((experts,)).at[inds.reshape(-1)].add(1.0) / inds.size
        balance = experts * (share * gates.mean(axis=0)).sum()
        return y.reshape(shape), balance, kept, inds.size


def model_config(config: TrainBaseConfig) -> dict:
    """The mlx-lm config.json dict (unquantized) of the teacher."""
    shape = {
        "hidden": config.hidden,
        "layers": config.layers,
        "dense": 2 * config.moe_int,  # unused: every layer is MoE
        "heads": config.heads,
        "kv_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "experts": config.experts,
        "top_k": config.top_k,
        "moe_int": config.moe_int,
        "vocab": config.vocab,
    }
    return dict(qwen3_moe_config(shape), eos_token_id=EOS_TOKEN_ID)


def build_model(config: TrainBaseConfig) -> nn.Module:
    """mlx-lm's qwen3_moe Model (float32, seeded init) with CapacityMoeBlock blocks."""
    model_class, args_class = _get_classes(model_config(config))
    args = args_class.from_dict(model_config(config))
    mx.random.seed(config.seed)
    model = model_class(args)
    depth_scale = 1.0 / math.sqrt(2 * config.layers)  # GPT-2: residual writes shrink with depth
    for layer in model.model.layers:
        block = CapacityMoeBlock(args, config.capacity_factor)
        block.update(layer.mlp.parameters())
        layer.mlp = block
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * depth_scale
        glu = block.switch_mlp
        glu.down_proj.weight = glu.down_proj.weight * depth_scale
    mx.eval(model.parameters())
    return model


def forward(model: nn.Module, tokens: mx.array):
    """Logits, mean balance loss, kept share of the expert assignments."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    balance, kept, total = 0.0, 0, 0
    for layer in inner.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask)
        y, b, k, n = layer.mlp.forward_with_stats(layer.post_attention_layernorm(h))
        h = h + y
        balance, kept, total = balance + b, kept + k, total + n
    return model.lm_head(inner.norm(h)), balance / len(inner.layers), kept / total


# -- data --------------------------------------------------------------------------------------------


def prepare_tokenizer(out_dir: Path, split: corpus.CorpusSplit, config: TrainBaseConfig) -> Path:
    """OUT/tokenizer: trained on the train split the first time, reused when resuming."""
    tokenizer_dir = out_dir / TOKENIZER_DIR
    if not (tokenizer_dir / "tokenizer.json").exists():
        # synth's ChatML byte-level BPE (Qwen's pipeline), trained on the train split only.
        build_tokenizer(tokenizer_dir, config.vocab, list(split.train.values()))
    return tokenizer_dir


def training_windows(tokenizer: Tokenizer, split: corpus.CorpusSplit, config: TrainBaseConfig):
    """[windows, seq_len + 1] int32: the train works' stream, then the chat exchanges' stream."""
    eot = tokenizer.token_to_id(corpus.ENDOFTEXT)
    works = [ids + [eot] for ids in _encode(tokenizer, split.train.values())]
    exchanges = [
        e for text in split.train.values() for e in corpus.chat_exchanges(text, config.chat_every)
    ]
    return np.concatenate(
        [_windows(works, config.seq_len), _windows(_encode(tokenizer, exchanges), config.seq_len)]
    )


def _encode(tokenizer: Tokenizer, texts) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(list(texts))]


def _windows(docs: list[list[int]], seq_len: int) -> np.ndarray:
    stream = np.fromiter((t for doc in docs for t in doc), dtype=np.int32)
    n = (len(stream) - 1) // seq_len
    starts = np.arange(n) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)[None]]


def batch_rows(step: int, batch: int, windows: int, seed: int) -> np.ndarray:
    """The window indices of `step`: epoch e is a permutation drawn from (seed, e)."""
    positions = step * batch + np.arange(batch)
    rows = np.empty(batch, dtype=np.int64)
    for epoch in np.unique(positions // windows):
        at = positions // windows == epoch
        rows[at] = np.random.default_rng([seed, int(epoch)]).permutation(windows)[
            positions[at] % windows
        ]
    return rows


# -- checkpoints -----------------------------------------------------------------------------------


def resume_state(out_dir: Path, model, optimizer, config: TrainBaseConfig) -> int:
    """Restore model and optimizer from OUT's training state; return the step to continue from.
    The step is the data position, so only settings that do not change the run may differ."""
    state, arrays = read_state(out_dir, STATE_NAME)
    changed = changed_settings(state["config"], config, free=("steps", "save_every", "eval_every"))
    if changed:
        raise Edge0Error(
            f"{out_dir}: the saved training state has other settings ({', '.join(changed)}); "
            "resume with the same settings or choose an empty directory"
        )
    restore(model, optimizer, arrays)
    return state["step"]


def _read_curve(out_dir: Path, up_to: int) -> list[dict]:
    """Rows of OUT/loss.csv up to step `up_to` (later rows belong to steps being redone)."""
    path = out_dir / LOSS_CSV
    if not path.exists():
        return []
    with path.open() as f:
        return [row for row in csv.DictReader(f) if int(row["step"]) <= up_to]


def _write_curve(out_dir: Path, rows: list[dict]) -> None:
    fields = ["step", "loss", "balance", "kept", "lr", "tokens", "seconds", "tok_s", "held_out"]
    with (out_dir / LOSS_CSV).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


# -- training ----------------------------------------------------------------------------------------


def window_nll(model: nn.Module, windows: np.ndarray, batch: int = 8) -> tuple[float, int]:
    """Summed next-token NLL and token count over [n, L+1] windows (teacher forcing)."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = mx.array(windows[i : i + batch])
        logits = model(chunk[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="sum")
        total += nll.item()
        count += chunk[:, 1:].size
    return total, count


def train_base(
    out_dir: str | Path,
    config: TrainBaseConfig,
    texts_dir: str | Path | None = None,
    resume: bool = False,
    export: bool = True,
    progress=print,
    show_bar: bool = True,
) -> Path:
    """Train (or resume) the teacher in OUT; export OUT/teacher and OUT/base; return OUT."""
    out_dir = Path(out_dir)
    if resume and not (out_dir / STATE_FILE).exists():
        raise Edge0Error(f"{out_dir}: no training state to resume ({STATE_FILE})")
    out_dir.mkdir(parents=True, exist_ok=True)

    # -- 1. data -----------------------------------------------------------------------------------
    split = corpus.split_works(corpus.load_works(texts_dir or corpus.fetch_corpus()))
    tokenizer_dir = prepare_tokenizer(out_dir, split, config)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    windows = training_windows(tokenizer, split, config)
    held = _windows(_encode(tokenizer, split.held_out.values()), config.seq_len)
    held = held[np.linspace(0, len(held) - 1, min(config.eval_windows, len(held))).astype(int)]
    progress(
        f"corpus: {len(split.train)} works + chat exchanges = {windows[:, 1:].size:,} training tokens "
        f"({len(windows)} windows of {config.seq_len}); held out: {', '.join(split.held_out)}"
    )

    # -- 2. model and optimizer --------------------------------------------------------------------
    model = build_model(config)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(config.lr / config.warmup, config.lr, config.warmup),
            optim.cosine_decay(config.lr, max(1, config.steps - config.warmup), config.min_lr),
        ],
        [config.warmup],
    )
    optimizer = optim.AdamW(schedule, betas=[0.9, 0.95], weight_decay=config.weight_decay)
    optimizer.init(model.trainable_parameters())
    start = 0
    if (out_dir / STATE_FILE).exists():
        start = resume_state(out_dir, model, optimizer, config)
        progress(f"resuming from step {start} ({out_dir / STATE_FILE})")
    curve = _read_curve(out_dir, start)
    progress(f"model: {params / 1e6:.2f} M parameters; BLAS: {blas_in_use().describe()}")

    def loss_fn(model, batch):
        logits, balance, kept = forward(model, batch[:, :-1])
        loss = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
        return loss + config.balance_weight * balance, (loss, balance, kept)

    grad_fn = nn.value_and_grad(model, loss_fn)

    def step_fn(batch):
        (_, stats), grads = grad_fn(model, batch)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(model, grads)
        return stats

    # -- 3. train ----------------------------------------------------------------------------------
    tokens_per_step = config.batch * config.seq_len
    train_seconds, tokens_done = 0.0, 0
    with training_progress(show_bar) as bar:
        task = bar.add_task("train base", total=config.steps, completed=start, status="")
        for step in range(start, config.steps):
            lr = schedule(mx.array(step)).item()
            began = time.perf_counter()
            batch = mx.array(windows[batch_rows(step, config.batch, len(windows), config.seed)])
            loss, balance, kept = step_fn(batch)
            mx.eval(model.parameters(), optimizer.state, loss, balance, kept)
            tokens_done += tokens_per_step
            train_seconds += time.perf_counter() - began
            row = {
                "step": step + 1,
                "loss": round(loss.item(), 5),
                "balance": round(balance.item(), 4),
                "kept": round(kept.item(), 5),
                "lr": f"{lr:.3g}",
                "tokens": (step + 1) * tokens_per_step,
                "seconds": round(train_seconds, 1),  # training steps of this run, no evals
                "tok_s": round(tokens_done / train_seconds),
                "held_out": "",
            }
            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                with _no_drop(model):
                    total, count = window_nll(model, held)
                row["held_out"] = round(total / count, 5)
            curve.append(row)
            info = f"loss {row['loss']:.3f}  {row['tok_s']} tok/s"
            bar.update(task, completed=done, status=info)
            _write_curve(out_dir, curve)  # rows past the last saved state are redone on resume
            if done % config.save_every == 0 or done == config.steps:
                state = {"step": done, "config": asdict(config)}
                save_state(out_dir, STATE_NAME, model, optimizer, state)
            if done % config.save_every == 0 or done == config.steps or step == start:
                held_text = f"  held-out {row['held_out']}" if row["held_out"] != "" else ""
                progress(
                    f"step {done}/{config.steps}  loss {row['loss']:.4f}{held_text}  "
                    f"kept {row['kept']:.3f}  lr {lr:.2e}  {row['tok_s']} tok/s"
                )

    # -- 4. export ---------------------------------------------------------------------------------
    if export:
        teacher, base = export_checkpoints(model, config, tokenizer_dir, out_dir)
        progress(f"wrote {teacher} (bf16 teacher) and {base} (4-bit base)")
    # What the run needed at most: what a RAM limit must leave room for.
    progress(peak_memory_line())
    return out_dir


@contextlib.contextmanager
def _no_drop(model: nn.Module):
    """Capacity for every assignment while evaluating (held-out loss must not drop tokens)."""
    blocks = [layer.mlp for layer in model.model.layers]
    saved = [block.capacity_factor for block in blocks]
    for block in blocks:
        block.capacity_factor = block.num_experts / block.top_k
    try:
        yield model
    finally:
        for block, factor in zip(blocks, saved):
            block.capacity_factor = factor


# -- export ------------------------------------------------------------------------------------------


def export_checkpoints(model, config: TrainBaseConfig, tokenizer_dir: Path, out_dir: Path):
    """OUT/teacher (float, bf16) and OUT/base (4-bit g64, routers 8-bit), both mlx-lm qwen3_moe."""
    cfg = model_config(config)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    teacher, base = out_dir / "teacher", out_dir / "base"
    for directory in (teacher, base):
        directory.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, directory / name)
    write_weights(teacher, dict(weights), MAX_SHARD_BYTES)
    save_config(cfg, teacher / "config.json")

    model_class, args_class = _get_classes(cfg)
    stock = model_class(args_class.from_dict(cfg))
    stock.load_weights(list(weights.items()))
    # quantize_model prints a bits-per-weight line.
    with contextlib.redirect_stdout(io.StringIO()):
        stock, quantized_config = quantize_model(stock, cfg, group_size=GROUP_SIZE, bits=BITS)
    write_weights(base, dict(tree_flatten(stock.parameters())), MAX_SHARD_BYTES)
    save_config(quantized_config, base / "config.json")
    return teacher, base


def held_out_perplexity(
    model_dir: str | Path, texts_dir: str | Path | None = None, window: int = 256
) -> dict:
    """Perplexity of an mlx-lm checkpoint (the 4-bit base or the float teacher) on the held-out
    works: mean next-token NLL with teacher forcing over non-overlapping windows of `window` tokens
    (each window starts without context), in float32 activations."""
    model_dir = Path(model_dir)
    split = corpus.split_works(corpus.load_works(texts_dir or corpus.fetch_corpus()))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = _encode(tokenizer, split.held_out.values())
    windows = _windows(ids, window)
    model, _ = load_model(model_dir)
    model.set_dtype(mx.float32)  # bf16 activations are slow on CPU; gather_mm needs float32 there
    total, count = window_nll(model, windows)
    chars = sum(len(t) for t in split.held_out.values()) * count / sum(len(i) for i in ids)
    return {
        "works": list(split.held_out),
        "tokens": count,
        "nll": total / count,
        "perplexity": math.exp(total / count),
        "bits_per_char": total / math.log(2) / chars,
    }

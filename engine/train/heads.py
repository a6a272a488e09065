"""Phase 1: distill prerouter heads from a model's own routers, on the machine that runs it.

    edge0 train heads MODEL --k K [--text FILE] [--out FILE] [--adapters DIR] [--expert-cache SIZE]

0. Without `--text`, the model first writes its own text (`self_text.py`): its replies to built-in
   prompts through its chat template, the replies to a few prompts held out.
1. Collect (`collect.py`): run the model in on-demand mode, the experts streamed in bounded memory,
   over the text in fixed-length windows (teacher forcing), and record every MoE layer's input x
   and router logits into memory-mapped arrays on disk, window by window.
2. Train all heads at once (stacked, AdamW) on mini-batches read from those arrays. For owner N at
   token t the features are z = [x_N,t; onehot_K(A_N,t); onehot_K(A_N,t-1)], where A are the true
   router's top-K sets (`routing.prerouter.head_features`), built per batch; the target is layer
   N+1's router logits at token t+1. linear_init starts as layer N+1's dequantized router weights on
   the hidden part (zeros on the one-hots) and fc2 starts at zero, so training starts from "apply
   the next layer's router to this layer's state" and the MLP learns the correction. Loss: soft
   cross-entropy between the routing distributions (what top-K ranking needs) plus a small logit
   MSE (the combine weights read absolute scores).
3. Report held-out recall@K per owner (through the family's routing function; the first windows
   are held out: of the model's own text, the held-out prompts' replies), and that of the heads
   the model already has for K, on the same windows; save.

Everything lands in the adapter folder: `--adapters DIR`, else the model's automatic folder
(`adapters/locations.py`); the traces and the training state in its `work/` folder. Both stages
resume: a rerun of the same command continues after the last complete window, and from the last
saved training step, and the model's own text after its last written reply. The traces do not
depend on K: every K of the same text reuses them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..adapters.locations import auto_adapter_dir
from ..adapters.profiles import search_profiles
from ..checkpoint.index import base_fingerprint
from ..checkpoint.outputs import check_output_file, check_output_folder
from ..config import EngineConfig, format_bytes
from ..errors import Edge0Error
from ..routing.functions import RoutingSpec, route
from ..routing.moe_block import ops_for
from ..routing.prerouter import (
    PrerouterHeads,
    head_features,
    head_forward,
    next_moe_layer,
    save_prerouter,
    sequence_features,
)
from ..runtime.generation import Engine
from ..runtime.loader import LoadedModel, load
from ..runtime.metrics import peak_memory_line
from .budget import (
    Confirm,
    HeadsPlan,
    KeptPlans,
    PlanTerms,
    Rates,
    collection_rate,
    measure_rates,
    plan_heads,
    training_step_rate,
    writing_rate,
)
from .collect import (
    TraceFiles,
    check_windows,
    collect_traces,
    describe,
    route_by_own_routers,
    token_windows,
    trace_key,
)
from .data import corpus_tokens
from .run import Log, TrainingRun, training_progress
from .self_prompts import PROMPTS
from .self_text import SelfText, SelfTextConfig, render_prompt, write_self_text

# Held-out windows evaluated per forward of the heads.
EVAL_WINDOWS = 8


@dataclass
class TrainHeadsConfig:
    k: int
    start_layer: int | None = None  # first layer routed by prediction; None: second MoE layer
    window: int = 128  # tokens per teacher-forced forward
    max_tokens: int = 60_000  # of the text, at most
    holdout: float = 0.1  # share of windows kept out for recall@K
    inner: int = 512  # width of fc1 (the reference's heads use 512)
    steps: int = 400
    batch: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    mse_weight: float = 0.1
    seed: int = 0
    grad_clip: float = 1e6  # in effect none: the loss is smooth (shared loop of every phase)
    checkpoint_every: int = 50  # steps between saved training states
    log_every: int = 50


@dataclass
class Routing:
    """What the heads' features and targets need of the model's routers."""

    spec: RoutingSpec
    k: int
    experts: int
    biases: dict[int, mx.array | None]  # per MoE layer (group routers' expert bias)

    def top_k(self, logits: np.ndarray, layer: int) -> np.ndarray:
        """The router's top-K sets [..., K] (int32) for logits [..., E] of `layer`."""
        inds, _ = route(mx.array(logits), self.spec, self.k, self.biases[layer])
        return np.array(inds).astype(np.int32)


# -- the model's side: routers, initial heads --------------------------------------------------------


def routing_of(loaded: LoadedModel, k: int) -> Routing:
    blocks = {site.layer: site.parent for site in loaded.sites}  # the family's own blocks
    ops = ops_for(loaded.family.name)
    spec = ops.spec(blocks[min(blocks)])
    biases = {layer: ops.expert_bias(block) for layer, block in blocks.items()}
    return Routing(spec, k, loaded.num_experts, biases)


def init_heads(loaded: LoadedModel, owners: list[int], k: int, inner: int, seed: int):
    mx.random.seed(seed)
    hidden, experts = loaded.hidden, loaded.num_experts
    width = hidden + 2 * experts
    blocks = {site.layer: site.parent for site in loaded.sites}  # the family's own blocks
    ops = ops_for(loaded.family.name)
    linear_init = []
    for owner in owners:
        consumer = blocks[next_moe_layer(owner, blocks)]
        w = router_weight(ops.router(consumer)).astype(mx.float32)  # [E, H]
        linear_init.append(mx.concatenate([w, mx.zeros((experts, 2 * experts))], axis=1))
    n = len(owners)
    fc1 = mx.random.normal((n, inner, width)) * (1.0 / math.sqrt(width))
    fc2 = mx.zeros((n, experts, inner))
    heads = PrerouterHeads(None, k, list(owners), hidden, experts, fc1, fc2, mx.stack(linear_init))
    heads.consumers = [next_moe_layer(owner, blocks) for owner in owners]
    mx.eval(heads.fc1, heads.fc2, heads.linear_init)
    return heads


def router_weight(linear: nn.Module) -> mx.array:
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            linear.group_size,
            linear.bits,
            linear.mode,
        )
    return linear.weight


class HeadStack(nn.Module):
    """The heads being trained, as a module (for the optimizer and the saved training state)."""

    def __init__(self, heads: PrerouterHeads) -> None:
        super().__init__()
        self.fc1, self.fc2, self.linear_init = heads.fc1, heads.fc2, heads.linear_init

    def __call__(self, z: mx.array) -> mx.array:
        return head_forward(self.fc1, self.fc2, self.linear_init, z)


@dataclass
class _Trainee:
    """What the shared training loop (`run.TrainingRun`) needs to know of what it trains."""

    model: nn.Module
    fingerprint: str

    def value_and_grad(self, loss_fn):
        return nn.value_and_grad(self.model, loss_fn)


# -- mini-batches from the traces ---------------------------------------------------------------------


def batch(
    traces: TraceFiles, owners: list[int], windows: np.ndarray, positions: np.ndarray, routing
) -> tuple[mx.array, mx.array]:
    """Features [n, B, H+2E] and targets [n, B, E] of owners at (window, position) pairs, read from
    the traces for this batch only. A position is a token t <= T-2 (its target is at t+1)."""
    features, targets = [], []
    first = positions == 0
    for owner in owners:
        x = traces.read("x", owner, windows, positions)
        sets = routing.top_k(traces.read("logits", owner, windows, positions), owner)
        before = routing.top_k(
            traces.read("logits", owner, windows, np.maximum(positions - 1, 0)), owner
        )
        before[first] = -1  # no token before the window's first: A_{t-1} unknown
        features.append(
            head_features(mx.array(x), mx.array(sets), mx.array(before), routing.experts)
        )
        consumer = next_moe_layer(owner, traces.shape.layers)
        targets.append(mx.array(traces.read("logits", consumer, windows, positions + 1)))
    return mx.stack(features), mx.stack(targets)


def sample_positions(rng: np.random.Generator, held: int, windows: int, window: int, size: int):
    """`size` (window, position) pairs drawn from the training windows (those after `held`)."""
    samples = (windows - held) * (window - 1)
    flat = rng.integers(0, samples, size=min(size, samples))
    return held + flat // (window - 1), flat % (window - 1)


def recall_hits(pred: np.ndarray, target: np.ndarray, routing: Routing, consumer: int) -> int:
    """Experts of the predicted top-K sets that are also in the true ones, over every row."""
    pred_sets = routing.top_k(pred, consumer).reshape(-1, routing.k)
    true_sets = routing.top_k(target, consumer).reshape(-1, routing.k)
    chosen = np.zeros((len(true_sets), routing.experts), dtype=bool)
    rows = np.arange(len(true_sets))[:, None]
    chosen[rows, true_sets] = True
    return int(chosen[rows, pred_sets].sum())


def heldout_recalls(
    traces: TraceFiles,
    owners: list[int],
    held: int,
    forward: Callable[[mx.array], mx.array],
    routing: Routing,
) -> dict[int, float]:
    """Held-out recall@K per owner of heads `forward` ([n, M, H+2E] -> [n, M, E]) over the first
    `held` windows, EVAL_WINDOWS at a time."""
    hits = dict.fromkeys(owners, 0)
    consumers = {owner: next_moe_layer(owner, traces.shape.layers) for owner in owners}
    total = 0
    for start in range(0, held, EVAL_WINDOWS):
        ws = slice(start, min(held, start + EVAL_WINDOWS))
        features, targets = [], []
        for owner in owners:
            x = traces.read("x", owner, ws)  # [c, T, H]
            sets = routing.top_k(traces.read("logits", owner, ws), owner)
            z = sequence_features(mx.array(x), mx.array(sets), routing.experts)[:, :-1]
            features.append(z.reshape(-1, z.shape[-1]))
            logits = traces.read("logits", consumers[owner], ws)
            targets.append(logits[:, 1:].reshape(-1, routing.experts))
        pred = np.array(forward(mx.stack(features)))
        for i, owner in enumerate(owners):
            hits[owner] += recall_hits(pred[i], targets[i], routing, consumers[owner])
        total += targets[0].shape[0] * routing.k
    return {owner: hits[owner] / total for owner in owners}


# -- the phase ------------------------------------------------------------------------------------------


def train_heads(
    model_dir: str | Path,
    text: str | None,
    config: TrainHeadsConfig,
    out: Path | None = None,
    progress: Log = print,
    engine_config: EngineConfig | None = None,
    adapters_dir: Path | None = None,
    bar: bool = False,
    on_window: Callable | None = None,
    text_name: str | None = None,
    self_text: SelfTextConfig | None = None,
    time_budget_s: float | None = None,
    confirm: Confirm | None = None,
) -> tuple[Path, dict[int, float]]:
    """Train heads for K=config.k on `text`; save them; return (path, held-out recall@K per owner).

    `text` None: the text the model writes itself (`self_text.py`), held out by prompt; otherwise
    its first windows are held out. How much text: `self_text.tokens` where given, else what
    `time_budget_s` holds (`budget.py`: each phase timed first; None: all of `config.max_tokens`).
    The plan is logged before any work and `confirm(plan)` may accept it, stop, or ask for
    another budget (None: accepted). Every refusal comes before the plan.
    `engine_config` sets the expert cache and the data folder (the model always runs on-demand);
    `adapters_dir` replaces the automatic adapter folder; `on_window(i, captured)` sees each
    collected window (tests); `text_name` says what `text` is in the report."""
    model_dir = Path(model_dir)
    engine_config = dataclasses.replace(
        engine_config or EngineConfig(),
        mode="on-demand",
        k=None,
        shadow_router=False,
        context_tokens=config.window,  # one teacher-forced window a forward, no cache kept
        prefill_chunk=config.window,
    )
    if out is not None:  # before the model loads and the traces are collected, not after
        check_output_file(out, "the heads")
    if adapters_dir:
        check_output_folder(adapters_dir, "the heads and their traces")
    agree = PlanTerms(time_budget_s, confirm, progress)
    started = time.perf_counter()
    written = None
    if text is None:
        written = write_own_text(
            model_dir, engine_config, config, self_text, adapters_dir, progress, bar, agree, out
        )
        started = time.perf_counter()  # the collection's time, without the writing's
    loaded = load(model_dir, engine_config)
    try:
        # Said once: by the writing engine already, when the model writes its text.
        setup = checked_setup(
            loaded, model_dir, engine_config, config, adapters_dir, out, progress, written is None
        )
        fingerprint, folder, out, owners = setup.fingerprint, setup.folder, setup.out, setup.owners
        work = make_folder(folder) / "work"

        # -- 1. collect -----------------------------------------------------------------------------
        if written is not None:
            windows, held, text_name, held_name = self_text_windows(written, config.window)
        else:
            tokens = corpus_tokens(loaded.tokenizer, text, config.max_tokens)
            check_windows(token_windows(tokens, config.window), config.window)
            route_by_own_routers(loaded)  # (as the collection runs it)
            rates = _rates(None, loaded.model, loaded.store, tokens, config, loaded, len(owners))
            whole = len(tokens) // config.window * config.window
            plan = agreed_plan(agree, make_folder(work), rates, config, whole, "the given text")
            windows = token_windows(tokens[: plan.tokens], config.window)
            check_windows(windows, config.window)
            held = max(1, int(round(len(windows) * config.holdout)))
            if held >= len(windows):
                raise Edge0Error(f"holdout {config.holdout} leaves no windows to train on")
            held_name = f"its first {held * config.window:,} tokens ({held} windows)"
        progress(f"training text: {text_name or 'the given text'}")
        key = trace_key(fingerprint, windows)
        with training_progress(bar) as bars:
            traces = collect_traces(
                loaded, windows, work / f"traces-{key}", bars, on_window, log=progress
            )
        progress(
            f"collected {describe(traces.shape)} in {time.perf_counter() - started:.1f} s "
            f"(expert cache {format_bytes(loaded.memory_plan.expert_cache_bytes)}); "
            f"training {len(owners)} heads (owners {owners[0]}..{owners[-1]})"
        )
        routing = routing_of(loaded, config.k)
        heads = init_heads(loaded, owners, config.k, config.inner, config.seed)
        baseline = existing_heads(model_dir, fingerprint, engine_config, loaded, config.k)
    finally:
        loaded.store.close()  # the model's part is done; its reader threads and pool go
    del loaded

    # -- 2. train -----------------------------------------------------------------------------------
    stack = fit_heads(
        traces,
        owners,
        routing,
        heads,
        config,
        work / f"heads-k{config.k}-{key}",
        fingerprint,
        held,
        progress,
        bar,
    )
    heads.fc1, heads.fc2, heads.linear_init = stack.fc1, stack.fc2, stack.linear_init

    # -- 3. evaluate and save -------------------------------------------------------------------------
    # Every recall below, the new heads' and those found before, is on the same held-out windows.
    progress(f"held-out text: {held_name}")
    recalls = heldout_recalls(traces, owners, held, stack, routing)
    for owner, r in recalls.items():
        progress(
            f"  head of layer {owner:3d} -> layer {heads.consumers[owners.index(owner)]:3d}: "
            f"held-out recall@{config.k} {r:.3f}"
        )
    chance = config.k / routing.experts
    mean = float(np.mean(list(recalls.values())))
    progress(f"mean recall@{config.k} {mean:.3f} (chance {chance:.3f})")
    if baseline is not None:
        found = heldout_recalls(traces, baseline.owners, held, heads_forward(baseline), routing)
        progress(
            f"the heads found before for K={config.k} ({baseline.path}): mean recall@{config.k} "
            f"{np.mean(list(found.values())):.3f} on the same held-out text"
        )
    save_prerouter(make_folder(out.parent) / out.name, heads, setup.start, fingerprint)
    progress(f"wrote {out}")
    # What the run needed at most: the figures a RAM limit must leave room for.
    progress(peak_memory_line())
    return out, recalls


@dataclass
class Setup:
    """What phase 1 settles about a model before any work: its fingerprint, the adapter folder,
    the heads' file, the first layer routed by prediction and the heads' owner layers."""

    fingerprint: str
    folder: Path
    out: Path
    start: int
    owners: list[int]


def checked_setup(
    loaded: LoadedModel,
    model_dir: Path,
    engine_config: EngineConfig,
    config: TrainHeadsConfig,
    adapters_dir: Path | None,
    out: Path | None,
    progress: Log,
    note: bool = True,
) -> Setup:
    """Every refusal phase 1 can make of the model (K, the start layer), and (`note`) the note
    that another folder's heads would shadow the new ones: said before any text is written or
    collected, not after."""
    fingerprint = base_fingerprint(loaded.index)
    if not 1 <= config.k <= loaded.num_experts:
        raise Edge0Error(f"K={config.k} must be between 1 and {loaded.num_experts}")
    moe_layers = sorted(site.layer for site in loaded.sites)
    start = config.start_layer
    if start is None:  # the first MoE layer routes by its router: it has no owner before it
        start = moe_layers[1] if len(moe_layers) > 1 else moe_layers[0]
    owners = [n for n in moe_layers if (next_moe_layer(n, moe_layers) or -1) >= start]
    if not owners:
        raise Edge0Error(f"no owner layers: start layer {start} leaves no MoE layer to predict")
    folder = adapter_folder(adapters_dir, fingerprint, engine_config)
    check_output_folder(folder / "work", "the traces")
    out = Path(out) if out is not None else folder / f"prerouter_k{config.k}.safetensors"
    if note and (said := shadow_note(model_dir, fingerprint, engine_config, config.k, out)):
        progress(said)
    return Setup(fingerprint, folder, out, start, owners)


def _rates(
    engine: Engine | None,
    model: nn.Module,
    store,
    tokens: Sequence[int],
    config: TrainHeadsConfig,
    loaded: LoadedModel,
    heads: int,
) -> Rates:
    """The phases' rates here (`budget.py`): writing with `engine` (None: the text is given), a
    window of `tokens` collected through `model`, a training step of `heads` heads."""
    window = np.resize(np.asarray(tokens, dtype=np.int64), config.window)
    return measure_rates(
        None if engine is None else (lambda: writing_rate(engine, list(tokens))),
        lambda: collection_rate(model, store, window),
        lambda: training_step_rate(
            heads, loaded.hidden, loaded.num_experts, config.inner, config.batch
        ),
    )


# Replies the model writes at once for its own text (runtime/batch.py): the plan counts their KV
# caches, each of a reply's context.
SELF_TEXT_BATCH = 4


def write_own_text(
    model_dir: Path,
    engine_config: EngineConfig,
    config: TrainHeadsConfig,
    self_text: SelfTextConfig | None,
    adapters_dir: Path | None,
    progress: Log,
    bar: bool,
    agree: PlanTerms | None = None,
    out: Path | None = None,
) -> SelfText:
    """The text the model writes itself for phase 1 (`self_text.py`), kept in the adapter folder's
    work/ beside the traces: `self_text.tokens` of it, else what the plan agreed (`agree`) holds.
    Held out: a share `config.holdout` of it in whole windows, at least one, from the held-out
    prompts; the rest, at least one window, from the others. Phase 1's refusals and notes come
    first, once the model is loaded and before anything is written."""
    agree = agree or PlanTerms(None, None, progress)
    # The engine that writes: on-demand at the native K, no heads, no LoRA (the model's own
    # text, exactly), each reply from a fresh cache (a resumed text is the uninterrupted one).
    reply_tokens = (self_text or SelfTextConfig()).reply_tokens
    writing = dataclasses.replace(
        engine_config,
        context_tokens=reply_tokens + 1024,  # a prompt, its template's text included
        prefill_chunk=EngineConfig.prefill_chunk,
        reuse_prompt_cache=False,
        max_batch=SELF_TEXT_BATCH,
    )
    with Engine(model_dir, writing) as engine:
        setup = checked_setup(
            engine.loaded, model_dir, engine_config, config, adapters_dir, out, progress
        )
        fixed = None if self_text is None else self_text.tokens
        held_out_share(config.max_tokens if fixed is None else fixed, config)  # (refused first)
        prompt = render_prompt(engine, PROMPTS[0])
        rates = _rates(
            engine, engine.model, engine.store, prompt, config, engine.loaded, len(setup.owners)
        )
        work = make_folder(make_folder(setup.folder) / "work")
        most = config.max_tokens
        plan = agreed_plan(agree, work, rates, config, most, "its own text", fixed)
        self_text = self_text or SelfTextConfig(tokens=plan.tokens)
        held_out_tokens = held_out_share(self_text.tokens, config)
        return write_self_text(engine, work, self_text, held_out_tokens, progress, bar)


def agreed_plan(
    agree: PlanTerms,
    work: Path,
    rates: Rates,
    config: TrainHeadsConfig,
    most_tokens: int,
    text: str,
    fixed_tokens: int | None = None,
) -> HeadsPlan:
    """The plan agreed for `rates` (`budget.py`), its text's length kept in `work` for a rerun
    of the same terms (`KeptPlans`: a rerun resumes the text and traces it started)."""
    kept = KeptPlans(work)

    def terms(budget: float | None) -> dict:
        return {
            "budget_s": budget,
            "most_tokens": most_tokens,
            "steps": config.steps,
            "window": config.window,
            "text": text,
        }

    def plan(budget: float | None) -> HeadsPlan:
        return plan_heads(
            rates,
            config.steps,
            budget,
            most_tokens,
            config.window,
            fixed_tokens,
            "--self-text-tokens",
            kept.tokens(terms(budget)),
        )

    agreed = agree.agree(plan)
    if fixed_tokens is None:
        kept.keep(terms(agreed.budget_s), agreed.tokens)
    return agreed


def held_out_share(tokens: int, config: TrainHeadsConfig) -> int:
    """The held-out part of `tokens` of the model's own text: a share `config.holdout` in whole
    windows, at least one; refused where it leaves no training window."""
    window = config.window
    held_out_tokens = window * max(1, round(config.holdout * tokens / window))
    if tokens < held_out_tokens + window:
        raise Edge0Error(
            f"{tokens} tokens of the model's own text are too few: phase 1 needs at "
            f"least {held_out_tokens + window} (a held-out window and a training window of {window})"
        )
    return held_out_tokens


def self_text_windows(written: SelfText, window: int) -> tuple[np.ndarray, int, str, str]:
    """(windows, held, what the text is, what its held-out part is): the held-out prompts' text
    in the first `held` windows, the train prompts' after them; no window mixes the two."""
    held_out = token_windows(written.held_out, window)
    train = token_windows(written.train, window)
    windows = np.concatenate([held_out, train])
    held_tokens, train_tokens = held_out.size, train.size
    held_name = (
        f"{held_tokens:,} tokens ({len(held_out)} windows) of the model's replies to the "
        f"{written.held_out_prompts} held-out prompts, never trained on"
    )
    return windows, len(held_out), written.describe(train_tokens, held_tokens), held_name


def adapter_folder(
    adapters_dir: Path | None, fingerprint: str, engine_config: EngineConfig
) -> Path:
    """Where the heads and their work go: `--adapters`, else the model's automatic folder."""
    if adapters_dir:
        return Path(adapters_dir)
    return auto_adapter_dir(fingerprint, engine_config.data_dir)


def fit_heads(
    traces: TraceFiles,
    owners: list[int],
    routing: Routing,
    heads: PrerouterHeads,
    config: TrainHeadsConfig,
    state_dir: Path,
    fingerprint: str,
    held: int,
    log: Log = print,
    bar: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> HeadStack:
    """Train the stacked heads on mini-batches streamed from the traces; resumes from the state in
    `state_dir` (shared loop: `run.TrainingRun`). The batch of a step is a function of the seed and
    the step, so a resumed run trains exactly as an uninterrupted one."""
    shape = traces.shape
    stack = HeadStack(heads)

    def loss_fn(z, y):
        pred = stack(z)
        soft = -(mx.softmax(y, axis=-1) * nn.log_softmax(pred, axis=-1)).sum(-1).mean()
        return soft + config.mse_weight * ((pred - y) ** 2).mean()

    def heldout_loss() -> float:
        rng = np.random.default_rng([config.seed, 0])  # steps count from 1: 0 is the held-out draw
        flat = rng.integers(0, held * (shape.window - 1), size=config.batch)
        w, t = flat // (shape.window - 1), flat % (shape.window - 1)
        return loss_fn(*batch(traces, owners, w, t, routing)).item()

    # Held-out loss picks the heads: a run that ends worse than an earlier checkpoint keeps it.
    trainee = _Trainee(stack, fingerprint)
    run = TrainingRun(state_dir, trainee, config, loss_fn, heldout_loss, log, keep_best=True)
    with training_progress(bar) as bars:
        task = bars.add_task("train", total=config.steps, completed=run.done, status="")
        for step in range(run.done + 1, config.steps + 1):
            rng = np.random.default_rng([config.seed, step])
            w, t = sample_positions(rng, held, shape.windows, shape.window, config.batch)
            loss = run.step(step, *batch(traces, owners, w, t, routing), tokens=len(w))
            bars.update(task, advance=1, status=f"loss {loss:.4f}")
            if on_step is not None:
                on_step(step)
    run.finish()
    return stack


# -- the heads the model already has --------------------------------------------------------------------


def existing_heads(
    model_dir: Path, fingerprint: str, engine_config: EngineConfig, loaded: LoadedModel, k: int
) -> PrerouterHeads | None:
    """The heads the model's adapter search finds for K (to compare on the same held-out windows),
    or None; a file that does not load is skipped (it is being replaced)."""
    files = search_profiles(model_dir, fingerprint, engine_config).profiles.get(k)
    if files is None or files.prerouter is None:
        return None
    try:
        return loaded.load_heads(files.prerouter, fingerprint, k, mx.float32)
    except Edge0Error:
        return None


def heads_forward(heads: PrerouterHeads) -> Callable[[mx.array], mx.array]:
    return lambda z: head_forward(heads.fc1, heads.fc2, heads.linear_init, z)


def shadow_note(
    model_dir: Path, fingerprint: str, engine_config: EngineConfig, k: int, out: Path
) -> str | None:
    """A note, before training, when the adapter search would serve another file for K than
    the heads about to be written to `out`."""
    found = search_profiles(model_dir, fingerprint, engine_config).profiles.get(k)
    if found is None or found.prerouter is None or found.prerouter.resolve() == out.resolve():
        return None
    return (
        f"note: the heads will be written to {out}, but K={k} is served from {found.prerouter} "
        f"({found.origin} folder), which comes first in the adapter search: run with "
        f"--adapters {out.parent} to serve the new heads"
    )


def make_folder(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Edge0Error(f"{folder}: cannot make the adapter folder ({e.strerror or e})") from None
    return folder

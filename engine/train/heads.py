"""Phase 1: distill prerouter heads from a model's own routers. Works for any supported model.

    edge0 train heads MODEL --k K --text FILE [--out FILE] [--start-layer N] [--steps N]

1. Collect: run the resident model over the text (teacher forcing, fixed-length windows) and record,
   for every MoE layer, its MoE input x and its router logits at every position.
2. Build features: for owner N at token t, z = [x_N,t; onehot_K(A_N,t); onehot_K(A_N,t-1)], where A
   are the true router's top-K sets; the target is layer N+1's router logits at token t+1.
3. Train all heads at once (stacked, AdamW). linear_init starts as layer N+1's dequantized router
   weights on the hidden part (zeros on the one-hots) and fc2 starts at zero, so training starts
   from "apply the next layer's router to this layer's state" and the MLP learns the correction.
   Loss: soft cross-entropy between the routing distributions (what top-K ranking needs) plus a
   small logit MSE (the combine weights read absolute scores).
4. Report held-out recall@K per owner (through the family's routing function) and save.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..checkpoint.index import base_fingerprint
from ..config import EngineConfig
from ..errors import Edge0Error
from ..routing.functions import RoutingSpec, route
from ..routing.moe_block import ops_for
from ..routing.prerouter import PrerouterHeads, head_forward, save_prerouter, sequence_features
from ..runtime.loader import load, quiet_load_tokenizer
from .data import corpus_tokens


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


@dataclass
class LayerTrace:
    """One MoE layer over the collected positions."""

    x: np.ndarray  # [positions, H] MoE inputs
    logits: np.ndarray  # [positions, E] router logits


class _Capture(nn.Module):
    """Wraps a stock MoE block to record its input and its router logits, then runs it."""

    def __init__(self, block: nn.Module, ops, sink: list) -> None:
        super().__init__()
        self.block = block
        self._ops = ops
        self._sink = sink

    def __call__(self, x: mx.array) -> mx.array:
        self._sink.append((x, self._ops.gate_logits(self.block, x)))
        return self.block(x)


def collect(model_dir: Path, tokens: list[int], config: TrainHeadsConfig):
    """Run the resident model over `tokens`; return (loaded model, traces per MoE layer)."""
    loaded = load(model_dir, EngineConfig(mode="resident"))
    ops = ops_for(loaded.family.router)
    sinks: dict[int, list] = {}
    for site in loaded.sites:
        sinks[site.layer] = []
        setattr(
            site.decoder_layer, site.block_attribute, _Capture(site.parent, ops, sinks[site.layer])
        )
    windows = [
        tokens[i : i + config.window]
        for i in range(0, len(tokens) - config.window + 1, config.window)
    ]
    if len(windows) < 2:
        raise Edge0Error(f"the text is too short: need at least {2 * config.window} tokens")
    xs = {layer: [] for layer in sinks}
    logits = {layer: [] for layer in sinks}
    for window in windows:
        loaded.model(mx.array(window)[None])
        for layer, sink in sinks.items():
            x, lg = sink.pop()
            mx.eval(x, lg)
            xs[layer].append(np.array(x[0].astype(mx.float32)))
            logits[layer].append(np.array(lg[0].astype(mx.float32)))
    for site in loaded.sites:  # put the stock blocks back
        setattr(site.decoder_layer, site.block_attribute, site.parent)
    traces = {
        layer: LayerTrace(np.stack(xs[layer]), np.stack(logits[layer])) for layer in sinks
    }  # [windows, T, H] and [windows, T, E]
    return loaded, traces


def top_k_sets(logits: np.ndarray, spec: RoutingSpec, k: int, bias: mx.array | None) -> np.ndarray:
    inds, _ = route(mx.array(logits), spec, k, bias)
    return np.array(inds)


def build_features(traces, owners, spec, biases, k, experts):
    """Features [owners, samples, H+2E] and targets [owners, samples, E], window by window."""
    features, targets = [], []
    for owner in owners:
        trace, nxt = traces[owner], traces[owner + 1]
        sets = top_k_sets(trace.logits, spec, k, biases[owner])  # [W, T, k]
        z = sequence_features(mx.array(trace.x), mx.array(sets), experts)
        z = np.array(z)[:, :-1]  # token t = 0 .. T-2
        features.append(z)
        targets.append(nxt.logits[:, 1:])  # layer N+1 at token t+1
    return np.stack(features), np.stack(targets)  # [n, W, T-1, D] / [n, W, T-1, E]


def init_heads(loaded, owners, k, inner, seed) -> PrerouterHeads:
    mx.random.seed(seed)
    hidden, experts = loaded.hidden, loaded.num_experts
    width = hidden + 2 * experts
    blocks = {site.layer: site.parent for site in loaded.sites}
    ops = ops_for(loaded.family.router)
    linear_init = []
    for owner in owners:
        w = router_weight(ops.router(blocks[owner + 1])).astype(mx.float32)  # [E, H]
        linear_init.append(mx.concatenate([w, mx.zeros((experts, 2 * experts))], axis=1))
    n = len(owners)
    fc1 = mx.random.normal((n, inner, width)) * (1.0 / math.sqrt(width))
    fc2 = mx.zeros((n, experts, inner))
    return PrerouterHeads(None, k, list(owners), hidden, experts, fc1, fc2, mx.stack(linear_init))


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


def recall_at_k(pred_logits, target_logits, spec, k, bias) -> float:
    pred = top_k_sets(pred_logits, spec, k, bias).reshape(-1, k)
    true = top_k_sets(target_logits, spec, k, bias).reshape(-1, k)
    hits = sum(len(set(p) & set(t)) for p, t in zip(pred.tolist(), true.tolist()))
    return hits / true.size


def train_heads(
    model_dir: str | Path,
    text: str,
    config: TrainHeadsConfig,
    out: Path | None = None,
    progress=print,
) -> tuple[Path, dict[int, float]]:
    """Train heads for K=config.k on `text`; save them; return (path, held-out recall@K per owner)."""
    model_dir = Path(model_dir)
    np.random.seed(config.seed)
    started = time.perf_counter()

    # -- 1. collect -------------------------------------------------------------------------------
    tokenizer = quiet_load_tokenizer(model_dir, None)
    tokens = corpus_tokens(tokenizer, text, config.max_tokens).tolist()
    loaded, traces = collect(model_dir, tokens, config)
    moe_layers = sorted(traces)
    start = config.start_layer if config.start_layer is not None else moe_layers[1]
    owners = [n for n in moe_layers if n + 1 in traces and n + 1 >= start]
    if not owners:
        raise Edge0Error(f"no owner layers: start layer {start} leaves no MoE layer to predict")
    if not 1 <= config.k <= loaded.num_experts:
        raise Edge0Error(f"K={config.k} must be between 1 and {loaded.num_experts}")
    blocks = {site.layer: site.parent for site in loaded.sites}
    ops = ops_for(loaded.family.router)
    spec = ops.spec(blocks[moe_layers[0]])
    biases = {layer: ops.expert_bias(blocks[layer]) for layer in moe_layers}
    progress(
        f"collected {len(tokens)} tokens over {len(moe_layers)} MoE layers in "
        f"{time.perf_counter() - started:.1f} s; training {len(owners)} heads (owners {owners[0]}..{owners[-1]})"
    )

    # -- 2. features -------------------------------------------------------------------------------
    z, y = build_features(traces, owners, spec, biases, config.k, loaded.num_experts)
    windows = z.shape[1]
    held = max(1, int(round(windows * config.holdout)))
    z_train = z[:, held:].reshape(len(owners), -1, z.shape[-1])
    y_train = y[:, held:].reshape(len(owners), -1, y.shape[-1])
    z_test, y_test = z[:, :held], y[:, :held]

    # -- 3. train ----------------------------------------------------------------------------------
    heads = init_heads(loaded, owners, config.k, config.inner, config.seed)
    params = {"fc1": heads.fc1, "fc2": heads.fc2, "linear_init": heads.linear_init}

    def forward(p, zb):
        return head_forward(p["fc1"], p["fc2"], p["linear_init"], zb)

    def loss_fn(p, zb, yb):
        pred = forward(p, zb)
        soft = -(mx.softmax(yb, axis=-1) * nn.log_softmax(pred, axis=-1)).sum(-1).mean()
        return soft + config.mse_weight * ((pred - yb) ** 2).mean()

    optimizer = optim.AdamW(learning_rate=config.lr, weight_decay=config.weight_decay)
    grad_fn = mx.value_and_grad(loss_fn)
    samples = z_train.shape[1]
    for step in range(1, config.steps + 1):
        idx = mx.array(np.random.randint(0, samples, size=min(config.batch, samples)))
        loss, grads = grad_fn(params, mx.array(z_train)[:, idx], mx.array(y_train)[:, idx])
        optimizer.update(params, grads)
        mx.eval(params, optimizer.state, loss)
        if step == 1 or step % max(1, config.steps // 10) == 0 or step == config.steps:
            progress(f"step {step}/{config.steps}  loss {loss.item():.4f}")
    heads.fc1, heads.fc2, heads.linear_init = params["fc1"], params["fc2"], params["linear_init"]

    # -- 4. evaluate and save ------------------------------------------------------------------------
    pred = np.array(forward(params, mx.array(z_test.reshape(len(owners), -1, z.shape[-1]))))
    recalls = {}
    for i, owner in enumerate(owners):
        target = y_test[i].reshape(-1, y.shape[-1])
        recalls[owner] = recall_at_k(pred[i], target, spec, config.k, biases[owner + 1])
    chance = config.k / loaded.num_experts
    for owner, r in recalls.items():
        progress(
            f"  head of layer {owner:3d} -> layer {owner + 1:3d}: held-out recall@{config.k} {r:.3f}"
        )
    progress(f"mean recall@{config.k} {np.mean(list(recalls.values())):.3f} (chance {chance:.3f})")
    out = out or model_dir / f"prerouter_k{config.k}.safetensors"
    save_prerouter(out, heads, start, base_fingerprint(loaded.index))
    progress(f"wrote {out}")
    return out, recalls

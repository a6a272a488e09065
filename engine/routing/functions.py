"""Routing functions: router (or prerouter) logits in, expert indices and combine weights out.

One implementation per kind of router, used alike by the true router (gate logits) and by the
prerouter (predicted logits), so a prediction routes through exactly the function the layer's own
router would. Each mirrors its families' mlx-lm gate code operation for operation (the order the
indices come out in too: it is the order the experts' outputs are summed in), which the tests
check on random logits.

- `score_topk` (Qwen3-MoE, Qwen3-Next, Qwen3.5, Qwen2-MoE, OLMoE, ERNIE-4.5): softmax (or sigmoid)
  over every expert, top-k, weights optionally renormalized over the k.
- `topk_softmax` (Mixtral, gpt-oss): top-k of the logits, softmax over the k.
- `topk_sigmoid` (Llama-4): top-k of the logits, each weight the sigmoid of its logit (Llama-4
  scales the expert's input by it, see `routing.moe_block`).
- `group_topk` (Ling / Bailing, DeepSeek-V3, Kimi-K2, GLM-4.5, MiniMax-M2): sigmoid (or softmax)
  scores; the expert bias is added for *selection only*; groups ranked by the sum of their top-2
  scores, all but `topk_group` groups masked; top-k; weights are the unbiased scores,
  renormalized, times the routed scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class RoutingSpec:
    """The routing function of one model, read from its MoE blocks."""

    kind: str  # softmax-topk, topk-softmax, topk-sigmoid or group-topk
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    score_function: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 1  # group-topk only
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # How the family's code takes the top k, which fixes the order of the indices:
    # "high": argpartition(s, -k)[..., -k:] (Qwen3, Bailing, gpt-oss);
    # "negated": argpartition(-s, k - 1)[..., :k] (the others).
    pick: str = "high"
    # Renormalization: the denominator's epsilon (Bailing, MiniMax: 1e-20), or its floor (ERNIE:
    # max(sum, 1e-12)); MiniMax renormalizes even a single expert.
    norm_epsilon: float = 0.0
    norm_floor: float = 0.0
    norm_single: bool = False
    # The family casts the weights back to the logits' dtype (on CPU everything is float32).
    weights_in_logits_dtype: bool = True


def _pick(scores: mx.array, k: int, pick: str) -> mx.array:
    if pick == "high":
        return mx.stop_gradient(mx.argpartition(scores, kth=-k, axis=-1)[..., -k:])
    return mx.stop_gradient(mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k])


def _renormalize(weights: mx.array, spec: RoutingSpec) -> mx.array:
    total = weights.sum(axis=-1, keepdims=True)
    if spec.norm_floor:
        return weights / mx.maximum(total, spec.norm_floor)
    if spec.norm_epsilon:
        return weights / (total + spec.norm_epsilon)
    return weights / total


def score_topk(logits: mx.array, spec: RoutingSpec, k: int) -> tuple[mx.array, mx.array]:
    if spec.score_function == "sigmoid":
        gates = mx.sigmoid(logits.astype(mx.float32))
    elif spec.norm_floor:  # ERNIE: softmax of float32 logits
        gates = mx.softmax(logits.astype(mx.float32), axis=-1)
    else:
        gates = mx.softmax(logits, axis=-1, precise=True)
    inds = _pick(gates, k, spec.pick)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if spec.norm_topk_prob:
        scores = _renormalize(scores, spec)
    return inds, scores


def topk_softmax(logits: mx.array, spec: RoutingSpec, k: int) -> tuple[mx.array, mx.array]:
    inds = _pick(logits, k, spec.pick)
    scores = mx.take_along_axis(logits, inds, axis=-1)
    return inds, mx.softmax(scores, axis=-1, precise=True)


def topk_sigmoid(logits: mx.array, spec: RoutingSpec, k: int) -> tuple[mx.array, mx.array]:
    inds = _pick(logits, k, spec.pick)
    scores = mx.take_along_axis(logits, inds, axis=-1)
    return inds, mx.sigmoid(scores.astype(mx.float32)).astype(logits.dtype)


def group_topk(
    logits: mx.array, spec: RoutingSpec, k: int, expert_bias: mx.array | None
) -> tuple[mx.array, mx.array]:
    in_type = logits.dtype
    if spec.score_function == "sigmoid":
        scores = mx.sigmoid(logits.astype(mx.float32))
    else:
        scores = mx.softmax(logits.astype(mx.float32), axis=-1)
    unbiased = scores
    if expert_bias is not None:
        scores = scores + expert_bias
    if spec.n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(spec.n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = spec.n_group - spec.topk_group
        group_idx = mx.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        scores = mx.put_along_axis(
            scores, mx.stop_gradient(group_idx), mx.array(0.0, scores.dtype), axis=-2
        )
        scores = mx.flatten(scores, -2, -1)
    inds = _pick(scores, k, spec.pick)
    weights = mx.take_along_axis(unbiased, inds, axis=-1)
    if spec.norm_topk_prob and (k > 1 or spec.norm_single):
        weights = _renormalize(weights, spec)
    if spec.routed_scaling_factor != 1.0:  # MiniMax has none
        weights = weights * spec.routed_scaling_factor
    return inds, weights.astype(in_type) if spec.weights_in_logits_dtype else weights


def route(
    logits: mx.array, spec: RoutingSpec, k: int, expert_bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Expert indices `[..., k]` and combine weights `[..., k]` for router logits `[..., E]`."""
    if spec.kind == "softmax-topk":
        return score_topk(logits, spec, k)
    if spec.kind == "topk-softmax":
        return topk_softmax(logits, spec, k)
    if spec.kind == "topk-sigmoid":
        return topk_sigmoid(logits, spec, k)
    return group_topk(logits, spec, k, expert_bias)

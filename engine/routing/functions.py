"""Routing functions: router (or prerouter) logits in, expert indices and combine weights out.

One implementation per family kind, used alike by the true router (gate logits) and by the
prerouter (predicted logits), so a prediction routes through exactly the function the layer's own
router would. Each mirrors the family's mlx-lm gate code operation for operation, which the tests
check on random logits.

- `softmax_topk` (Qwen3-MoE, Qwen3-Next, Qwen3.5): precise softmax, top-k by argpartition,
  weights renormalized over the k.
- `group_topk` (Ling / Bailing, DeepSeek-V3 style): sigmoid (or softmax) scores; the expert bias is
  added for *selection only*; groups ranked by the sum of their top-2 scores, all but `topk_group`
  groups masked; top-k; weights are the unbiased scores, renormalized, times the routed scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class RoutingSpec:
    """The routing function of one model, read from its config."""

    kind: str  # "softmax-topk" | "group-topk"
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    score_function: str = "softmax"  # group-topk only: "sigmoid" | "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def softmax_topk(logits: mx.array, k: int, norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


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
    inds = mx.stop_gradient(mx.argpartition(scores, kth=-k, axis=-1)[..., -k:])
    weights = mx.take_along_axis(unbiased, inds, axis=-1)
    if k > 1 and spec.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    weights = weights * spec.routed_scaling_factor
    return inds, weights.astype(in_type)


def route(
    logits: mx.array, spec: RoutingSpec, k: int, expert_bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Expert indices `[..., k]` and combine weights `[..., k]` for router logits `[..., E]`."""
    if spec.kind == "softmax-topk":
        return softmax_topk(logits, k, spec.norm_topk_prob)
    return group_topk(logits, spec, k, expert_bias)

"""The engine's routing functions equal each family's own gate code, on random logits."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3_moe, qwen3_next
from mlx_lm.models.bailing_moe import group_expert_select

from engine.routing.functions import RoutingSpec, route

E = 32


class _Identity(nn.Module):
    def __call__(self, x):
        return x


class _OneHotExperts(nn.Module):
    """Stands in for the experts: expert e's output is the unit vector e, so the block's combined
    output is the dense vector of combine weights, indexed by expert."""

    def __call__(self, x, indices):
        return mx.eye(E)[indices]


class _Zero(nn.Module):
    def __call__(self, x):
        return mx.zeros_like(x)


def _dense(inds: mx.array, weights: mx.array) -> np.ndarray:
    return np.array(((mx.eye(E)[inds]) * weights[..., None]).sum(axis=-2))


def _qwen_block(module, k: int, norm: bool):
    args = SimpleNamespace(
        hidden_size=E,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=E,
        num_experts_per_tok=k,
        norm_topk_prob=norm,
    )
    cls = module.Qwen3MoeSparseMoeBlock if module is qwen3_moe else module.Qwen3NextSparseMoeBlock
    block = cls(args)
    block.gate = _Identity()  # the logits are the input
    block.switch_mlp = _OneHotExperts()
    if module is qwen3_next:
        block.shared_expert = _Zero()
    return block


@pytest.mark.parametrize("module", [qwen3_moe, qwen3_next], ids=["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("k, norm", [(2, True), (4, True), (8, False)])
def test_softmax_topk_matches_qwen_gates(module, k, norm):
    mx.random.seed(k)
    logits = mx.random.normal((1, 16, E)) * 3
    family = np.array(_qwen_block(module, k, norm)(logits))
    inds, weights = route(logits, RoutingSpec("softmax-topk", E, k, norm), k)
    np.testing.assert_array_equal(_dense(inds, weights), family)


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2), (8, 4)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("k", [2, 6])
def test_group_topk_matches_bailing_gate(score_function, n_group, topk_group, with_bias, k):
    mx.random.seed(n_group * 10 + k)
    logits = mx.random.normal((1, 16, E)) * 2
    bias = mx.random.normal((E,)) * 0.1 if with_bias else None
    spec = RoutingSpec("group-topk", E, k, True, score_function, n_group, topk_group, 2.5)
    ours = route(logits, spec, k, bias)
    family = group_expert_select(logits, bias, k, n_group, topk_group, 2.5, True, score_function)
    np.testing.assert_array_equal(_dense(*ours), _dense(*family))


def test_bias_selects_but_does_not_weigh():
    logits = mx.zeros((1, 1, E))
    bias = mx.zeros((E,)).at[5].add(1.0)
    spec = RoutingSpec("group-topk", E, 1, True, "sigmoid", 1, 1, 1.0)
    inds, weights = route(logits, spec, 1, bias)
    assert inds.item() == 5
    assert weights.item() == pytest.approx(0.5)  # sigmoid(0), the unbiased score

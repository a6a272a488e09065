"""The engine's routing functions equal each family's own gate code, on random logits."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3_moe, qwen3_next
from mlx_lm.models.bailing_moe import group_expert_select

from engine.errors import Edge0Error
from engine.routing.functions import RoutingSpec, route
from engine.routing.moe_block import FAMILY_OPS

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


# -- every family with the engine's routing: its own block, run with identity routers -------------


class _Recorder(nn.Module):
    """Stands in for the experts: records what the block passed, returns one-hot rows per expert."""

    def __call__(self, x, indices):
        self.inputs, self.indices = x, indices
        return mx.eye(E)[indices]


def _args(**fields) -> SimpleNamespace:
    base = dict(
        hidden_size=E,
        intermediate_size=64,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=E,
        num_local_experts=E,
        n_routed_experts=E,
        moe_num_experts=E,
        norm_topk_prob=True,
        mlp_bias=False,
        use_bias=False,
        moe_num_shared_experts=0,
        n_shared_experts=None,
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
    )
    return SimpleNamespace(**{**base, **fields})


def _block(family: str, k: int, variant: str):
    """The family's mlx-lm MoE block whose router outputs its input (hidden = E), with recording
    experts and no shared expert, and a random correction bias where the family has one."""
    from mlx_lm.models import (
        deepseek_v3,
        ernie4_5_moe,
        glm4_moe,
        gpt_oss,
        llama4,
        minimax,
        mixtral,
        olmoe,
        qwen2_moe,
    )

    bias = mx.random.normal((E,)) * 0.1
    if family == "qwen2_moe":
        block = qwen2_moe.Qwen2MoeSparseMoeBlock(_args(num_experts_per_tok=k))
        block.shared_expert = _Zero()
    elif family == "olmoe":
        block = olmoe.OlmoeSparseMoeBlock(
            _args(num_experts_per_tok=k, norm_topk_prob=variant == "norm")
        )
    elif family == "ernie4_5_moe":
        block = ernie4_5_moe.Ernie4_5_MoeMLP(_args(moe_k=k, moe_gate_act=variant))
    elif family == "mixtral":
        block = mixtral.MixtralSparseMoeBlock(_args(num_experts_per_tok=k))
    elif family == "gpt_oss":
        block = gpt_oss.MLPBlock(_args(num_experts_per_tok=k))
        block.router = _Identity()
    elif family == "llama4":
        block = llama4.MoE(_args(num_experts_per_tok=1))
        block.router = _Identity()
        block.shared_expert = _Zero()
    elif family == "minimax":
        block = minimax.MiniMaxSparseMoeBlock(_args(num_experts_per_tok=k))
        block.e_score_correction_bias = bias
    else:  # deepseek_v3, glm4_moe: a MoEGate with a raw weight and a correction bias
        module = deepseek_v3 if family == "deepseek_v3" else glm4_moe
        groups = {"groups": (4, 2), "flat": (1, 1)}[variant]
        args = _args(num_experts_per_tok=k, n_group=groups[0], topk_group=groups[1])
        cls = module.DeepseekV3MoE if module is deepseek_v3 else module.MoE
        block = cls(args)
        block.gate.weight = mx.eye(E)
        block.gate.e_score_correction_bias = bias
    if "gate" in block and isinstance(block.gate, nn.Linear):
        block.gate.weight = mx.eye(E)  # the logits are the input, exactly
    ops = FAMILY_OPS[family]
    block[ops.experts] = _Recorder()
    ops.set_top_k(block, k)  # also checks that the ops put K where the block reads it
    return block, ops


FAMILY_CASES = [
    ("qwen2_moe", "plain"),
    ("olmoe", "norm"),
    ("olmoe", "plain"),
    ("ernie4_5_moe", "softmax"),
    ("ernie4_5_moe", "sigmoid"),
    ("mixtral", "plain"),
    ("gpt_oss", "plain"),
    ("minimax", "plain"),
    ("deepseek_v3", "groups"),
    ("deepseek_v3", "flat"),
    ("glm4_moe", "groups"),
]


@pytest.mark.parametrize("family, variant", FAMILY_CASES)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_family_routing_matches_the_family_block(family, variant, k):
    """Indices in the family's order (the order its experts' outputs are summed in) and combine
    weights, bit for bit, from the engine's routing of the block's own router logits."""
    mx.random.seed(k * 7 + len(family))
    block, ops = _block(family, k, variant)
    logits = mx.random.normal((1, 16, E)) * 2.5
    combined = np.array(block(logits))
    inds, weights = route(logits, ops.spec(block), k, ops.expert_bias(block))
    recorded = block[ops.experts].indices
    np.testing.assert_array_equal(np.array(inds).reshape(-1, k), np.array(recorded).reshape(-1, k))
    np.testing.assert_array_equal(_dense(inds, weights).reshape(combined.shape), combined)
    # and the engine's combine of the same one-hot expert outputs gives the block's output
    ours = ops.combine(block, logits, mx.eye(E)[inds], weights)
    np.testing.assert_array_equal(np.array(ours).reshape(combined.shape), combined)


def test_llama4_routing_scales_the_expert_input():
    mx.random.seed(3)
    block, ops = _block("llama4", 1, "plain")
    x = mx.random.normal((1, 16, E)) * 2.5
    combined = np.array(block(x))
    inds, weights = route(x, ops.spec(block), 1)
    recorder = block.experts
    np.testing.assert_array_equal(np.array(inds), np.array(recorder.indices))
    np.testing.assert_array_equal(np.array(ops.expert_input(block, x, weights)), recorder.inputs)
    ours = ops.combine(block, x, mx.eye(E)[inds], weights)
    np.testing.assert_array_equal(np.array(ours), combined)
    with pytest.raises(Edge0Error, match="K=1"):
        ops.set_top_k(block, 2)

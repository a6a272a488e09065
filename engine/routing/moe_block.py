"""`RoutedMoE`: a family's MoE block with routing done by the engine.

It adopts the original block's children under the same names (`gate`, `switch_mlp`,
`shared_expert`, ...), so module paths, LoRA targets and parameters are unchanged. Per call it:
1. routes: from the block's own gate logits (true router), or, for a consumer layer at decode, from
   the prerouter's prediction made one token earlier: the prediction *is* the routing;
2. runs the routed experts (streamed) with the routing's indices;
3. combines them as the family does (weighted sum, shared expert).
Owner layers hand their MoE input and executed experts to the `RoutingState` for the next head flush.

What differs between families' blocks (where the router is, how its logits are routed, where K
lives, how the experts' outputs are combined) is a `FamilyOps` class below, one per family kind,
each written from the family's mlx-lm `__call__` and checked against it (tests/test_routing.py,
and the parity suite end to end).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint.families import Family
from ..errors import Edge0Error
from ..experts.switch_glu import StreamingSwitchGLU
from .functions import RoutingSpec, route


def _weighted_sum(y: mx.array, weights: mx.array) -> mx.array:
    return (y * weights[..., None]).sum(axis=-2)


def _with_shared_experts(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array):
    """The weighted sum in the experts' dtype plus ungated shared experts where the block has
    them (Bailing, DeepSeek-V3, GLM-4.5, ERNIE: mlx-lm's blocks all compute exactly this)."""
    y = _weighted_sum(y, weights).astype(y.dtype)
    if block.get("shared_experts") is not None:
        y = y + block.shared_experts(x)
    return y


class FamilyOps:
    """The Qwen3-MoE block (softmax top-k, k on the block as `top_k`); the other families
    override what differs."""

    experts = "switch_mlp"  # the block attribute holding the routed experts

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec("softmax-topk", block.num_experts, block.top_k, block.norm_topk_prob)

    @staticmethod
    def router(block: nn.Module) -> nn.Module:
        """The module whose `weight` [E, H] maps the MoE input to router logits."""
        return block.gate

    @classmethod
    def gate_logits(cls, block: nn.Module, x: mx.array) -> mx.array:
        return cls.router(block)(x)

    @staticmethod
    def expert_bias(block: nn.Module) -> mx.array | None:
        return None

    @staticmethod
    def set_top_k(block: nn.Module, k: int) -> None:
        """Make the family's own block (resident mode) route to `k` experts."""
        block.top_k = k

    @staticmethod
    def expert_input(block: nn.Module, x: mx.array, weights: mx.array) -> mx.array:
        return x

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        return _weighted_sum(y, weights).astype(y.dtype)


class QwenOps(FamilyOps):
    """Qwen3-MoE, Qwen3-Next, Qwen3.5 (a sigmoid-gated shared expert in the last two)."""

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        if "shared_expert" in block:
            y = _weighted_sum(y, weights)
            return y + mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return _weighted_sum(y, weights).astype(y.dtype)


class Qwen2Ops(QwenOps):
    """Qwen2-MoE / Qwen1.5-MoE: softmax top-k without renormalization, gated shared expert."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec("softmax-topk", block.num_experts, block.top_k, False, pick="negated")


class OlmoeOps(FamilyOps):
    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec(
            "softmax-topk", block.num_experts, block.top_k, block.norm_topk_prob, pick="negated"
        )

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        return _weighted_sum(y, weights)


class ErnieOps(FamilyOps):
    """ERNIE-4.5-MoE: softmax or sigmoid gate in float32, top-k, renormalized, shared experts."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        score = "sigmoid" if isinstance(block.gate_act, nn.Sigmoid) else "softmax"
        experts = block.gate.weight.shape[0]
        return RoutingSpec(
            "softmax-topk", experts, block.k, True, score, pick="negated", norm_floor=1e-12
        )

    @staticmethod
    def set_top_k(block: nn.Module, k: int) -> None:
        block.k = k

    combine = staticmethod(_with_shared_experts)


class MixtralOps(FamilyOps):
    """Mixtral: top-k of the logits, softmax over the k."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec(
            "topk-softmax", block.num_experts, block.num_experts_per_tok, pick="negated"
        )

    @staticmethod
    def set_top_k(block: nn.Module, k: int) -> None:
        block.num_experts_per_tok = k

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        return _weighted_sum(y, weights)


class GptOssOps(MixtralOps):
    """gpt-oss: a biased router at `mlp.router`, experts (with biases) at `mlp.experts`."""

    experts = "experts"

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec("topk-softmax", block.num_local_experts, block.num_experts_per_tok)

    @staticmethod
    def router(block: nn.Module) -> nn.Module:
        return block.router


class Llama4Ops(FamilyOps):
    """Llama-4: top-1 by logit, the expert's *input* scaled by the sigmoid of its logit, plus an
    ungated shared expert. mlx-lm's block supports only K=1 (its input scaling has one score)."""

    experts = "experts"

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec("topk-sigmoid", block.num_experts, block.top_k, pick="negated")

    @staticmethod
    def router(block: nn.Module) -> nn.Module:
        return block.router

    @staticmethod
    def set_top_k(block: nn.Module, k: int) -> None:
        if k != 1:
            raise Edge0Error("llama4 routes to exactly one expert per token (K=1)")

    @staticmethod
    def expert_input(block: nn.Module, x: mx.array, weights: mx.array) -> mx.array:
        return x * weights

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        return y.squeeze(-2) + block.shared_expert(x)


class BailingOps(FamilyOps):
    """Ling / Bailing-MoE (group top-k with expert bias; ungated shared experts)."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        gate = block.gate
        return RoutingSpec(
            "group-topk",
            gate.gate_proj.weight.shape[0],
            gate.top_k,
            gate.norm_topk_prob,
            gate.score_function,
            gate.n_group,
            gate.topk_group,
            gate.routed_scaling_factor,
            norm_epsilon=1e-20,
        )

    @staticmethod
    def router(block: nn.Module) -> nn.Module:
        """The linear layer whose output is the router logits (the bias is added in routing)."""
        return block.gate.gate_proj

    @staticmethod
    def expert_bias(block: nn.Module) -> mx.array | None:
        return block.gate.expert_bias

    @staticmethod
    def set_top_k(block: nn.Module, k: int) -> None:
        block.gate.top_k = k
        block.num_experts_per_tok = k

    combine = staticmethod(_with_shared_experts)


class DeepseekOps(FamilyOps):
    """DeepSeek-V3 / Kimi-K2 and GLM-4.5 (the same `MoEGate`: a raw `weight`, sigmoid group
    top-k with a correction bias and routed scaling; ungated shared experts)."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        gate = block.gate
        return RoutingSpec(
            "group-topk",
            gate.n_routed_experts,
            gate.top_k,
            gate.norm_topk_prob,
            "sigmoid",
            gate.n_group,
            gate.topk_group,
            gate.routed_scaling_factor,
            pick="negated",
            weights_in_logits_dtype=False,
        )

    @classmethod
    def gate_logits(cls, block: nn.Module, x: mx.array) -> mx.array:
        return x @ block.gate.weight.T

    @staticmethod
    def expert_bias(block: nn.Module) -> mx.array | None:
        return block.gate.e_score_correction_bias

    set_top_k = BailingOps.set_top_k  # K lives on the gate and the block alike

    combine = staticmethod(_with_shared_experts)


class MiniMaxOps(FamilyOps):
    """MiniMax-M2: sigmoid scores of a float32 router, a correction bias for selection, top-k,
    renormalized (even one expert), no groups, no scaling."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        experts = block.gate.weight.shape[0]
        return RoutingSpec(
            "group-topk",
            experts,
            block.num_experts_per_tok,
            True,
            "sigmoid",
            pick="negated",
            norm_epsilon=1e-20,
            norm_single=True,
            weights_in_logits_dtype=False,
        )

    @classmethod
    def gate_logits(cls, block: nn.Module, x: mx.array) -> mx.array:
        return block.gate(x.astype(mx.float32))

    @staticmethod
    def expert_bias(block: nn.Module) -> mx.array | None:
        return block.e_score_correction_bias

    @staticmethod
    def set_top_k(block: nn.Module, k: int) -> None:
        block.num_experts_per_tok = k

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        return _weighted_sum(y, weights.astype(x.dtype))


# Family name (mlx-lm architecture) -> its ops. A family not here streams on demand with its own
# block's routing (see `checkpoint.families`), without K profiles or the prerouter.
FAMILY_OPS: dict[str, type[FamilyOps]] = {
    "qwen3_moe": QwenOps,
    "qwen3_next": QwenOps,
    "qwen3_5_moe": QwenOps,
    "qwen2_moe": Qwen2Ops,
    "olmoe": OlmoeOps,
    "ernie4_5_moe": ErnieOps,
    "mixtral": MixtralOps,
    "gpt_oss": GptOssOps,
    "llama4": Llama4Ops,
    "bailing_moe": BailingOps,
    "deepseek_v3": DeepseekOps,
    "glm4_moe": DeepseekOps,
    "minimax": MiniMaxOps,
}


def ops_for(family: str) -> type[FamilyOps]:
    ops = FAMILY_OPS.get(family)
    if ops is None:
        raise Edge0Error(
            f"{family}: edge0 streams this family on demand with its own router, but has no "
            "routing function for it, so no K profiles, prerouter or prefetch"
        )
    return ops


def set_top_k(family: Family, block: nn.Module, k: int) -> None:
    """Make a family's own MoE block (resident mode) route to `k` experts."""
    if family.routing:  # else K is always the native one
        ops_for(family.name).set_top_k(block, k)


class RoutedMoE(nn.Module):
    def __init__(self, block: nn.Module, layer: int, ops: type[FamilyOps], state) -> None:
        super().__init__()
        for name, value in block.items():  # modules and arrays (MiniMax's correction bias)
            setattr(self, name, value)
        # Plain attributes, not parameters.
        self._layer = layer
        self._ops = ops
        self._state = state
        self.routing_spec = ops.spec(block)

    @property
    def layer(self) -> int:
        return self._layer

    @property
    def routed_experts(self) -> nn.Module:
        """The (streamed) experts module, whatever the family calls it (`switch_mlp`, `experts`)."""
        return self[self._ops.experts]

    def gate_logits(self, x: mx.array) -> mx.array:
        return self._ops.gate_logits(self, x)

    def expert_bias(self) -> mx.array | None:
        return self._ops.expert_bias(self)

    def __call__(self, x: mx.array) -> mx.array:
        with self._state.tracer.span(f"layer {self._layer}", "layer"):
            return self._route_and_run(x)

    def _route_and_run(self, x: mx.array) -> mx.array:
        """Route, find the experts' slots, compute, combine: one MoE layer, top to bottom."""
        state, ops, experts = self._state, self._ops, self.routed_experts
        # 1. Route: by the previous step's prediction (a consumer at decode: the prediction is
        #    the routing; `host` is it on the host where it was read, for the reads ahead), or by
        #    the block's own router.
        one_position = x.shape[-2] == 1  # a decode step: one position a sequence
        prediction = state.prediction_for(self._layer) if one_position else None
        if prediction is not None:
            host, predicted, weights = prediction
            indices = predicted.reshape(x.shape[:-1] + (-1,))
            weights = weights.reshape(indices.shape)
            host = host.reshape(indices.shape) if host is not None else None
        else:
            logits = self.gate_logits(x)
            indices, weights = route(logits, self.routing_spec, state.k, self.expert_bias())
            host = None
        inputs = ops.expert_input(self, x, weights)
        # 2. The experts' slots (reading what is missing), then 3. their outputs.
        if isinstance(experts, StreamingSwitchGLU):
            slots, routed = experts.store.layer_slots(self._layer, indices, host)
            y = experts.compute(inputs, routed, slots)
            if experts.store.share is not None:  # this rank's experts' outputs, then every rank's
                y = experts.store.share.combined(y, indices)
        else:  # resident experts (training): the routing stays on the device
            y, routed = experts(inputs, indices), indices
        if prediction is not None:
            state.consumed(self, x, indices, host)
        # 4. Combine as the family does.
        y = ops.combine(self, x, y, weights)
        if one_position:
            # The next layers' graph is built while this one computes (and reads land). Every
            # layer is submitted, so the store knows that draining the stream computes every
            # layer before the one it is fetching for (`ExpertPool.slot_for_miss`).
            mx.async_eval(y)
            state.tracer.instant(f"submit {self._layer}", "compute")
        state.executed(self._layer, x, routed)
        return y

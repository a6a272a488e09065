"""`RoutedMoE`: a family's MoE block with routing done by the engine.

It adopts the original block's children under the same names (`gate`, `switch_mlp`,
`shared_expert`, ...), so module paths, LoRA targets and parameters are unchanged. Per call it:
1. routes: from the block's own gate logits (true router), or, for a consumer layer at decode, from
   the prerouter's prediction made one token earlier: the prediction *is* the routing;
2. runs the routed experts (streamed) with the routing's indices;
3. combines them as the family does (weighted sum, shared expert).
Owner layers hand their MoE input and executed experts to the `RoutingState` for the next head flush.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.bailing_moe import aggregate_expert_outputs

from .functions import RoutingSpec, route


class FamilyOps:
    """What differs between families' MoE blocks; subclasses say where the router is and how the
    experts are combined."""

    @classmethod
    def gate_logits(cls, block: nn.Module, x: mx.array) -> mx.array:
        return cls.router(block)(x)


class QwenOps(FamilyOps):
    """Qwen3-MoE, Qwen3-Next and Qwen3.5 blocks (softmax top-k; optional gated shared expert)."""

    @staticmethod
    def spec(block: nn.Module) -> RoutingSpec:
        return RoutingSpec("softmax-topk", block.num_experts, block.top_k, block.norm_topk_prob)

    @staticmethod
    def router(block: nn.Module) -> nn.Module:
        """The linear layer whose output is the router logits."""
        return block.gate

    @staticmethod
    def expert_bias(block: nn.Module) -> mx.array | None:
        return None

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        if "shared_expert" in block:  # Qwen3-Next / Qwen3.5
            y = (y * weights[..., None]).sum(axis=-2)
            return y + mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        return (y * weights[..., None]).sum(axis=-2).astype(y.dtype)


class BailingOps(FamilyOps):
    """Ling / Bailing-MoE blocks (group top-k with expert bias; ungated shared experts)."""

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
        )

    @staticmethod
    def router(block: nn.Module) -> nn.Module:
        """The linear layer whose output is the router logits (the bias is added in routing)."""
        return block.gate.gate_proj

    @staticmethod
    def expert_bias(block: nn.Module) -> mx.array | None:
        return block.gate.expert_bias

    @staticmethod
    def combine(block: nn.Module, x: mx.array, y: mx.array, weights: mx.array) -> mx.array:
        y = aggregate_expert_outputs(y, weights)
        if block.get("shared_experts") is not None:
            y = y + block.shared_experts(x)
        return y


def ops_for(family_router: str) -> type[FamilyOps]:
    return QwenOps if family_router == "softmax-topk" else BailingOps


class RoutedMoE(nn.Module):
    def __init__(self, block: nn.Module, layer: int, ops, state) -> None:
        super().__init__()
        for name, child in block.children().items():
            setattr(self, name, child)
        # Plain attributes, not parameters.
        self._layer = layer
        self._ops = ops
        self._state = state
        self.routing_spec = ops.spec(block)

    @property
    def layer(self) -> int:
        return self._layer

    def gate_logits(self, x: mx.array) -> mx.array:
        return self._ops.gate_logits(self, x)

    def expert_bias(self) -> mx.array | None:
        return self._ops.expert_bias(self)

    def __call__(self, x: mx.array) -> mx.array:
        with self._state.tracer.span(f"layer {self._layer}", "layer"):
            return self._route_and_run(x)

    def _route_and_run(self, x: mx.array) -> mx.array:
        state = self._state
        tokens = x.size // x.shape[-1]
        prediction = state.prediction_for(self._layer) if tokens == 1 else None
        if prediction is not None:
            routed, weights = prediction
            indices = mx.array(routed.reshape(x.shape[:-1] + (-1,)))
            y = self.switch_mlp(x, indices, routed=routed.reshape(indices.shape))
            state.consumed(self, x, routed)
        else:
            logits = self.gate_logits(x)
            indices, weights = route(logits, self.routing_spec, state.k, self.expert_bias())
            y = self.switch_mlp(x, indices)
            routed = getattr(self.switch_mlp, "last_routed", None)
            if routed is None:  # resident experts (training): the routing is read back here
                routed = np.array(indices)
        y = self._ops.combine(self, x, y, weights)
        state.executed(self._layer, x, routed)
        if prediction is not None:
            # The next layers' graph is built while this one computes (and reads land).
            mx.async_eval(y)
            state.tracer.instant(f"submit {self._layer}", "compute")
        return y

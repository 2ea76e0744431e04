"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biases on q, k, v by
qkv_bias, none on o_proj; a window on the layers layer_types marks sliding) with Qwen3-MoE's
layout of sparse and dense layers, and in each sparse block a shared expert every token goes
through, scaled by sigmoid(shared_expert_gate . x)."""

from __future__ import annotations

import torch

from tpserve.layers.linear import ReplicatedLinear
from tpserve.layers.moe import SparseMoE, refuse_quantized_router
from tpserve.models.llama import GatedMLP
from tpserve.models.qwen2 import Qwen2ForCausalLM
from tpserve.models.qwen3_moe import Qwen3MoeForCausalLM, expert_args


class SharedExpertMoE(SparseMoE):
    """The routed experts plus the shared one, split across the ranks as a GatedMLP is. Its
    down projection's partial sums, scaled per token by the replicated gate, join the
    experts' before the block's one all-reduce (sigmoid(g) * sum of partials = sum of
    sigmoid(g) * partials)."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__(**expert_args(config, prefix))
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                      config.hidden_act, f"{prefix}.shared_expert")
        refuse_quantized_router(f"{prefix}.shared_expert_gate")
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.shared_expert
        shared = mlp.down_proj.partial(mlp.act.project(mlp.gate_up_proj, x))
        return super().partial(x) + torch.sigmoid(self.shared_expert_gate(x)) * shared


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    family = "Qwen2-MoE"
    sliding_window = staticmethod(Qwen2ForCausalLM.sliding_window)

    @staticmethod
    def attention_kwargs(config) -> dict:
        return {"qkv_bias": bool(getattr(config, "qkv_bias", True)), "o_bias": False}

    @staticmethod
    def sparse_block(config, prefix: str) -> SparseMoE:
        return SharedExpertMoE(config, prefix)

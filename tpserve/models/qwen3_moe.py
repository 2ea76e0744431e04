"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (an RMSNorm over each head's
query and key; biases on q, k, v and o only with attention_bias) and, on the layers
transformers makes sparse (models/experts.is_sparse_layer), a sparse block of experts
(layers/moe.py) of moe_intermediate_size each; the other layers keep a gated MLP of
intermediate_size. Routing: top num_experts_per_tok of num_experts, renormalised when
norm_topk_prob. With use_sliding_window the window covers every layer: transformers gives this
family no layer_types (dense Qwen3 has them)."""

from __future__ import annotations

from tpserve.layers.moe import SparseMoE
from tpserve.models.experts import ExpertTensors, is_sparse_layer
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def expert_args(config, prefix: str) -> dict:
    """SparseMoE's arguments for a Qwen MoE config; prefix: the block's ("....mlp")."""
    return dict(hidden=config.hidden_size, intermediate=config.moe_intermediate_size,
                num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                act=config.hidden_act, prefix=prefix,
                renormalize=bool(getattr(config, "norm_topk_prob", False)), names=EXPERT_NAMES)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    family = "Qwen3-MoE"

    @staticmethod
    def attention_kwargs(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": 0.0}

    @staticmethod
    def sparse_block(config, prefix: str) -> SparseMoE:
        return SparseMoE(**expert_args(config, prefix))

    @classmethod
    def model_kwargs(cls, config) -> dict:
        attention = cls.attention_kwargs(config)

        def make_layer(config, i, prefix, max_positions, window):
            mlp = cls.sparse_block(config, f"{prefix}.mlp") if is_sparse_layer(config, i) \
                else None  # LlamaDecoderLayer's GatedMLP of intermediate_size
            return LlamaDecoderLayer(config, i, prefix, max_positions, window, mlp=mlp,
                                     **attention)
        return {"make_layer": make_layer}

    def load_weights(self, tensors) -> None:
        experts = ExpertTensors(self.model.layers)
        super().load_weights(experts.others(tensors))
        experts.check()

"""Mixtral: Mistral's attention (GQA, an optional window on every layer) with a sparse
mixture of experts in place of the MLP (layers/moe.py: the router replicated, every expert
split across the ranks as a GatedMLP is). Checkpoint names: block_sparse_moe.gate.weight
(the router) and block_sparse_moe.experts.{e}.{w1,w2,w3}.weight (gate, down, up), or the
experts fused under mlp. (models/experts.py). Quantized checkpoints keep the per-expert
names (w1.qweight, w2.weight_scale ...): w1 and w3 load into each expert's fused
gate_up_proj, w2 into its down_proj."""

from __future__ import annotations

from tpserve.layers.moe import SparseMoE
from tpserve.models.experts import ExpertTensors
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tpserve.models.loader import load_into, with_prefix


def _make_layer(config, i, prefix, max_positions, window):
    moe = SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                    config.num_experts_per_tok, getattr(config, "hidden_act", "silu"),
                    f"{prefix}.block_sparse_moe")
    return LlamaDecoderLayer(config, i, prefix, max_positions, window, mlp=moe)


class MixtralForCausalLM(LlamaForCausalLM):
    # A quantized checkpoint's experts (SparseMoE.experts), by their per-expert names.
    stacked_params = LlamaForCausalLM.stacked_params + [
        (".gate_up_proj.", ".w1.", 0), (".gate_up_proj.", ".w3.", 1), (".down_proj.", ".w2.", None),
    ]

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": _make_layer}

    def load_weights(self, tensors) -> None:
        experts = ExpertTensors(self.model.layers, blocks="block_sparse_moe|mlp")
        skip = self.skip_tensors + (("lm_head.",) if self.tied(self.config) else ())
        prefixed = with_prefix("model.")
        load_into(self, experts.others(tensors), self.stacked_params, skip,
                  rename=lambda name: prefixed(name).replace(".block_sparse_moe.", ".mlp."))
        experts.check()

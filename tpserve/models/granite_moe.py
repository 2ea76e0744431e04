"""IBM GraniteMoE (GraniteMoeForCausalLM: granite-3.0-1b-a400m, 3b-a800m, PowerLM/PowerMoE):
Granite's four multipliers (granite.py: embeddings, residual branches, attention scale,
logits) with Mixtral's mixture of experts in place of the MLP (layers/moe.py: router
replicated, every expert split across the ranks). The files hold the experts fused only:
block_sparse_moe.input_linear.weight [experts, (gate; up), hidden] (gate first: transformers
applies the activation to the first half), block_sparse_moe.output_linear.weight
[experts, hidden, intermediate] and the router block_sparse_moe.router.layer.weight;
transformers 5 may write them as experts.gate_up_proj / experts.down_proj / router.weight.
Routing: the softmax of the top num_experts_per_tok router logits, which is the softmax over
all experts renormalised over the top k (SparseMoE's renormalize).

Fused paths: the one-row norm fold is refused (a SparseMoE, not a gated MLP, and the
residual_multiplier; LlamaDecoderLayer.why_not_foldable)."""

from __future__ import annotations

from tpserve.layers.moe import SparseMoE
from tpserve.models.experts import ExpertTensors, refuse_quantized
from tpserve.models.granite import GraniteForCausalLM
from tpserve.models.llama import LlamaDecoderLayer
from tpserve.models.loader import load_into, with_prefix

_FUSED = {"input_linear.weight": "gate_up_proj", "output_linear.weight": "down_proj"}
# The router as the files name it, and as transformers 5 may write it, to SparseMoE's gate.
_ROUTER = (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight")


class GraniteMoeForCausalLM(GraniteForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        refuse_quantized(config, "GraniteMoE")
        super().__init__(config, max_positions)

    @staticmethod
    def model_kwargs(config) -> dict:
        dense = GraniteForCausalLM.model_kwargs(config)

        def make_layer(config, i, prefix, max_positions, window):
            moe = SparseMoE(config.hidden_size, config.intermediate_size,
                            config.num_local_experts, config.num_experts_per_tok,
                            config.hidden_act, f"{prefix}.block_sparse_moe",
                            fused_names=("input_linear.weight", "output_linear.weight"))
            return LlamaDecoderLayer(config, i, prefix, max_positions, window, mlp=moe,
                                     qkv_bias=dense["qkv_bias"], o_bias=dense["o_bias"],
                                     attn_scale=dense["attn_scale"],
                                     residual_scale=dense["residual_scale"])
        return {"make_layer": make_layer}

    def load_weights(self, tensors) -> None:
        experts = ExpertTensors(self.model.layers, blocks="block_sparse_moe", fused_names=_FUSED)
        skip = self.skip_tensors + (("lm_head.",) if self.tied(self.config) else ())
        prefixed = with_prefix("model.")

        def rename(name: str) -> str:
            name = prefixed(name)
            for router in _ROUTER:
                name = name.replace(router, ".mlp.gate.weight")
            return name

        load_into(self, experts.others(tensors), self.stacked_params, skip, rename=rename)
        experts.check()

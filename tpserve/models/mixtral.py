"""Mixtral: Mistral's attention (GQA, an optional window on every layer) with a sparse
mixture of experts in place of the MLP (layers/moe.py: the router replicated, every expert
split across the ranks as a GatedMLP is). Checkpoint names: block_sparse_moe.gate.weight
(the router) and block_sparse_moe.experts.{e}.{w1,w2,w3}.weight (gate, down, up)."""

from __future__ import annotations

import re

from tpserve.errors import CheckpointError
from tpserve.layers.moe import SparseMoE
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tpserve.models.loader import load_into, with_prefix

# "model." may be missing (a file saved from the base model; loader.with_prefix).
_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def _make_layer(config, i, prefix, max_positions, window):
    moe = SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                    config.num_experts_per_tok, getattr(config, "hidden_act", "silu"),
                    f"{prefix}.block_sparse_moe")
    return LlamaDecoderLayer(config, i, prefix, max_positions, window, mlp=moe)


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        if getattr(config, "quantization_config", None):
            raise ValueError("quantized Mixtral checkpoints are not supported yet (the experts "
                             "have no int4/fp8 kernels); serve the bf16 or fp16 checkpoint")
        super().__init__(config, max_positions)

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": _make_layer}

    def load_weights(self, tensors) -> None:
        layers = self.model.layers
        seen: set[tuple[int, int, str]] = set()

        def others():
            for w in tensors:
                m = _EXPERT.match(w.name)
                if m is None:
                    yield w
                    continue
                layer, expert, which = int(m[1]), int(m[2]), m[3]
                if layer >= len(layers):
                    raise CheckpointError(f"checkpoint tensor {w.name!r} names layer {layer}, "
                                          f"but the config has {len(layers)}")
                layers[layer].mlp.load_expert(expert, which, w)
                seen.add((layer, expert, which))

        for layer in layers:  # loaded above, expert by expert; checked below
            layer.mlp.w13.optional = layer.mlp.w2.optional = True
        skip = self.skip_tensors + (("lm_head.",) if self.tied(self.config) else ())
        prefixed = with_prefix("model.")
        load_into(self, others(), self.stacked_params, skip,
                  rename=lambda name: prefixed(name).replace(".block_sparse_moe.", ".mlp."))
        missing = [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"
                   for i, layer in enumerate(layers) for e in range(layer.mlp.num_experts)
                   for w in ("w1", "w2", "w3") if (i, e, w) not in seen]
        if missing:
            raise CheckpointError(f"checkpoint has no weights for {len(missing)} expert "
                                  f"tensors: {', '.join(missing[:8])}"
                                  + (" ..." if len(missing) > 8 else ""))

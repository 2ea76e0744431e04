"""Phi-1, Phi-1.5 and Phi-2 (PhiForCausalLM): Llama's attention with biases on q, k, v and
its output projection (`dense`), rotary on the first partial_rotary_factor of each head's
dimensions, and a parallel layer: one LayerNorm (input_layernorm) feeds both attention and
a plain MLP fc1 -> gelu_new -> fc2, whose outputs both join the stream. A final LayerNorm
(final_layernorm) and an LM head with a bias. With qk_layernorm, a LayerNorm over each
head's query and key before rotary (off in the released models).

Built on LlamaModel (embedding, rotary, the residual stream carried beside each layer's
output); the checkpoint's names for what Llama calls o_proj, norm and q/k_norm are mapped
at load. No norm fold: the norm is a LayerNorm, whose mean and bias do not fold into a
projection, and the MLP reads the same normalised input as attention instead of the stream
after it, which forward_folded assumes."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.embedding import ParallelLMHead
from tpserve.layers.linear import row_parallel_sum
from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.models.llama import LlamaAttention, LlamaForCausalLM
from tpserve.models.loader import load_into, with_prefix

# Checkpoint name fragment -> tpserve's (LlamaModel's) name for the same tensor.
_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            ("model.final_layernorm.", "model.norm."))


def _layer_norm(config, size: int | None = None):
    return LayerNorm(size or config.hidden_size, config.layer_norm_eps)


class PhiDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 window: int | None) -> None:
        super().__init__()
        attn = self.self_attn = LlamaAttention(config, layer, f"{prefix}.self_attn",
                                               max_positions, window, bias=True, o_bias=True)
        if getattr(config, "qk_layernorm", False):
            # LlamaAttention applies q_norm / k_norm per head before rotary, as Phi does.
            attn.q_norm = _layer_norm(config, attn.head_dim)
            attn.k_norm = _layer_norm(config, attn.head_dim)
        self.mlp = PlainMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            f"{prefix}.mlp", names=("fc1", "fc2"))
        self.input_layernorm = _layer_norm(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x is the previous layer's output, added to the
        stream here; returns (attention + MLP, stream), summed next as (attn + mlp) + stream,
        transformers' order."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        # Both branches' partial sums reduced in one all-reduce (row_parallel_sum).
        return row_parallel_sum((self.self_attn.o_proj, self.self_attn.heads(rope, h)),
                                (self.mlp.down, self.mlp.hidden(h))), residual


def _make_layer(config, i: int, prefix: str, max_positions: int,
                window: int | None) -> PhiDecoderLayer:
    return PhiDecoderLayer(config, i, prefix, max_positions, window)


class PhiForCausalLM(LlamaForCausalLM):
    stacked_params = LlamaForCausalLM.stacked_params[:3]  # q, k, v into qkv_proj
    reads_partial_rotary = True

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True)
        if self.tied(config):
            self.lm_head.tie_to(self.model.embed_tokens)  # the bias stays the head's own

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": _make_layer, "make_norm": lambda: _layer_norm(config)}

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        """Never folds (the worker logs why); see the module docstring."""
        return "its norms are LayerNorms: only an RMSNorm folds"

    def load_weights(self, tensors) -> None:
        prefixed = with_prefix("model.")  # a body saved from PhiModel: "layers.0..."

        def rename(name: str) -> str:
            name = prefixed(name)
            for old, new in _RENAMES:
                name = name.replace(old, new)
            return name

        skip = self.skip_tensors + (("lm_head.weight",) if self.tied(self.config) else ())
        load_into(self, tensors, self.stacked_params, skip, rename=rename)

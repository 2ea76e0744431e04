"""StarCoder2 (Starcoder2ForCausalLM): Llama's attention (GQA, rotary) with biases on q, k,
v and o (use_bias), LayerNorm with a bias (norm_epsilon) in place of RMSNorm, a plain MLP
c_fc -> activation (gelu_pytorch_tanh) -> c_proj with biases instead of the gated one, a
sliding window on every layer (sliding_window; None: none) and a head tied or not.
Built from the Llama blocks with its own norm and MLP; no norm folding (a LayerNorm does
not fold into a projection: LlamaDecoderLayer.why_not_foldable)."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.activation import get_activation
from tpserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpserve.layers.norm import LayerNorm
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def _bias(config) -> bool:
    return bool(getattr(config, "use_bias", True))


def _layer_norm(config):
    return lambda: LayerNorm(config.hidden_size, getattr(config, "norm_epsilon", 1e-5),
                             bias=_bias(config))


class Starcoder2MLP(nn.Module):
    """Not gated: c_fc split by rows, c_proj by columns (its bias added once, after the
    all-reduce)."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.c_fc = ColumnParallelLinear(hidden, inter, bias=_bias(config),
                                         prefix=f"{prefix}.c_fc")
        self.act = get_activation(getattr(config, "hidden_act", "gelu_pytorch_tanh"))
        self.c_proj = RowParallelLinear(inter, hidden, bias=_bias(config),
                                        prefix=f"{prefix}.c_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


def _make_layer(config, i: int, prefix: str, max_positions: int,
                window: int | None) -> LlamaDecoderLayer:
    bias = _bias(config)
    return LlamaDecoderLayer(config, i, prefix, max_positions, window, qkv_bias=bias,
                             o_bias=bias, mlp=Starcoder2MLP(config, f"{prefix}.mlp"),
                             make_norm=_layer_norm(config))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": _make_layer, "make_norm": _layer_norm(config)}

    @staticmethod
    def tied(config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", True))

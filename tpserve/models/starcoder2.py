"""StarCoder2 (Starcoder2ForCausalLM): Llama's attention (GQA, rotary) with biases on q, k,
v and o (use_bias), LayerNorm with a bias (norm_epsilon) in place of RMSNorm, a plain MLP
c_fc -> activation (gelu_pytorch_tanh) -> c_proj with biases instead of the gated one, a
sliding window on every layer (sliding_window; None: none) and a head tied or not.
Built from the Llama blocks with its own norm and MLP; no norm folding (a LayerNorm does
not fold into a projection: LlamaDecoderLayer.why_not_foldable)."""

from __future__ import annotations

from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def _bias(config) -> bool:
    return bool(getattr(config, "use_bias", True))


def _layer_norm(config):
    return lambda: LayerNorm(config.hidden_size, getattr(config, "norm_epsilon", 1e-5),
                             bias=_bias(config))


def _mlp(config, prefix: str) -> PlainMLP:
    return PlainMLP(config.hidden_size, config.intermediate_size,
                    getattr(config, "hidden_act", "gelu_pytorch_tanh"), prefix,
                    names=("c_fc", "c_proj"), bias=_bias(config))


def _make_layer(config, i: int, prefix: str, max_positions: int,
                window: int | None) -> LlamaDecoderLayer:
    bias = _bias(config)
    return LlamaDecoderLayer(config, i, prefix, max_positions, window, qkv_bias=bias,
                             o_bias=bias, mlp=_mlp(config, f"{prefix}.mlp"),
                             make_norm=_layer_norm(config))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": _make_layer, "make_norm": _layer_norm(config)}

    @staticmethod
    def tied(config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", True))

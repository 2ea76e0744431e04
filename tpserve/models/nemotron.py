"""Nemotron (NemotronForCausalLM, model_type nemotron: Nemotron-3 8B, Nemotron-4 Minitron 4B
/ 8B, Mistral-NeMo-Minitron 8B): Llama's attention (GQA, a head_dim of its own, rotary on
the first partial_rotary_factor of each head, 0.5 by default; biases on q, k, v and o with
attention_bias) and Llama's layer order, with

- LayerNorm1P in place of RMSNorm: a LayerNorm with a bias whose weight is applied as
  (1 + w) (norm_eps). The 1 is added to the weight once, at load, in the model dtype
  (layers/norm.LayerNorm's weight_offset), so a step runs F.layer_norm as transformers
  calls it, with the same rounded (1 + w);
- a plain MLP up_proj -> hidden_act (relu2: squared ReLU) -> down_proj (biases with
  mlp_bias), up_proj split by rows, down_proj by columns (layers/mlp.PlainMLP);
- an untied head unless tie_word_embeddings; no sliding window (transformers' Nemotron has
  none, whatever a config.json carries).

No norm fold and no gated one-row GEMV: a LayerNorm's mean and bias do not fold into
qkv_proj, and the MLP is not gated (LlamaDecoderLayer.why_not_foldable declines both)."""

from __future__ import annotations

from tpserve.layers.mlp import PlainMLP
from tpserve.layers.norm import LayerNorm
from tpserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def _norm_1p(config):
    return lambda: LayerNorm(config.hidden_size, getattr(config, "norm_eps", 1e-5),
                             weight_offset=1.0)


def _decoder_layer(config, i: int, prefix: str, max_positions: int,
                   window: int | None) -> LlamaDecoderLayer:
    attn_bias = bool(getattr(config, "attention_bias", False))

    def mlp() -> PlainMLP:  # built after the attention: a refused tp names the heads first
        return PlainMLP(config.hidden_size, config.intermediate_size,
                        getattr(config, "hidden_act", "relu2"), f"{prefix}.mlp",
                        names=("up_proj", "down_proj"),
                        bias=bool(getattr(config, "mlp_bias", False)))

    return LlamaDecoderLayer(config, i, prefix, max_positions, window, qkv_bias=attn_bias,
                             o_bias=attn_bias, mlp=mlp, make_norm=_norm_1p(config))


class NemotronForCausalLM(LlamaForCausalLM):
    # q, k, v into qkv_proj; up_proj is a projection of its own (no gate to fuse it with).
    stacked_params = LlamaForCausalLM.stacked_params[:3]
    reads_partial_rotary = True

    @staticmethod
    def sliding_window(config) -> None:
        return None

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": _decoder_layer, "make_norm": _norm_1p(config)}

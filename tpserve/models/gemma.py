"""Gemma (v1): the Llama blocks with a (1 + weight) RMSNorm computed in float32, embeddings
scaled by sqrt(hidden_size), a GeGLU MLP, a head_dim of its own and a tied LM head.
gemma-2b uses one KV head, which QKVParallelLinear replicates on every rank."""

from __future__ import annotations

from tpserve.models.llama import LlamaForCausalLM


def gemma_activation(config) -> str:
    """The MLP activation transformers' GemmaMLP applies: config.hidden_act, where the
    legacy value "gelu" of the original releases means the tanh approximation."""
    act = getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.model.embed_scale = config.hidden_size**0.5

    @staticmethod
    def sliding_window(config) -> None:
        return None

    @staticmethod
    def model_kwargs(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "norm_offset": 1.0,
                "act": gemma_activation(config)}

    @staticmethod
    def tied(config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", True))

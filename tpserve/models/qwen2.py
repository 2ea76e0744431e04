"""Qwen2: the Llama blocks with biases on q, k and v (none on o_proj), a head tied or not,
and a sliding window only on the layers config.layer_types marks "sliding_attention"."""

from __future__ import annotations

from tpserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(config) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None) or \
            ["full_attention"] * config.num_hidden_layers
        return [window if t == "sliding_attention" else None for t in types]

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"qkv_bias": True, "o_bias": False}

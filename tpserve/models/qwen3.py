"""Qwen3 (dense): Qwen2's layout without the q/k/v biases (attention_bias, off in the
released models) and with an RMSNorm over each head's query and key before rotary
(q_norm / k_norm); a window only on the layers config.layer_types marks sliding."""

from __future__ import annotations

from tpserve.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def model_kwargs(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": 0.0}

"""Gemma 2: Gemma's pieces (the (1 + w) RMSNorm in float32, embeddings scaled by
sqrt(hidden_size), a GeGLU MLP, a head_dim of its own, a tied LM head) in a layer with four
norms: after attention, and before and after the MLP. Attention scores are scaled by
query_pre_attn_scalar (not head_dim) and capped, tanh(s / cap) * cap, by
attn_logit_softcapping; a sliding window applies on the layers config.layer_types marks
"sliding_attention" (every other one, the first included); the LM head's logits are capped
by final_logit_softcapping. Gemma 3 (gemma3.py) adds norms on queries and keys."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.norm import RMSNorm
from tpserve.models.gemma import GemmaForCausalLM
from tpserve.models.llama import GatedMLP, LlamaAttention


def layer_windows(config, every: int = 2) -> list[int | None]:
    """Each layer's attention window. Configs written before transformers listed
    layer_types make every `every`-th layer global and window the others, as released
    (Gemma 2: every other layer, the first windowed; Gemma 3: one in six)."""
    window = getattr(config, "sliding_window", None) or None
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or \
        ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    return [window if t == "sliding_attention" else None for t in types]


def _cap(config, name: str) -> float | None:
    value = getattr(config, name, None)
    return float(value) if value else None


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 sliding_window: int | None, qk_norm: float | None = None,
                 score_cap: bool = True) -> None:
        """score_cap: cap the attention scores by attn_logit_softcapping where set."""
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        bias = bool(getattr(config, "attention_bias", False))
        scalar = getattr(config, "query_pre_attn_scalar", None)
        self.self_attn = LlamaAttention(
            config, layer, f"{prefix}.self_attn", max_positions, sliding_window, bias=bias,
            o_bias=bias, softcap=_cap(config, "attn_logit_softcapping") if score_cap else None,
            scale=float(scalar) ** -0.5 if scalar else None, qk_norm=qk_norm)
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act, f"{prefix}.mlp")

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, eps, offset=1.0, cast_before_weight=False)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x is the previous layer's (normed) MLP output, not
        yet added to the residual stream; each add is fused into the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(rope, h))
        h, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.final_cap = _cap(config, "final_logit_softcapping")

    @staticmethod
    def sliding_window(config) -> list[int | None]:
        return layer_windows(config)

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"norm_offset": 1.0, "make_layer": Gemma2DecoderLayer}

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, to_first_rank)
        if logits is None or self.final_cap is None:
            return logits
        return torch.tanh(logits / self.final_cap) * self.final_cap

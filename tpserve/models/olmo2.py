"""OLMo 2 (Olmo2ForCausalLM): Llama's attention and gated MLP with the norms moved. No norm
reads the layer's input; the attention output and the MLP output are each normalised
(post_attention_layernorm, post_feedforward_layernorm) before they join the residual stream.
q_norm and k_norm are RMSNorms over the whole query and key projections (every head at once,
num_heads * head_dim and num_key_value_heads * head_dim wide), applied before rotary, so under
tensor parallelism each rank's mean square takes an all-reduce (layers/norm.ShardedRMSNorm;
q's and k's sums of squares travel in one).
Its RMSNorms multiply the weight in float32 before the cast back (Gemma's order, no offset).
attention_bias puts biases on q, k, v and o (off in the released models).

Fused paths: the residual add fused into a norm (add_rms_norm) would add before normalising,
but here each branch is normalised alone and added after, so the layer adds in plain torch
and only the final norm (which does follow the add) takes the fused form. The one-row fold
(LlamaModel.fold_norms) folds an input norm into qkv_proj; there is none, so it is refused."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.layers.norm import RMSNorm, ShardedRMSNorm, sharded_rms_norms
from tpserve.models.llama import GatedMLP, LlamaAttention, LlamaForCausalLM


def _norm(config) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, 0.0, cast_before_weight=False)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, layer: int, prefix: str, max_positions: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer, prefix, max_positions, bias=bias, o_bias=bias)
        tp, qkv, d = get_tp(), self.qkv_proj, self.head_dim
        eps = config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(qkv.total_heads * d, tp.rank * qkv.q_size, qkv.q_size, eps)
        # Past the KV heads each one sits on tp / num_key_value_heads ranks; only the first
        # of them adds its sum of squares, or k_norm's mean square would count it that often.
        kv = qkv.total_kv_heads
        first = kv >= tp.size or tp.rank % (tp.size // kv) == 0
        self.k_norm = ShardedRMSNorm(kv * d, qkv.kv_head_start * d, qkv.kv_size, eps, first)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = sharded_rms_norms(((self.q_norm, q), (self.k_norm, k)))
        return self.o_proj(self.attn(q, k, v, rope=rope))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, prefix: str, max_positions: int,
                 sliding_window: int | None = None) -> None:
        """sliding_window: always None (Olmo2ForCausalLM.sliding_window; OLMo 2 has none)."""
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer, f"{prefix}.self_attn", max_positions)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            f"{prefix}.mlp")
        self.post_attention_layernorm = _norm(config)
        self.post_feedforward_layernorm = _norm(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x is the previous layer's normalised MLP output, not
        yet added to the residual stream (the next layer, or the final norm, adds it)."""
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(rope, h))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(config) -> None:
        return None

    @staticmethod
    def model_kwargs(config) -> dict:
        return {"make_layer": Olmo2DecoderLayer, "make_norm": lambda: _norm(config)}

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        """Never folds (the worker logs why): the fold moves a norm's weight into the
        projection it feeds, and no norm feeds qkv_proj here (they follow each branch)."""
        return "its norms follow attention and the MLP: none feeds qkv_proj to fold"

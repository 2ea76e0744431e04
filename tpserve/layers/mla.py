"""DeepSeek's multi-head latent attention (MLA), served as ordinary multi-head attention.

Queries come from q_proj (DeepSeek-V2-Lite) or through a low-rank pair, q_a_proj -> an
RMSNorm -> q_b_proj. kv_a_proj_with_mqa gives a compressed KV vector (kv_lora_rank) and one
rope key shared by every head (qk_rope_head_dim); after kv_a_layernorm, kv_b_proj expands
the compressed vector to each head's non-rotated key (qk_nope_head_dim) and value
(v_head_dim). Only the rope part of queries and keys rotates.

This layer expands the latent and stores per-head K and V in the paged cache, one KV head
per query head: q_b_proj (q_proj) and kv_b_proj column-parallel by heads, q_a_proj and
kv_a_proj_with_mqa replicated, o_proj row-parallel. Keys are laid out [rope; nope] (the
backends rotate a head's first dimensions), values zero-padded to the key width so one
head_dim serves both, and the output's padding dropped before o_proj. The cost against
true MLA, which caches the latent and the rope key once per token: docs/models.md.

Rotary: transformers' DeepSeek rotates interleaved pairs (2i, 2i + 1) by frequency i
(rope_interleave); reordering the rope dimensions evens-then-odds turns that into the
rotate-half rotary every backend applies, exactly as transformers' V3 computes it."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.layers.attention import PagedAttention
from tpserve.layers.interleaved_rotary import half_order
from tpserve.layers.linear import ColumnParallelLinear, RowParallelLinear, _build
from tpserve.layers.norm import RMSNorm
from tpserve.layers.param_layout import expect_full, load_region
from tpserve.layers.rotary import rope_parameters
from tpserve.layers.sharding import shard_size
from tpserve.weights import TensorSlice


class LatentLinear(nn.Module):
    """A projection every rank holds whole (q_a_proj, kv_a_proj_with_mqa: their outputs are
    small and feed every head), through its layer's quantization method so an fp8
    checkpoint's block-scaled weights load as they are."""

    def __init__(self, in_features: int, out_features: int, prefix: str,
                 bias: bool = False) -> None:
        super().__init__()
        self.prefix, self.in_features, self.out_features = prefix, in_features, out_features
        _build(self, out_features, in_features, in_features, bias, out_features, False,
               [out_features], prefix, self.load_all, [prefix])

    def load_all(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        expect_full(param, w, self.out_features, self.in_features)
        load_region(param, w, (0, self.out_features, 0), (0, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y + self.bias if self.bias is not None else y


def mla_softmax_scale(config) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's mscale squared where a scaled rope gives
    mscale_all_dim (transformers' yarn_apply_mscale): the scores of the rotated and the
    plain dimensions alike."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    m_all, factor = rope.get("mscale_all_dim"), float(rope.get("factor") or 1.0)
    if rope["rope_type"] != "default" and m_all and factor > 1:
        m = 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, config, layer: int, prefix: str, interleaved: bool = True) -> None:
        """interleaved: the rope dimensions rotate in pairs (2i, 2i + 1) (V2 always, V3 by
        rope_interleave); else in halves (i, i + rope / 2)."""
        super().__init__()
        tp = get_tp()
        heads = config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank_kv = config.v_head_dim, config.kv_lora_rank
        qk = self.nope + self.rope
        q_rows = (f"{prefix}.q_proj.weight" if not config.q_lora_rank
                  else f"{prefix}.q_b_proj.weight")
        # Checked by heads first: the row split below must not cut a head.
        self.heads = shard_size(heads, tp.size, tensor=q_rows, what="attention heads",
                                shape=(heads * qk, config.q_lora_rank or config.hidden_size))
        shard_size(heads, tp.size, tensor=f"{prefix}.kv_b_proj.weight", what="attention heads",
                   shape=(heads * (self.nope + self.v_dim), self.rank_kv))
        eps = getattr(config, "rms_norm_eps", 1e-6)
        bias = bool(getattr(config, "attention_bias", False))
        if config.q_lora_rank:
            self.q_a_proj = LatentLinear(config.hidden_size, config.q_lora_rank,
                                         f"{prefix}.q_a_proj", bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk,
                                                 prefix=f"{prefix}.q_b_proj")
            self.q_proj = None
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * qk,
                                               prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = LatentLinear(config.hidden_size, self.rank_kv + self.rope,
                                               f"{prefix}.kv_a_proj_with_mqa", bias)
        self.kv_a_layernorm = RMSNorm(self.rank_kv, eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank_kv, heads * (self.nope + self.v_dim),
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, bias=bias,
                                        prefix=f"{prefix}.o_proj")
        self.head_dim = max(qk, self.v_dim)
        self.attn = PagedAttention(layer, self.heads, self.heads, self.head_dim,
                                   mla_softmax_scale(config))
        order = half_order(self.rope) if interleaved else torch.arange(self.rope)
        self.register_buffer("rope_order", order, persistent=False)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.head_dim - x.shape[-1]
        return x if extra == 0 else torch.nn.functional.pad(x, (0, extra))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape[0], self.heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank_kv, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous()))
        k_nope, v = kv.view(t, h, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        k_pe = k_pe[:, None, self.rope_order].expand(t, h, self.rope)
        q = torch.cat((q[..., self.nope:][..., self.rope_order], q[..., : self.nope]), dim=-1)
        k = torch.cat((k_pe, k_nope), dim=-1)
        out = self.attn(self._pad(q), self._pad(k), self._pad(v).contiguous(), rope=rope)
        out = out.view(t, h, self.head_dim)[..., : self.v_dim]
        return self.o_proj(out.reshape(t, h * self.v_dim))

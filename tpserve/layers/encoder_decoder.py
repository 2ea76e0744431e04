"""Attention layers of encoder-decoder models: an encoder's dense self-attention (no cache)
and a decoder's cross attention over the encoder output's K/V in the paged cache."""

from __future__ import annotations

import torch

from tpserve.kernels.base import AttentionSpec
from tpserve.layers.attention import AttentionLayer
from tpserve.layers.context import current


class DenseAttention(AttentionLayer):
    """Self-attention of each sequence over its own tokens of this step, with no cache:
    the encoder sees its whole input at once and never again."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, causal: bool = False,
                 relative_bias: bool = False) -> None:
        super().__init__()
        self.spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_heads,
                                  head_dim=head_dim, scale=scale, causal=causal,
                                  relative_bias=relative_bias, paged=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rel_bias: torch.Tensor | None = None) -> torch.Tensor:
        """q/k/v: [T, heads * head_dim] laid out by ctx.meta -> [T, heads * head_dim]."""
        ctx, s = current(), self.spec
        shape = (-1, s.num_heads, s.head_dim)
        out = ctx.backend.attend_dense(q.view(shape), k.view(shape), v.view(shape), ctx.meta,
                                       s, rel_bias)
        return out.reshape(q.shape[0], -1)


class PagedCrossAttention(AttentionLayer):
    """Cross attention whose K/V (of the encoder output) live in the paged cache. It owns no
    cache: it shares kv_caches[layer_index] with its decoder layer's self-attention, in
    blocks of its own (the sequence's cross blocks), so one block pool accounts for both."""

    def __init__(self, layer_index: int, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_heads,
                                  head_dim=head_dim, scale=scale, causal=False)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Under the encoder's context: write the encoder output's K/V ([T_enc, heads *
        head_dim]) at ctx.meta.slot_mapping, which the worker points at the cross blocks."""
        ctx, s = current(), self.spec
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        extra = {"spec": s} if s.kv_cache_dtype != "auto" else {}  # fp8: its scales
        ctx.backend.write_kv(k.view(-1, s.num_heads, s.head_dim),
                             v.view(-1, s.num_heads, s.head_dim), k_cache, v_cache,
                             ctx.meta.slot_mapping, **extra)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """Under the decoder's context: q [T, heads * head_dim] attends to all encoder K/V
        of its sequence, found through ctx.cross_meta."""
        ctx, s = current(), self.spec
        if ctx.cross_meta is None:
            raise RuntimeError("cross attention needs ForwardContext.cross_meta (the worker "
                               "sets it for encoder-decoder models)")
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        out = ctx.backend.forward(q.view(-1, s.num_heads, s.head_dim), k_cache, v_cache,
                                  ctx.cross_meta, s)
        return out.reshape(q.shape[0], -1)

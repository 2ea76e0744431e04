"""The attention layer: stores this step's K/V in the paged cache, then asks the kernel
backend chosen for this worker to attend."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.kernels.base import AttentionSpec
from tpserve.layers.context import current
from tpserve.layers.sharding import copy_narrow, expect_shape
from tpserve.weights import TensorSlice


class AttentionLayer(nn.Module):
    """Any layer that attends through the kernel backend. The worker picks a backend that
    supports every layer's spec, and gives a paged KV cache (kv_caches[layer_index]) to
    each layer that owns_cache; others share one (cross attention) or need none (an
    encoder's dense attention)."""

    spec: AttentionSpec
    layer_index: int = -1
    owns_cache: bool = False


class PagedAttention(AttentionLayer):
    owns_cache = True

    def __init__(self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, sliding_window: int | None = None, softcap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None, relative_bias: bool = False,
                 sinks: bool = False, attention_chunk: int | None = None) -> None:
        """sinks: a learned logit per query head joins the softmax denominator (gpt-oss);
        the parameter `sinks` holds this rank's heads' (float32), loaded from the
        checkpoint's [all heads] tensor. attention_chunk: a query sees only the keys of its
        own chunk of that many positions (Llama 4, kernels/base.py)."""
        super().__init__()
        self.layer_index = layer_index
        self.spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, scale=scale, sliding_window=sliding_window,
                                  alibi=alibi_slopes is not None, softcap=softcap,
                                  relative_bias=relative_bias, sinks=sinks,
                                  attention_chunk=attention_chunk)
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes.float(), persistent=False)
        else:
            self.alibi_slopes = None
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                      requires_grad=False)
            self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: torch.Tensor, w: TensorSlice) -> None:
        """This rank's query heads of the checkpoint's [heads] sinks (heads split in order,
        as QKVParallelLinear splits the query heads)."""
        tp, n = get_tp(), self.spec.num_heads
        expect_shape(w, (n * tp.size,))
        copy_narrow(param, w, 0, tp.rank * n, n)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rel_bias: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [T, heads * head_dim], k/v: [T, kv_heads * head_dim] -> [T, heads * head_dim].
        rel_bias: the relative-position table of a spec with relative_bias (kernels/base.py).
        rope: the step's rotary (cos, sin), applied to q and k together with the cache write."""
        ctx = current()
        s = self.spec
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if ctx.pieces is not None and rel_bias is None:
            return ctx.pieces.attend(self, q, k, v, rope)
        return self.attend(q, k, v, rel_bias, rope)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rel_bias: torch.Tensor | None = None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """forward's work on q [T, heads, head_dim] and k/v [T, kv_heads, head_dim]; graphs
        captured in pieces call it between their pieces (worker/piecewise.py)."""
        ctx = current()
        s = self.spec
        k_cache, v_cache = ctx.kv_caches[self.layer_index]
        # Only a spec with sinks passes them, so backends without sinks keep their signatures.
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        if rel_bias is None and ctx.meta.decode_only:
            # A backend may rotate, store and attend in one launch here (decode_new).
            out = ctx.backend.decode_new(q, k, v, rope, k_cache, v_cache, ctx.meta, s,
                                         self.alibi_slopes, **sinks)
            return out.reshape(q.shape[0], -1)
        q = ctx.backend.write_new(q, k, v, rope, k_cache, v_cache, ctx.meta.slot_mapping, s)
        if rel_bias is None:  # the decoder-only call, unchanged for every backend
            out = ctx.backend.forward(q, k_cache, v_cache, ctx.meta, s, self.alibi_slopes,
                                      **sinks)
        else:
            out = ctx.backend.forward(q, k_cache, v_cache, ctx.meta, s, self.alibi_slopes,
                                      rel_bias=rel_bias)
        return out.reshape(q.shape[0], -1)

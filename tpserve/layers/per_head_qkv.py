"""Fused query_key_value tensors laid out by head. PerHeadQKVLinear: rows [head, (q, k, v),
head_dim] (Bloom, GPT-NeoX), unlike Phi-3's [q; k; v]: the heads a rank owns are one
contiguous block of rows, so each rank reads its 1/tp of the tensor with one narrow.
GroupedQKVLinear: rows grouped by KV head (Falcon), with GQA and replicated KV heads."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.errors import ShardingError
from tpserve.layers.linear import ColumnParallelLinear, QKVParallelLinear
from tpserve.layers.param_layout import full_shape
from tpserve.layers.sharding import shard_size
from tpserve.weights import TensorSlice


class PerHeadQKVLinear(ColumnParallelLinear):
    def __init__(self, hidden: int, num_heads: int, prefix: str, bias: bool = True) -> None:
        tp = get_tp()
        self.head_dim = hidden // num_heads
        self.num_heads = shard_size(num_heads, tp.size, tensor=f"{prefix}.weight",
                                    what="attention heads", shape=(3 * hidden, hidden))
        super().__init__(hidden, 3 * hidden, bias=bias, prefix=prefix)

    def load_rows(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        # In output and input features, so packed int4 and fp8 scales are checked alike.
        full = full_shape(param.src_layout, self.out_features, self.in_features, len(w.shape))
        if tuple(w.shape) != full and math.prod(w.shape) != 1:  # 1: a per-tensor fp8 scale
            raise ShardingError(
                f"checkpoint tensor {w.name!r} has shape {list(w.shape)}; expected {list(full)} "
                "(rows laid out as [heads, (q, k, v), head_dim]): the checkpoint does not match "
                "its config.json")
        super().load_rows(param, w)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, heads * 3 * head_dim] -> q, k, v, each [T, heads * head_dim]."""
        t = qkv.view(-1, self.num_heads, 3, self.head_dim)
        q, k, v = (t[:, :, i].reshape(qkv.shape[0], -1) for i in range(3))
        return q, k, v


class GroupedQKVLinear(QKVParallelLinear):
    """A fused query_key_value whose rows are grouped by KV head: for each KV head, the
    query heads that share it, then its key, then its value, [kv_heads, (heads / kv_heads
    + 2), head_dim] (Falcon-40B / 180B's new_decoder_architecture). One KV head is
    Falcon-7B's multi-query [q (all heads); k; v]; as many KV heads as heads is the per-head
    [head, (q, k, v), head_dim] of Falcon-RW (and Bloom). Each rank holds its query heads
    and their KV head(s), replicated when tp exceeds the KV heads, as QKVParallelLinear
    splits them; its weight holds them as [q; k; v] (split() as QKVParallelLinear's), read
    from the file region by region."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, prefix: str, disk_name: str = "query_key_value") -> None:
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"{prefix}.{disk_name}: {num_heads} attention heads cannot be grouped by "
                f"{num_kv_heads} key/value heads (each KV head must serve the same number of "
                "query heads): the config.json does not describe a model")
        super().__init__(hidden, head_dim, num_heads, num_kv_heads, bias=bias, prefix=prefix,
                         disk_name=disk_name)

    def fused_regions(self) -> list[tuple[int, int, int]]:
        d, per = self.head_dim, self.total_heads // self.total_kv_heads
        group = (per + 2) * d  # rows of one KV head's group
        first, last = get_tp().rank * self.num_heads, (get_tp().rank + 1) * self.num_heads
        regions, dst = [], 0
        for g in range(first // per, (last - 1) // per + 1):  # groups holding my q heads
            lo, hi = max(first, g * per), min(last, (g + 1) * per)
            regions.append((g * group + (lo - g * per) * d, (hi - lo) * d, dst))
            dst += (hi - lo) * d
        for i in range(self.num_kv_heads):
            g = self.kv_head_start + i
            regions.append((g * group + per * d, d, self.q_size + i * d))  # its key
            regions.append((g * group + (per + 1) * d, d, self.q_size + self.kv_size + i * d))
        return regions

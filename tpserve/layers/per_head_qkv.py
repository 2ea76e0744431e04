"""A fused query_key_value whose rows are laid out per head, [head, (q, k, v), head_dim]
(Bloom, GPT-NeoX), unlike Phi-3's [q; k; v]: the heads a rank owns are one contiguous block
of rows, so each rank reads its 1/tp of the tensor with one narrow."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.errors import ShardingError
from tpserve.layers.linear import ColumnParallelLinear
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

"""ALiBi slopes (Press et al.), computed as transformers' Bloom does, and each rank's share."""

from __future__ import annotations

import math

import torch

from tpserve.distributed import get_tp
from tpserve.layers.sharding import shard_size


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """float32 [num_heads]: a geometric sequence for the largest power of two <= num_heads,
    then every other slope of the next power of two for the remaining heads."""
    p2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(p2) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + p2, dtype=torch.int32))
    if p2 != num_heads:
        extra = torch.full((), 2 ** (-(2 ** -(math.log2(2 * p2) - 3))), dtype=torch.float32)
        rest = min(p2, num_heads - p2)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * rest, 2,
                                                                  dtype=torch.int32))])
    return slopes


def rank_alibi_slopes(num_heads: int, tensor: str = "alibi") -> torch.Tensor:
    """The slopes of the heads this tensor-parallel rank owns (a contiguous block)."""
    tp = get_tp()
    n = shard_size(num_heads, tp.size, tensor=tensor, what="attention heads")
    return alibi_slopes(num_heads)[tp.rank * n : (tp.rank + 1) * n]

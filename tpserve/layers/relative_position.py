"""T5's relative position bias: a learned scalar per (bucket, head), where the bucket of a
key at relative position key - query is exact for short distances and log-spaced up to
max_distance. Sharded by heads: each rank holds its heads' columns."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.distributed import get_tp
from tpserve.layers.sharding import check_shape, copy_narrow, shard_size
from tpserve.weights import TensorSlice


def relative_position_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each relative position (key - query). A decoder (not bidirectional) gives
    every later key bucket 0, which its causal mask hides anyway."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = -torch.min(rel, torch.zeros_like(rel))
    exact = num_buckets // 2
    # The same float32 expression as the original, so bucket edges land on the same ints.
    far = exact + (torch.log(dist.float() / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).to(torch.long)
    far = torch.min(far, torch.full_like(far, num_buckets - 1))
    return buckets + torch.where(dist < exact, dist, far)


class RelativePositionBias(nn.Module):
    """weight: [num_buckets, heads on this rank]. Calling it gives the rel_bias table the
    attention backend takes (kernels/base.py): [heads on this rank, 2 * max_distance + 1],
    exact because every distance >= max_distance falls in the last bucket."""

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int,
                 bidirectional: bool, prefix: str = "") -> None:
        super().__init__()
        tp = get_tp()
        n = shard_size(num_heads, tp.size, tensor=f"{prefix}.weight", what="attention heads",
                       shape=(num_buckets, num_heads))
        self.weight = nn.Parameter(torch.empty(num_buckets, n), requires_grad=False)
        self.weight.weight_loader = self.load_heads
        # Built on the CPU (bucket edges as transformers computes them), then moved.
        rel = torch.arange(-max_distance, max_distance + 1, device="cpu")
        buckets = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
        self.register_buffer("buckets", buckets.to(self.weight.device), persistent=False)

    def load_heads(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        n = param.shape[1]
        if w.shape[0] != param.shape[0]:
            check_shape(param, (w.shape[0], n), w.name)
        copy_narrow(param, w, 1, get_tp().rank * n, n)

    def forward(self) -> torch.Tensor:
        return self.weight[self.buckets].t()

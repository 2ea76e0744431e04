"""Normalisation layers, computed in float32 as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.sharding import copy_full


class RMSNorm(nn.Module):
    """x / rms(x) * weight; Gemma stores the weight as an offset from one (offset=1.0)."""

    def __init__(self, hidden: int, eps: float = 1e-6, offset: float = 0.0,
                 cast_before_weight: bool = True) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        # Llama multiplies after casting back to the input dtype; Gemma multiplies in float32.
        self.cast_before_weight = cast_before_weight
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.weight.weight_loader = copy_full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_before_weight:
            return (self.weight + self.offset) * h.to(dtype) if self.offset else self.weight * h.to(dtype)
        return (h * (self.weight.float() + self.offset)).to(dtype)


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden, eps=eps, bias=bias)
        self.weight.requires_grad_(False)
        self.weight.weight_loader = copy_full
        if self.bias is not None:
            self.bias.requires_grad_(False)
            self.bias.weight_loader = copy_full

"""Normalisation layers, computed in float32 as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.kernels.fused_ops import add_rms_norm, plan_norm
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
        plan_norm(hidden, offset, cast_before_weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with a residual, (rmsnorm(x + residual), x + residual) in one kernel
        where the device has it (kernels/fused_ops.py)."""
        out, res = add_rms_norm(x, residual, self.weight, self.eps, self.offset,
                                self.cast_before_weight)
        return out if residual is None else (out, res)


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden, eps=eps, bias=bias)
        self.weight.requires_grad_(False)
        self.weight.weight_loader = copy_full
        if self.bias is not None:
            self.bias.requires_grad_(False)
            self.bias.weight_loader = copy_full

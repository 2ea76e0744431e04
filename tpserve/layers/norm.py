"""Normalisation layers, computed in float32 as transformers does."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.distributed import all_reduce
from tpserve.kernels.fused_ops import add_rms_norm, plan_norm
from tpserve.layers.sharding import copy_full, copy_narrow, expect_shape
from tpserve.weights import TensorSlice


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

    @torch.no_grad()
    def fold_into(self, *linears: nn.Module) -> None:
        """Move this norm's weight into the float weights [N, K] of the layers it feeds,
        whose K is this norm's size, and make it one: x / rms(x) * g @ W^T equals
        x / rms(x) @ (W g)^T, so a one-row GEMV that normalises x itself needs no norm
        launch and no weight vector (kernels/gemv.py `linear`'s rms_eps). Steps of several
        rows still run this norm, now with a unit weight. W g is rounded once to W's dtype,
        in place of the normalised activation's rounding times g."""
        g = self.weight.float() + self.offset
        for w in (lin.weight for lin in linears):  # all checked before any is changed
            if w.dim() != 2 or w.shape[1] != g.numel() or not w.is_floating_point():
                raise ValueError(f"cannot fold a norm of {g.numel()} into weight "
                                 f"{tuple(w.shape)} {w.dtype}")
        for w in (lin.weight for lin in linears):
            # In blocks of rows: this runs after the KV cache took the free memory, so no
            # float32 copy of a whole weight.
            for rows in w.split(1024):
                rows.copy_((rows.float() * g).to(w.dtype))
        self.weight.fill_(1.0 - self.offset)


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a vector of `total` features split across the tp ranks (OLMo 2's q_norm
    and k_norm span every head's query or key, and each rank holds its heads only): this
    rank holds features [start, start + width) and their weights. The mean square needs the
    whole vector, so the ranks all-reduce their sums of squares (nothing on one rank), then
    each normalises its own slice. counted=False: this rank's slice is a replica of one
    another rank also holds (KV heads replicated when tp exceeds them); it adds zero so the
    replicated features count once. The weight multiplies in float32 before the cast back
    (OLMo 2's order)."""

    def __init__(self, total: int, start: int, width: int, eps: float, counted: bool = True) -> None:
        super().__init__()
        self.total, self.start, self.width = total, start, width
        self.eps, self.counted = eps, counted
        self.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        self.weight.weight_loader = self.load_slice

    def load_slice(self, param: nn.Parameter, w: TensorSlice) -> None:
        expect_shape(w, (self.total,))
        copy_narrow(param, w, 0, self.start, self.width)

    def squares(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of each row's sum of squares (float32, [rows, 1])."""
        squares = x.float().pow(2).sum(-1, keepdim=True)
        return squares if self.counted else torch.zeros_like(squares)

    def scale(self, x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
        """x normalised by the whole vector's sum of squares (all ranks' shares summed)."""
        out = x.float() * torch.rsqrt(squares / self.total + self.eps) * self.weight.float()
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(x, all_reduce(self.squares(x)))


def sharded_rms_norms(pairs: tuple[tuple[ShardedRMSNorm, torch.Tensor], ...]
                      ) -> list[torch.Tensor]:
    """Several ShardedRMSNorms of the same rows with one all-reduce for all their sums of
    squares (OLMo 2's q_norm and k_norm: one collective a layer instead of two; at one
    decode row a collective's latency, not its bytes, is the cost)."""
    squares = all_reduce(torch.cat([norm.squares(x) for norm, x in pairs], dim=-1))
    return [norm.scale(x, squares[..., i:i + 1]) for i, (norm, x) in enumerate(pairs)]


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden: int, eps: float = 1e-5, bias: bool = True,
                 weight_offset: float = 0.0) -> None:
        """weight_offset: the checkpoint stores the weight as an offset from this value
        (Nemotron's LayerNorm1P applies (1 + w)). It is added once, at load, in the
        parameter's dtype after the cast, as transformers' `weight + 1.0` on the model-dtype
        parameter rounds it, so the parameter holds the weight applied and each step runs
        the plain layer norm (no extra launch per norm)."""
        super().__init__(hidden, eps=eps, bias=bias)
        self.weight_offset = float(weight_offset)
        self.weight.requires_grad_(False)
        self.weight.weight_loader = self.load_offset if self.weight_offset else copy_full
        if self.bias is not None:
            self.bias.requires_grad_(False)
            self.bias.weight_loader = copy_full

    def load_offset(self, param: nn.Parameter, w: TensorSlice) -> None:
        copy_full(param, w)
        param.data.add_(self.weight_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """layernorm(x); with a residual, (layernorm(x + residual), x + residual), as
        RMSNorm.forward, so the Llama blocks take either norm (StarCoder2)."""
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


class HeadLayerNorm(nn.Module):
    """A bias-free LayerNorm over each head's head_dim features with a weight of its own per
    head (Cohere's q_norm / k_norm, weight [heads, head_dim] on disk): this rank holds heads
    [start, start + heads) of `total`, whole, so no collective is needed. Mean, variance and
    the weight in float32, then the cast back, as transformers' CohereLayerNorm. Takes rows
    of one head each ([tokens * heads, head_dim], LlamaAttention's q_norm call)."""

    def __init__(self, total: int, start: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.total, self.start, self.heads, self.eps = total, start, heads, eps
        self.weight = nn.Parameter(torch.empty(heads, head_dim), requires_grad=False)
        self.weight.weight_loader = self.load_heads

    def load_heads(self, param: nn.Parameter, w: TensorSlice) -> None:
        expect_shape(w, (self.total, param.shape[1]))
        copy_narrow(param, w, 0, self.start, self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.weight.shape[1]
        h = x.float().view(-1, self.heads, d)
        h = torch.nn.functional.layer_norm(h, (d,), eps=self.eps) * self.weight.float()
        return h.to(x.dtype).view(x.shape)

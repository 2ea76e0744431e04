"""Portable reference: dequantize one layer's weight, then matmul. Runs wherever torch does
(CPU, CUDA, XPU); every other kernel is tested against it."""

from __future__ import annotations

import torch

from tpserve.kernels.quant.base import QuantKernel

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> int32 [K, N] nibbles (row 8r + i from bits 4i.. of row r)."""
    shifts = _SHIFTS.to(qweight.device).view(1, 8, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF
    return q.reshape(-1, qweight.shape[-1])


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """[K, N] in scales' dtype."""
    q = unpack_rows(qweight)
    k = q.shape[0]
    groups = g_idx.long() if g_idx is not None else \
        torch.arange(k, device=q.device) // group_size
    return (q.to(scales.dtype) - zeros[groups]) * scales[groups]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 [N, K] from e4m3 [N, K] and its per-channel [N] or block scales (base.py)."""
    w = weight.to(torch.float32)
    if block is None:
        return w.mul_(scale.to(torch.float32).unsqueeze(1))
    bn, bk = block
    n, k = w.shape
    rows = scale.to(torch.float32).repeat_interleave(bn, dim=0)[:n]  # [N, ceil(K / bk)]
    whole = k // bk
    w[:, :whole * bk].view(n, whole, bk).mul_(rows[:, :whole, None])
    if k % bk:
        w[:, whole * bk:].mul_(rows[:, whole:])
    return w


class TorchQuantKernel(QuantKernel):
    name = "torch"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, method: str) -> str | None:
        if method == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            return f"torch {torch.__version__} has no float8_e4m3fn"
        return None

    def int4_matmul(self, x, qweight, scales, zeros, group_size, g_idx=None):
        # Dequantize in the wider of the scales' and x's dtypes, round once to x's.
        dt = torch.float32 if scales.dtype != x.dtype else x.dtype
        w = dequantize_int4(qweight, scales.to(dt), zeros.to(dt), group_size, g_idx)
        return x @ w.to(x.dtype)

    def fp8_matmul(self, x, weight, scale, block=None):
        # Scale in float32 before rounding to the activation dtype, as the checkpoint meant.
        return x @ dequantize_fp8(weight, scale, block).to(x.dtype).t()

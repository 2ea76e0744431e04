"""fp8 weights meeting fp8 activations (W8A8) for large batches: what an fp8 checkpoint whose
quantization_config says `"activation_scheme": "dynamic"` asks for.

Above MIN_ROWS rows (prefill chunks, decode batches of 17 and more) the weight-only kernels
(fp8 dequantized to bfloat16 in registers before each product) run at bfloat16's tensor-core
rate or below, and once a matmul is bound by the tensor cores the fp8 weights save nothing.
Here each activation row is cast to e4m3 with its own scale (the largest magnitude maps to
448) and the product runs on the fp8 tensor cores through `torch._scaled_mm` with row-wise
scales: the row's and each weight column's, applied to the float32 sum. On one H200 the
threshold of 16 rows beat 64 (32 requests: 5,820 against 5,287 tokens/s in-process;
docs/quantization.md). Rows of 16 and fewer keep the weight-only kernels (the one-row GEMV
reads the weight at the copy bandwidth), whose output does not depend on the activations'
rounding.

Only where it was run: CUDA compute capability 9.0+ (row-wise scaled matmul) with bfloat16
activations. Elsewhere (the CPU, XPU, older GPUs, float16 models) the weight-only kernels
serve every batch, and `why_not` says why.
"""

from __future__ import annotations

import functools
import os

import torch

from tpserve.kernels.kv_quant import FP8_MAX

# Rows above which the product runs in W8A8 (TPSERVE_W8A8_MIN_ROWS overrides, for A/B runs).
MIN_ROWS = int(os.environ.get("TPSERVE_W8A8_MIN_ROWS") or 16)


@functools.cache
def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return f"runs on NVIDIA GPUs only, not {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"row-wise scaled fp8 matmul needs compute capability 9.0+, this GPU has {cap}"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def why_not(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when x [M, K] @ weight [N, K]^T may run in W8A8 here, else the reason."""
    reason = _device_reason(x.device)
    if reason is None and x.dtype != torch.bfloat16:
        reason = f"row-wise scaled fp8 matmul writes bfloat16, the model runs in {x.dtype}"
    if reason is None and (weight.shape[0] % 16 or weight.shape[1] % 16):
        reason = f"weight {tuple(weight.shape)} is not a multiple of 16 in both dimensions"
    return reason


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): x [M, K] as e4m3 rows q with float32 scales s [M, 1], x ~ q * s."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    q = (xf * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, amax / FP8_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_torch, in one Triton launch where Triton runs."""
    from tpserve.kernels.fused_ops import use_triton

    return quantize_rows_triton(x) if use_triton(x) else quantize_rows_torch(x)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_torch's result from triton_jit.fp8_quant_rows_kernel (a program per row;
    five torch launches per matmul would cost more than the fp8 product saves in a decode
    step of 256 rows)."""
    from tpserve.kernels.quant import triton_jit

    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        triton_jit.fp8_quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0),
                                                BLOCK=1024, num_warps=4)
    return q, s


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 @ (weight [N, K] e4m3 * scale [N])^T -> [M, N] bfloat16, with x
    rounded to e4m3 per row (callers check why_not first)."""
    q, s = quantize_rows(x)
    return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.view(1, -1),
                            out_dtype=x.dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What w8a8_matmul computes, in float64 on any device: the rounded rows times the
    dequantized weight (the conformance oracle)."""
    q, s = quantize_rows_torch(x)
    xd = q.double() * s.double()
    wd = weight.double() * scale.double()[:, None]
    return xd @ wd.t()

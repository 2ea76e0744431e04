"""Triton weight-only GEMM/GEMV for CUDA and XPU: int4 (w4a16) and fp8 (w8a16) weights are
dequantized in registers, block by block, and never written back to memory, so a decode
step reads 0.5 (int4) or 1 (fp8) byte per weight instead of 2.

One row (M = 1, single-stream decode) takes the GEMV kernel: each program reduces
BLOCK_K x BLOCK_N tiles with multiply-and-sum. More rows take the tiled tl.dot GEMM (16-row
tiles up to M = 16, then 64). When the output tiles alone are too few programs to fill the
device, both split K across programs that add into a float32 output (split-K).
"""

from __future__ import annotations

import functools

import torch

from tpserve.kernels.quant.base import QuantKernel

try:  # Triton is optional: supports() says why when it is missing.
    import triton
    import triton.language as tl
except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
    triton = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = ""


if triton is not None:

    @triton.jit
    def _int4_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, K, offs_n, N, group_size,
                   sqk, sqn, ssg, ssn, HAS_GIDX: tl.constexpr, ROW_SCALES: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Dequantized weight rows [k0, k0 + BLOCK_K) x offs_n, float32 [BLOCK_K, BLOCK_N]
        (k0 a multiple of 8). Each packed int32 is loaded once and split into its 8 rows.
        ROW_SCALES: the block lies in one group (group_size a multiple of BLOCK_K, no g_idx),
        so one row of scales and zeros serves it."""
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask = (rows[:, None] < tl.cdiv(K, 8)) & (offs_n[None, :] < N)
        packed = tl.load(qw_ptr + rows[:, None] * sqk + offs_n[None, :] * sqn, mask=mask,
                         other=0)
        shifts = tl.arange(0, 8) * 4
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
        if ROW_SCALES:
            at = (k0 // group_size) * ssg + offs_n * ssn
            smask = (offs_n < N) & (k0 < K)  # a split-K tail block may start past K
            s = tl.load(s_ptr + at, mask=smask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + at, mask=smask, other=0.0).to(tl.float32)
            return (q - z[None, :]) * s[None, :]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        if HAS_GIDX:
            g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0)
        else:
            g = offs_k // group_size
        at = g[:, None] * ssg + offs_n[None, :] * ssn
        s = tl.load(s_ptr + at, mask=kmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + at, mask=kmask, other=0.0).to(tl.float32)
        return (q - z) * s

    @triton.jit
    def _fp8_tile(w_ptr, scale_ptr, k0, K, offs_n, N, swn, swk, BLOCK_K: tl.constexpr):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        w = tl.load(w_ptr + offs_n[None, :] * swn + offs_k[:, None] * swk, mask=mask, other=0.0)
        s = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)
        return w.to(tl.float32) * s[None, :]

    @triton.jit
    def _gemv_kernel(x_ptr, y_ptr, w_ptr, s_ptr, z_ptr, g_ptr, M, N, K, group_size,
                     sxm, sxk, sym, syn, s0, s1, ssg, ssn, K_SPAN: tl.constexpr,
                     FP8: tl.constexpr, HAS_GIDX: tl.constexpr, ROW_SCALES: tl.constexpr,
                     SPLIT_K: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """x of one row (M = 1); [BLOCK_N] outputs per program; K split SPLIT_K ways
        into spans of K_SPAN (a multiple of BLOCK_K; a constant, so the loop bounds are too:
        one compiled variant per layer shape)."""
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k_start = pid_k * K_SPAN
        for k0 in range(0, K_SPAN, BLOCK_K):
            offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m * sxm + offs_k * sxk, mask=offs_k < K, other=0.0)
            if FP8:
                w = _fp8_tile(w_ptr, s_ptr, k_start + k0, K, offs_n, N, s0, s1, BLOCK_K)
            else:
                w = _int4_tile(w_ptr, s_ptr, z_ptr, g_ptr, k_start + k0, K, offs_n, N,
                               group_size, s0, s1, ssg, ssn, HAS_GIDX, ROW_SCALES, BLOCK_K,
                               BLOCK_N)
            acc += tl.sum(x.to(tl.float32)[:, None] * w, axis=0)
        out = y_ptr + m * sym + offs_n * syn
        if SPLIT_K == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=offs_n < N)
        else:
            tl.atomic_add(out, acc, mask=offs_n < N)

    @triton.jit
    def _gemm_kernel(x_ptr, y_ptr, w_ptr, s_ptr, z_ptr, g_ptr, M, N, K, group_size,
                     sxm, sxk, sym, syn, s0, s1, ssg, ssn, K_SPAN: tl.constexpr,
                     FP8: tl.constexpr, HAS_GIDX: tl.constexpr, ROW_SCALES: tl.constexpr,
                     PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        k_start = tl.program_id(2) * K_SPAN
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, K_SPAN, BLOCK_K):
            k0 = k_start + kk
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            if FP8:
                w = _fp8_tile(w_ptr, s_ptr, k0, K, offs_n, N, s0, s1, BLOCK_K)
            else:
                w = _int4_tile(w_ptr, s_ptr, z_ptr, g_ptr, k0, K, offs_n, N, group_size,
                               s0, s1, ssg, ssn, HAS_GIDX, ROW_SCALES, BLOCK_K, BLOCK_N)
            acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32, input_precision=PRECISION)
        out = y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out, acc, mask=mask)


# Split-K tuning (not yet measured on a GPU: see benchmarks/quant_bench.py).
PROGRAMS_PER_SM = 8
MIN_K_BLOCKS = 2


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64  # XPU and the interpreter: a fixed guess, only steers split-K


def _split_k(tiles: int, k: int, block_k: int, sms: int) -> tuple[int, int]:
    """(splits, K span of each): enough programs for about PROGRAMS_PER_SM per SM when the
    output tiles alone are fewer, keeping at least MIN_K_BLOCKS K-blocks per program.
    Independent of the batch size within a path, so each layer shape compiles one variant
    per path. Split-K costs a memset and a cast per call on top of the kernel."""
    split = 1
    while tiles * split < PROGRAMS_PER_SM * sms and k // (split * 2) >= MIN_K_BLOCKS * block_k:
        split *= 2
    return split, triton.cdiv(triton.cdiv(k, split), block_k) * block_k


def _launch(x: torch.Tensor, n: int, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
            g: torch.Tensor | None, group_size: int, fp8: bool) -> torch.Tensor:
    m, k = x.shape
    if fp8:
        s0, s1, ssg, ssn = w.stride(0), w.stride(1), 0, 0
    else:
        s0, s1, ssg, ssn = w.stride(0), w.stride(1), s.stride(0), s.stride(1)
    has_gidx = g is not None and not fp8
    # Unused pointer arguments still need a tensor: pass the scales.
    z = z if z is not None else s
    g = g if g is not None else s
    gemv = m == 1
    bm, bn, bk = (1, 64, 128) if gemv else ((16, 64, 64) if m <= 16 else (64, 64, 64))
    tiles = triton.cdiv(n, bn) * (1 if gemv else triton.cdiv(m, bm))
    split, k_span = _split_k(tiles if m <= 16 else 4 * _num_sms(x.device), k, bk,
                             _num_sms(x.device))
    y = torch.zeros(m, n, device=x.device, dtype=torch.float32) if split > 1 else \
        torch.empty(m, n, device=x.device, dtype=x.dtype)
    common = dict(K_SPAN=k_span, FP8=fp8, HAS_GIDX=has_gidx,
                  ROW_SCALES=not has_gidx and group_size % bk == 0, SPLIT_K=split,
                  BLOCK_K=bk, BLOCK_N=bn)
    args = (x, y, w, s, z, g, m, n, k, group_size, x.stride(0), x.stride(1), y.stride(0),
            y.stride(1), s0, s1, ssg, ssn)
    if gemv:
        _gemv_kernel[(1, triton.cdiv(n, bn), split)](*args, **common)
    else:
        # float32 activations get an exact float32 product, not TF32.
        _gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
            *args, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=bm,
            **common)
    return y.to(x.dtype) if split > 1 else y
class TritonQuantKernel(QuantKernel):
    name = "triton"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, method: str) -> str | None:
        if triton is None:
            return f"triton is not importable ({_IMPORT_ERROR})"
        if device.type not in ("cuda", "xpu"):
            return f"runs on CUDA and XPU devices, not {device.type}"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"activation dtype {dtype} is not supported"
        if method == "fp8":
            # Triton converts e4m3 in registers only from sm89 (Ada, Hopper) on; elsewhere the
            # torch reference dequantizes each layer on the fly.
            if device.type != "cuda":
                return "fp8 weights in Triton are supported on CUDA sm89+ only"
            cap = torch.cuda.get_device_capability(device)
            if cap < (8, 9):
                return f"fp8 weights need CUDA compute capability 8.9+, this GPU has {cap}"
        return None

    def int4_matmul(self, x, qweight, scales, zeros, group_size, g_idx=None):
        return _launch(x, qweight.shape[1], qweight, scales, zeros, g_idx, group_size, False)

    def fp8_matmul(self, x, weight, scale):
        return _launch(x, weight.shape[0], weight, scale, None, None, 1, True)

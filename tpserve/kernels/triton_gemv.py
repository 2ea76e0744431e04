"""The one-row dense GEMV in Triton (CUDA, and XPU through Intel's Triton backend): y = x W^T
for x of one row and W [N, K] as nn.Linear holds it (K contiguous).

Imported only by gemv.py once Triton is known to be importable. Why it exists: at one row a
decode step is a chain of weight reads, and the vendor GEMM reads the small projections
(QKV, o_proj) at about 75% of the copy bandwidth and splits some shapes' K into a second
reduction kernel (docs/benchmarks.md). Here every program owns BLOCK_N whole output rows,
so there is no reduction pass, and the weight tile of the next iteration can be loaded
before this one is reduced (PREFETCH: Triton leaves this plain loop unpipelined; a
tl.range loop with num_stages would be, as the int4 GEMV's Tile.pipeline is).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpserve.kernels.triton_fused import gated
from tpserve.kernels.triton_pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _w_tile(ptrs, k0, K, nmask, offs_k, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile at K offset k0 (masked off entirely once k0 >= K)."""
    if EVEN:  # one mask for the whole tile: whether it lies before K
        return tl.load(ptrs + k0, mask=k0 < K, other=0.0)
    return tl.load(ptrs + k0, mask=nmask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, N, K, swn, eps, EVEN_N: tl.constexpr,
                EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, RMS: tl.constexpr, RESIDUAL: tl.constexpr,
                PDL: tl.constexpr):
    """Program n: out[n * BLOCK_N + i] = sum_k x[k] W[n * BLOCK_N + i, k], in float32. The
    products stay a [BLOCK_N, BLOCK_K] tile in registers and are summed once, at the end.
    EVEN_N / EVEN_K: N and K are multiples of the block (no masks, so loads stay 128-bit).
    The first weight tile is loaded before anything else: with PDL (kernels/pdl.py) that load
    overlaps the previous kernel, since weights do not change; x is read only after the wait.
    PREFETCH: each next tile is loaded before this one is reduced, else after.
    RMS: x is first divided by its root mean square (eps added to the mean square), with no
    weight: the norm's weight was folded into W (layers/norm.py, RMSNorm.fold_into). Every
    program reads the whole of x anyway, so the squares are summed in the same loop and the
    scale applied once per output: the norm costs no launch and no extra read. (It does
    cost a reduction per program: free for QKV's 768 programs on an H200, 5% for the gated
    [gate; up] projection's 7,168, so only the norm before attention is folded;
    docs/benchmarks.md.)
    RESIDUAL: out = res + y, y rounded to out's dtype first (as a separate add would see it):
    the residual stream's add done by the layer that feeds it."""
    if PDL:
        gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * swn + offs_k[None, :]
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    w = _w_tile(ptrs, 0, K, nmask, offs_k, EVEN, BLOCK_K)
    if PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if PREFETCH:
            nxt = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if RMS:
            sq += x * x
        acc += w.to(tl.float32) * x[None, :]
        if PREFETCH:
            w = nxt
        else:
            w = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if RMS:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    dtype = out_ptr.dtype.element_ty
    if RESIDUAL:
        r = tl.load(res_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        y = y.to(dtype).to(tl.float32) + r
    if EVEN_N:
        tl.store(out_ptr + offs_n, y.to(dtype))
    else:
        tl.store(out_ptr + offs_n, y.to(dtype), mask=nmask)


@triton.jit
def gemv_gated_kernel(x_ptr, w_ptr, out_ptr, N, K, swn, EVEN_N: tl.constexpr,
                      EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GELU_TANH: tl.constexpr, PDL: tl.constexpr):
    """A gated MLP's one-row [gate; up] projection and its activation in one launch: W is
    [2N, K] with the gate rows first, and program n writes out[i] = act(g_i) * u_i for its
    BLOCK_N outputs i, g_i = x . W[i] and u_i = x . W[N + i], each rounded to the output's
    dtype first (as the separate GEMV and gated_act_kernel round them). A program reads
    BLOCK_N gate rows and the BLOCK_N matching up rows: the same bytes as a plain GEMV
    program of 2 * BLOCK_N rows, with no [gate; up] row written or read back."""
    if PDL:
        gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * swn + offs_k[None, :]
    # N may arrive as a Python int (Triton specialises N = 1): offset as a tensor.
    u_ptrs = w_ptr + (offs_n + N).to(tl.int64)[:, None] * swn + offs_k[None, :]
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    wg = _w_tile(g_ptrs, 0, K, nmask, offs_k, EVEN, BLOCK_K)
    wu = _w_tile(u_ptrs, 0, K, nmask, offs_k, EVEN, BLOCK_K)
    if PDL:
        gdc_wait()
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if PREFETCH:
            next_g = _w_tile(g_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
            next_u = _w_tile(u_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc_g += wg.to(tl.float32) * x[None, :]
        acc_u += wu.to(tl.float32) * x[None, :]
        if PREFETCH:
            wg = next_g
            wu = next_u
        else:
            wg = _w_tile(g_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
            wu = _w_tile(u_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=1).to(dtype).to(tl.float32)
    u = tl.sum(acc_u, axis=1).to(dtype).to(tl.float32)
    y = gated(g, u, dtype, GELU_TANH)
    if EVEN_N:
        tl.store(out_ptr + offs_n, y)
    else:
        tl.store(out_ptr + offs_n, y, mask=nmask)


KERNELS = (gemv_kernel, gemv_gated_kernel)

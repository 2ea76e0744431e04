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
def _rstd(sq, ss_ptr, ss_in, K, eps, RMS: tl.constexpr):
    """1 / rms(x) for the RMS modes: 1, from the squares this program summed over x; 2, from
    the sum of squares the layer that wrote x left in ss_ptr[ss_in] (read after the wait)."""
    if RMS == 1:
        total = tl.sum(sq, axis=0)
    else:
        total = tl.load(ss_ptr + ss_in)
    return tl.rsqrt(total / K + eps)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, res_ptr, ss_ptr, parts_ptr, cnt_ptr, N, K, swn, eps,
                ss_in, ss_out, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                RMS: tl.constexpr, RESIDUAL: tl.constexpr, SS_OUT: tl.constexpr,
                PARTS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Program n: out[n * BLOCK_N + i] = sum_k x[k] W[n * BLOCK_N + i, k], in float32. The
    products stay a [BLOCK_N, BLOCK_K] tile in registers and are summed once, at the end.
    EVEN_N / EVEN_K: N and K are multiples of the block (no masks, so loads stay 128-bit).
    The first weight tile is loaded before anything else: with PDL (kernels/pdl.py) that load
    overlaps the previous kernel, since weights do not change; x is read only after the wait.
    PREFETCH: each next tile is loaded before this one is reduced, else after.

    Folded norms (layers/norm.py, RMSNorm.fold_into: the norm's weight is in W):
    RMS: x is divided by its root mean square (eps added to the mean square), applied once
    per output. 1: every program sums x's squares in its own loop (each reads all of x) and
    reduces them at the end; 2: the sum is read from ss_ptr[ss_in], where the layer that
    wrote x left it (SS_OUT), which spares every program that reduction: measured on an
    H200, mode 1 cost the gated MLP projection's 7,168 programs 6% (docs/benchmarks.md).
    RESIDUAL: out = res + y, y rounded to out's dtype first (as a separate add would see it):
    the residual stream's add done by the layer that feeds it.
    SS_OUT: ss_ptr[ss_out] = the sum of squares of out as stored. Each program stores its
    outputs' sum to parts_ptr[program] and counts itself at cnt_ptr[ss_out]; the last to
    arrive sums the parts in program order (deterministic, unlike atomic float adds),
    writes the slot and puts the counter back to zero for the next launch."""
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
        if RMS == 1:
            sq += x * x
        acc += w.to(tl.float32) * x[None, :]
        if PREFETCH:
            w = nxt
        else:
            w = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if RMS != 0:
        y = y * _rstd(sq, ss_ptr, ss_in, K, eps, RMS)
    dtype = out_ptr.dtype.element_ty
    if RESIDUAL:
        r = tl.load(res_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        y = y.to(dtype).to(tl.float32) + r
    y = y.to(dtype)
    if EVEN_N:
        tl.store(out_ptr + offs_n, y)
    else:
        tl.store(out_ptr + offs_n, y, mask=nmask)
    if SS_OUT:
        yf = tl.where(nmask, y.to(tl.float32), 0.0)
        tl.store(parts_ptr + tl.program_id(0), tl.sum(yf * yf, axis=0))
        # The barrier makes every thread's stores part of the counter's release.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + ss_out, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            p = tl.arange(0, PARTS_PAD)
            parts = tl.load(parts_ptr + p, mask=p < tl.num_programs(0), other=0.0,
                            cache_modifier=".cg")  # through L2, where the others stored
            tl.store(ss_ptr + ss_out, tl.sum(parts, axis=0))
            tl.atomic_xchg(cnt_ptr + ss_out, 0)


@triton.jit
def gemv_gated_kernel(x_ptr, w_ptr, out_ptr, ss_ptr, N, K, swn, eps, ss_in,
                      EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GELU_TANH: tl.constexpr,
                      RMS: tl.constexpr, PDL: tl.constexpr):
    """A gated MLP's one-row [gate; up] projection and its activation in one launch: W is
    [2N, K] with the gate rows first, and program n writes out[i] = act(g_i) * u_i for its
    BLOCK_N outputs i, g_i = x . W[i] and u_i = x . W[N + i], each rounded to the output's
    dtype first (as the separate GEMV and gated_act_kernel round them). A program reads
    BLOCK_N gate rows and the BLOCK_N matching up rows: the same bytes as a plain GEMV
    program of 2 * BLOCK_N rows, with no [gate; up] row written or read back. RMS: as in
    gemv_kernel, x normalised on the way in."""
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
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if PREFETCH:
            next_g = _w_tile(g_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
            next_u = _w_tile(u_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if RMS == 1:
            sq += x * x
        acc_g += wg.to(tl.float32) * x[None, :]
        acc_u += wu.to(tl.float32) * x[None, :]
        if PREFETCH:
            wg = next_g
            wu = next_u
        else:
            wg = _w_tile(g_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
            wu = _w_tile(u_ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if RMS != 0:
        rstd = _rstd(sq, ss_ptr, ss_in, K, eps, RMS)
        g = g * rstd
        u = u * rstd
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    y = gated(g, u, dtype, GELU_TANH)
    if EVEN_N:
        tl.store(out_ptr + offs_n, y)
    else:
        tl.store(out_ptr + offs_n, y, mask=nmask)


KERNELS = (gemv_kernel, gemv_gated_kernel)

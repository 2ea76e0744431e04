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

from tpserve.kernels.triton_pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _w_tile(ptrs, k0, K, nmask, offs_k, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile at K offset k0 (masked off entirely once k0 >= K)."""
    if EVEN:  # one mask for the whole tile: whether it lies before K
        return tl.load(ptrs + k0, mask=k0 < K, other=0.0)
    return tl.load(ptrs + k0, mask=nmask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, swn, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr):
    """Program n: out[n * BLOCK_N + i] = sum_k x[k] W[n * BLOCK_N + i, k], in float32. The
    products stay a [BLOCK_N, BLOCK_K] tile in registers and are summed once, at the end.
    EVEN_N / EVEN_K: N and K are multiples of the block (no masks, so loads stay 128-bit).
    The first weight tile is loaded before anything else: with PDL (kernels/pdl.py) that load
    overlaps the previous kernel, since weights do not change; x is read only after the wait.
    PREFETCH: each next tile is loaded before this one is reduced, else after."""
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
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if PREFETCH:
            nxt = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)
        else:
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if PREFETCH:
            w = nxt
        else:
            w = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if EVEN_N:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _residual_sum(x_ptr, res_ptr, kk, K, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """x + res at kk in float32, rounded once to the activations' dtype as the residual
    stream holds it (add_rms_norm_kernel's rounding); 0 past K."""
    if EVEN_K:
        h = tl.load(x_ptr + kk).to(tl.float32)
        if HAS_RES:
            h += tl.load(res_ptr + kk).to(tl.float32)
    else:
        h = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if HAS_RES:
            h += tl.load(res_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    if HAS_RES:
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def gemv_rms_norm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, res_out_ptr, N, K, swn, eps,
                         offset, HAS_RES: tl.constexpr, CAST_FIRST: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """gemv_kernel with add + RMSNorm in front, for one row: out = rmsnorm(x + res) W^T, and
    program 0 writes x + res to res_out (the residual stream for the next layer). At one
    row the norm was a launch of its own whose one program sat on the step's critical path
    (0.18 ms of a 4.1 ms Llama-3-8B step on an H200, benchmarks/engine_step.py --ablate).
    Here every program first sums the row's squares (the row is a few KB, read from L2 in
    ROW_BLOCK pieces, normally one) and then normalises each K-block as it meets it, with
    add_rms_norm_kernel's roundings, so the products are those of the two launches.
    res_out must not alias x or res: other programs still read them."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * swn + offs_k[None, :]
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    w = _w_tile(ptrs, 0, K, nmask, offs_k, EVEN, BLOCK_K)
    if PDL:
        gdc_wait()
    dtype = out_ptr.dtype.element_ty
    offs_r = tl.arange(0, ROW_BLOCK)
    squares = tl.zeros((ROW_BLOCK,), dtype=tl.float32)
    for r0 in range(0, K, ROW_BLOCK):
        rr = r0 + offs_r
        h = _residual_sum(x_ptr, res_ptr, rr, K, HAS_RES, False)
        squares += h * h
        if HAS_RES:
            tl.store(res_out_ptr + rr, h.to(dtype), mask=(rr < K) & (pid == 0))
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if PREFETCH:
            nxt = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
        h = _residual_sum(x_ptr, res_ptr, kk, K, HAS_RES, EVEN_K) * rstd
        if EVEN_K:
            g = tl.load(nw_ptr + kk)
        else:
            g = tl.load(nw_ptr + kk, mask=kk < K, other=0.0)
        if CAST_FIRST:  # Llama: (weight + offset) in the weight's dtype times h in x's
            gq = (g.to(tl.float32) + offset).to(g.dtype).to(tl.float32)
            y = h.to(dtype).to(tl.float32) * gq
        else:  # Gemma: in float32, one rounding
            y = h * (g.to(tl.float32) + offset)
        acc += w.to(tl.float32) * y.to(dtype).to(tl.float32)[None, :]
        if PREFETCH:
            w = nxt
        else:
            w = _w_tile(ptrs, k0 + BLOCK_K, K, nmask, offs_k, EVEN, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if EVEN_N:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


KERNELS = (gemv_kernel, gemv_rms_norm_kernel)

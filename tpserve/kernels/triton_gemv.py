"""The one-row dense GEMV in Triton (CUDA, and XPU through Intel's Triton backend): y = x W^T
for x of one row and W [N, K] as nn.Linear holds it (K contiguous).

Imported only by gemv.py once Triton is known to be importable. Why it exists: at one row a
decode step is a chain of weight reads, and the vendor GEMM reads the small projections
(QKV, o_proj) at about 75% of the copy bandwidth and splits some shapes' K into a second
reduction kernel (docs/benchmarks.md). Here every program owns BLOCK_N whole output rows,
so there is no reduction pass, and the weight tile of the next iteration is loaded before
this one is reduced (PREFETCH: Triton does not pipeline loops without a dot).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, swn, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program n: out[n * BLOCK_N + i] = sum_k x[k] W[n * BLOCK_N + i, k], in float32. The
    products stay a [BLOCK_N, BLOCK_K] tile in registers and are summed once, at the end.
    EVEN_N / EVEN_K: N and K are multiples of the block (no masks, so loads stay 128-bit)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * swn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:
        if EVEN_N and EVEN_K:
            nxt = tl.load(ptrs)
        else:
            nxt = tl.load(ptrs, mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        if PREFETCH:
            w = nxt
            if EVEN_N and EVEN_K:  # one mask for the whole tile: past the last block
                nxt = tl.load(ptrs + k0 + BLOCK_K, mask=k0 + BLOCK_K < K, other=0.0)
            else:
                nxt = tl.load(ptrs + k0 + BLOCK_K,
                              mask=nmask[:, None] & (kk + BLOCK_K < K)[None, :], other=0.0)
        elif EVEN_N and EVEN_K:
            w = tl.load(ptrs + k0)
        else:
            w = tl.load(ptrs + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if EVEN_K:
            x = tl.load(x_ptr + kk).to(tl.float32)
        else:
            x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if EVEN_N:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


KERNELS = (gemv_kernel,)

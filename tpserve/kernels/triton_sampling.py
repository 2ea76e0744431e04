"""Sampling kernels (Triton) for tpserve/layers/sampler.py.

Gumbel-max draw in one pass over the vocabulary: the torch path builds the [rows, vocab]
noise with about twenty int64 tensor passes; this kernel hashes, converts and takes the
arg-max in registers, reading the filtered logits once. The hash and the float64 transform
are the sampler's (`gumbel_noise`), bit for bit up to the last ulp of `log`, so a seeded row
draws the same token on either path.

Greedy rows with their log-probability: torch's argmax and log-softmax each reduce a row in
one thread block, 28 us apiece for one row of 128k logits on an H200, the longest kernels of
a batch-1 step after the weight reads. Here each row is cut into chunks that many programs
reduce at once (max, its first index, and the sum of exp(x - max)), and one program per row
combines them: log p(argmax) = -log(sum), as log-softmax gives it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mix32(h):
    # Each product cast back to uint32: wraps mod 2**32 however the literal is typed.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B).to(tl.uint32)
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35).to(tl.uint32)
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["vocab", "stride_f"], do_not_specialize_on_alignment=["keys_ptr"])
def gumbel_argmax_kernel(f_ptr, keys_ptr, out_ptr, vocab, stride_f, BLOCK: tl.constexpr):
    """out[row] = argmax_i f[row, i] + Gumbel(key[row], i), the first index on ties."""
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < vocab
        x = tl.load(f_ptr + row * stride_f + idx, mask=ok, other=float("-inf"))
        # uint32 arithmetic mod 2**32, as the torch path's split multiply computes it.
        h = _mix32(_mix32(key ^ (idx.to(tl.uint32) * 0x9E3779B1).to(tl.uint32)))
        w = (h.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2**-32
        w = tl.minimum(w, 1.0 - 5.960464477539063e-08)  # 1 - 2**-24
        e = tl.where(w < 1e-6, w + 0.5 * w * w, -tl.log(1.0 - w))
        v = x + (-tl.log(e)).to(tl.float32)
        better = v > best
        best = tl.where(better, v, best)
        best_i = tl.where(better, idx, best_i)
    top = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    tl.store(out_ptr + row, tl.where(top == float("-inf"), 0, pick).to(tl.int64))


@triton.jit(do_not_specialize=["vocab", "stride_x"])
def greedy_chunk_kernel(x_ptr, m_ptr, i_ptr, s_ptr, vocab, stride_x, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row, c) over logits [c * CHUNK, (c + 1) * CHUNK): the largest value (NaN
    counts as the largest, as in torch.argmax), its first index, and sum exp(x - largest);
    written to m/i/s [rows, chunks]."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32) + c * CHUNK
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < vocab,
                    other=float("-inf")).to(tl.float32)
        key = tl.where(x != x, float("inf"), x)  # NaN wins the arg-max, as in torch
        better = key > best
        new = tl.maximum(best, key)
        # Online sum of exp(x - max) per lane; a lane still at -inf adds nothing.
        total = tl.where(new == float("-inf"), 0.0,
                         total * tl.exp(best - new) + tl.exp(x - new))
        best_i = tl.where(better, idx, best_i)
        best = new
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    part = tl.sum(tl.where(best == float("-inf"), 0.0, total * tl.exp(best - top)), axis=0)
    at = row * chunks + c
    tl.store(m_ptr + at, top)
    tl.store(i_ptr + at, first)
    tl.store(s_ptr + at, part)


@triton.jit(do_not_specialize=["chunks"])
def greedy_combine_kernel(m_ptr, i_ptr, s_ptr, tok_ptr, lp_ptr, chunks, CHUNKS: tl.constexpr):
    """One program per row: the chunks' (max, first index, sum) -> the arg-max token and its
    log-probability -log(sum exp(x - max)). Chunks lie in index order, so the first chunk
    holding the row's max holds its first index."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < chunks
    m = tl.load(m_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(i_ptr + row * chunks + c, mask=ok, other=2147483647)
    s = tl.load(s_ptr + row * chunks + c, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    first = tl.min(tl.where(m == top, i, 2147483647), axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
    # A row of -inf (or with +inf or NaN) has no finite log-probability: NaN, as log-softmax.
    lp = tl.where(top == float("-inf"), float("nan"), -tl.log(total))
    tl.store(tok_ptr + row, tl.where(top == float("-inf"), 0, first).to(tl.int64))
    tl.store(lp_ptr + row, lp)


KERNELS = (gumbel_argmax_kernel, greedy_chunk_kernel, greedy_combine_kernel)

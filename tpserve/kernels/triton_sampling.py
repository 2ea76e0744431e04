"""Gumbel-max draw in one pass over the vocabulary (Triton), for tpserve/layers/sampler.py.

The torch path builds the [rows, vocab] noise with about twenty int64 tensor passes; this
kernel hashes, converts and takes the arg-max in registers, reading the filtered logits once.
The hash and the float64 transform are the sampler's (`gumbel_noise`), bit for bit up to the
last ulp of `log`, so a seeded row draws the same token on either path.
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


KERNELS = (gumbel_argmax_kernel,)

"""Rotary embedding and fp8 rounding as Triton device functions, shared by the fused
rotary + cache-write kernel (triton_fused.py), the decode kernel that writes its own new
keys (triton_kernels.py) and the W8A8 row quantization (quant/triton_jit.py). The arithmetic follows the torch reference (fused_ops.py): each
product and the sum are rounded to the model dtype, as torch computes them in it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp8_range(x, inv_scale):
    """float32 -> x / scale clamped to e4m3's +-448, which the store then rounds to nearest
    (kv_quant.quantize: e4m3's cast is not saturating everywhere)."""
    return tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32:
    3 mantissa bits for normal values (a carry moves into the exponent by itself), steps of
    2^-9 below 2^-6 (e4m3's subnormals: adding and taking away 1.5 * 2^14 rounds there).
    The cast that follows is then exact on every backend (Triton's interpreter, for one,
    drops the carry when it rounds 125.8 to e4m3 itself)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -1048576  # keep 3 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    sub = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _rotate(x, xp, c, s, d, dtype: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr):
    """x * cos + rotate_half(x) * sin on dims d < ROT (float32 in, float32 out), xp being x's
    partner dims (d + HALF, or d - HALF past the half); dims past ROT pass through."""
    xp = tl.where(d < HALF, -xp, xp)
    y = (x * c).to(dtype).to(tl.float32) + (xp * s).to(dtype).to(tl.float32)
    return tl.where(d < ROT, y, x)


@triton.jit
def _rotate_heads(x_ptr, stride_h, h, mask, d, cos_row_ptr, sin_row_ptr, HALF: tl.constexpr,
                  ROT: tl.constexpr):
    """The rotated heads h ([HB, len(d)] float32, zeros where not mask) of one token's row
    x_ptr. mask: [HB, 1] (heads), or [HB, len(d)] where d pads the head to a power of two
    (the padding reads as zeros)."""
    dtype = x_ptr.dtype.element_ty
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    row = x_ptr + h[:, None] * stride_h
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask & (d < ROT)[None, :],
                 other=0.0).to(tl.float32)
    c = tl.load(cos_row_ptr + d, mask=d < ROT, other=1.0).to(dtype).to(tl.float32)[None, :]
    s = tl.load(sin_row_ptr + d, mask=d < ROT, other=0.0).to(dtype).to(tl.float32)[None, :]
    return _rotate(x, xp, c, s, d[None, :], dtype, HALF, ROT)


@triton.jit
def _rotate_row(row_ptr, d, ok, cos_row_ptr, sin_row_ptr, HALF: tl.constexpr,
                ROT: tl.constexpr):
    """One head's rotated row ([len(d)] float32; zeros where not ok, nothing loaded)."""
    dtype = row_ptr.dtype.element_ty
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    x = tl.load(row_ptr + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(row_ptr + partner, mask=ok & (d < ROT), other=0.0).to(tl.float32)
    c = tl.load(cos_row_ptr + d, mask=ok & (d < ROT), other=1.0).to(dtype).to(tl.float32)
    s = tl.load(sin_row_ptr + d, mask=ok & (d < ROT), other=0.0).to(dtype).to(tl.float32)
    return _rotate(x, xp, c, s, d, dtype, HALF, ROT)


@triton.jit
def _dims_ok(ok, d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """ok, and d < HEAD_DIM where a tile pads a head's dims to HEAD_PAD (tl.arange and
    tl.dot take powers of two only: heads of 80, 96 or 192 dims). A power-of-two head gets
    ok unchanged, so its loads and stores compile as they did before padding existed."""
    if HEAD_PAD != HEAD_DIM:
        ok = ok & (d < HEAD_DIM)
    return ok

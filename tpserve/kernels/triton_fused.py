"""Fused per-layer kernels in Triton: residual add + RMSNorm, gated activations, and rotary
embedding + paged KV-cache write. Each replaces several torch launches of a decode step.

Imported only by fused_ops.py once Triton is known to be importable. Every kernel rounds its
intermediates to the model dtype where the torch reference does (fused_ops.py), so the two
paths agree to the last bit in most elements. Runtime sizes (rows, columns) are not
specialised: the compile key is fixed per model (dtype, hidden size, head_dim, flags), so the
warmup forward compiles every variant serving will use.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpserve.kernels.triton_kernels import _tanh  # one exp-based tanh for every backend
from tpserve.kernels.triton_pdl import pdl_enter
from tpserve.kernels.triton_rotary import _dims_ok, _fp8_range, _rotate_heads


@triton.jit(do_not_specialize=["n_cols", "stride_x", "stride_r", "stride_o", "stride_ro"])
def add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, offset,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, CAST_FIRST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row: res_out = x + res (rounded to the dtype), out = rmsnorm(res_out)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = x.to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
        x = x.to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if CAST_FIRST:  # Llama: (weight + offset) in the weight's dtype times h in the input's
        wq = (w.to(tl.float32) + offset).to(w.dtype).to(tl.float32)
        out = h.to(dtype).to(tl.float32) * wq
    else:  # Gemma: everything in float32, one rounding at the end
        out = h * (w.to(tl.float32) + offset)
    tl.store(out_ptr + row * stride_o + cols, out.to(dtype), mask=ok)


@triton.jit(do_not_specialize=["n_cols", "stride_x", "stride_o"])
def gated_act_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o,
                     GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out = act(gate) * up over x = [gate; up]: one program per (row, BLOCK columns)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, gated(g, u, dtype, GELU_TANH), mask=ok)


@triton.jit
def gated(g, u, dtype: tl.constexpr, GELU_TANH: tl.constexpr):
    """act(g) * u in dtype, from g and u already rounded to dtype (float32 values): the
    activation rounded to dtype before the product, as the torch reference computes it."""
    if GELU_TANH:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    return (a.to(dtype).to(tl.float32) * u).to(dtype)


@triton.jit(do_not_specialize=["stride_qt", "stride_qh", "stride_kt", "stride_kh",
                               "stride_vt", "stride_vh", "stride_cs", "stride_ot",
                               "stride_oh", "stride_slot", "stride_ch"],
            do_not_specialize_on_alignment=["slot_ptr"])
def rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_ot, stride_oh, stride_slot, stride_ch, k_inv_scale, v_inv_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr, HB: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Program (token, j) over cdiv(num_heads, HB) blocks of HB query heads, then
    cdiv(num_kv_heads, HB) blocks of KV heads: query heads are rotated into q_out; KV heads'
    rotated keys and their values go to the token's cache slot (a negative slot writes
    nothing). Several heads per program matter for prefill: at one head each, a 4096-token
    step launched 164k programs of 256 bytes, and scheduling them took 4x the time their
    bytes need (docs/benchmarks.md). KV_FP8: the cache is e4m3; the rotated key is rounded
    to the model dtype first, as the torch path stores it before quantizing. HEAD_PAD: the
    power of two >= HEAD_DIM that a tile's dims are padded to (masked)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, HEAD_PAD)
    cos_row = cos_ptr + t * stride_cs
    sin_row = sin_ptr + t * stride_cs
    Q_BLOCKS: tl.constexpr = (NUM_HEADS + HB - 1) // HB
    if j < Q_BLOCKS:
        h = j * HB + tl.arange(0, HB)
        hmask = _dims_ok((h < NUM_HEADS)[:, None], d[None, :], HEAD_DIM, HEAD_PAD)
        y = _rotate_heads(q_ptr + t * stride_qt, stride_qh, h, hmask, d, cos_row, sin_row,
                          ROT // 2, ROT)
        tl.store(q_out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
                 y.to(q_out_ptr.dtype.element_ty), mask=hmask)
    else:
        kh = (j - Q_BLOCKS) * HB + tl.arange(0, HB)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = _dims_ok(((kh < NUM_KV_HEADS) & (slot >= 0))[:, None], d[None, :], HEAD_DIM,
                      HEAD_PAD)
        y = _rotate_heads(k_ptr + t * stride_kt, stride_kh, kh,
                          _dims_ok((kh < NUM_KV_HEADS)[:, None], d[None, :], HEAD_DIM, HEAD_PAD),
                          d, cos_row, sin_row, ROT // 2, ROT)
        dst = slot * stride_slot + kh[:, None] * stride_ch + d[None, :]
        v = tl.load(v_ptr + t * stride_vt + kh[:, None] * stride_vh + d[None, :], mask=ok,
                    other=0.0)
        if KV_FP8:
            y = _fp8_range(y.to(k_ptr.dtype.element_ty).to(tl.float32), k_inv_scale)
            v = _fp8_range(v.to(tl.float32), v_inv_scale)
        tl.store(k_cache_ptr + dst, y.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


KERNELS = (add_rms_norm_kernel, gated_act_kernel, rotary_write_kv_kernel)

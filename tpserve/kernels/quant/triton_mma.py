"""The int4 GEMV of 1-16 activation rows on the tensor cores (NVIDIA sm_80+, bfloat16 or
float16).

Why: the CUDA-core GEMV (triton_jit.int4_gemv_n_kernel) spends several instructions per
weight on unpacking and multiply-adds, so on an H200 it is bound by instruction issue, not
by the bytes it reads (docs/quantization.md); the tensor-core tiles of 2-16 rows
(gemm_kernel) unpack through shared memory and read only ~1 TB/s. Here each warp feeds
`mma.sync.m16n8k16` straight from the registers its own loads filled, as Marlin-style
kernels do, with the operands swapped for small batches: A (16 x 16) is the weight tile,
16 output columns by 16 inputs, and B (16 x 8) holds x's rows as columns, so one
instruction multiplies 256 weights by up to 8 rows (a second one, same A, takes rows 8-15),
and unpacking costs one LOP3 per two weights plus a shift per four.

How the lanes meet the fragment layout of mma.sync (PTX ISA, m16n8k16 .bf16): lane (g, t) =
(lane // 4, lane % 4) holds A's rows g and g + 8 at columns (2t, 2t + 1) and (2t + 8,
2t + 9), B's rows (2t, 2t + 1) and (2t + 8, 2t + 9) of column g, and D's rows g and g + 8 at
columns (2t, 2t + 1). The order of k inside one product is free (a dot product), and so is
which output column each A row stands for, so both follow the checkpoint's packing instead
of a repacked copy. Per 64 inputs k0.. of a 64-column tile c..:
- lane (g, t) reads packed rows t and t + 4 (inputs k0 + 8t.. and k0 + 8t + 32..) of
  columns c + 4g .. c + 4g + 3 and c + 32 + 4g .. c + 32 + 4g + 3: four 128-bit loads;
- product (jb, i), jb, i in 0..3: A's row g is column c + 4g + jb, row g + 8 is column
  c + 32 + 4g + jb, and its k-pairs are nibbles (i, i + 4) of the packed rows t and t + 4,
  each pair one LOP3 into the 16-bit pair (BIAS + q_i, BIAS + q_{i+4}) (the float trick of
  triton_jit; BIAS is 128 in bfloat16, 16 in float16, _TYPES); B's matching pairs
  (x[k0 + 8t + i], x[k0 + 8t + i + 4]) are PRMTs of x;
- so D of product jb gives lane (g, t) columns c + 4g + jb and c + 32 + 4g + jb for x's
  rows 2t and 2t + 1 (and, from the second product, rows 8 + 2t and 9 + 2t).
The tensor cores multiply the biased values (BIAS + q) exactly and add in float32; the zero
point comes off once per group: s * (sum x (BIAS + q) - (BIAS + z) * sum x), where sum x is
one more product per k-pair against an A of ones (no cross-lane sums).

A program covers 64 output columns with W warps that share its K range group by group (the
words of the next AHEAD steps of 64 inputs are loaded before this one's products) and add
their partials through shared memory; where 64-column programs are too few for the GPU, K
is split over programs whose float32 partials the last to finish adds up
(triton_jit._sum_if_last). Checked on CUDA against a float64 oracle
(tests/kernels/test_int4_mma.py) and, served, against transformers (tests/test_int4_gpu.py);
the interpreter cannot run it (inline PTX). Both variants passed both on an H200; which
rows take it per type: triton_kernel.MMA_MIN_ROWS.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from tpserve.kernels.quant.triton_jit import _pairs_i_i4, _sum_if_last
from tpserve.kernels.triton_fused import gated
from tpserve.kernels.triton_pdl import gdc_launch_dependents, gdc_wait

COLS = tl.constexpr(64)  # output columns per program
ROWS = tl.constexpr(16)  # x rows at most (two products of B's 8 columns)
# Per 16-bit type: how nibble pair (i, i + 4) of a word becomes the pair (BIAS + q_i,
# BIAS + q_{i+4}) exactly. bfloat16 (7 mantissa bits): the nibble in bits 0-3 under the
# exponent of 128 (shift right by 4i, LOP3). float16 (10 mantissa bits): the nibble in bits
# 6-9 under the exponent of 16 (16 + q: a smaller bias, so less to cancel when the zero
# point comes off), shifted there by 6 - 4i.
_TYPES = {
    "bf16": dict(mask="0x000F000F", magic="0x43004300", one="0x3F803F80", bias=128.0,
                 shifts=(0, 4, 8, 12)),
    "f16": dict(mask="0x03C003C0", magic="0x4C004C00", one="0x3C003C00", bias=16.0,
                shifts=(-6, -2, 2, 6)),
}
_LOP = "lop3.b32 {d}, {s}, {mask}, {magic}, 0xEA;"
_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
        "{{{d}}}, {{{a}}}, {{{b}}}, {{{d}}};")


def _shift(dst: str, src: str, by: int) -> str:
    """dst = src >> by (by > 0) or << -by (by < 0)."""
    return f"shr.u32 {dst}, {src}, {by};" if by > 0 else f"shl.b32 {dst}, {src}, {-by};"


def _column_asm(rows16: bool, ty: str) -> str:
    """PTX of one 16-column product jb over 64 inputs: 4 mma, one per nibble pair i (8 with
    rows16: the same A against x's rows 8-15). Operands: the accumulators (4, or 8 with
    rows16; tied to the last inputs), then the words (column c + 4g + jb rows t, t + 4;
    column c + 32 + 4g + jb rows t, t + 4), x's pairs of packed rows t and t + 4 (row g),
    with rows16 those of row g + 8."""
    nd = 8 if rows16 else 4
    w = [nd + j for j in range(4)]
    p, q = nd + 4, nd + 8
    p2, q2 = nd + 12, nd + 16
    k = _TYPES[ty]
    lines = ["{", ".reg .b32 a0, a1, a2, a3, s0, s1, s2, s3;"]
    for i in range(4):
        by = k["shifts"][i]
        if by == 0:
            src = [f"${j}" for j in w]
        else:
            lines += [_shift(f"s{j}", f"${w[j]}", by) for j in range(4)]
            src = ["s0", "s1", "s2", "s3"]
        # A: row g (column c + 4g + jb) k 2t.. from packed row t, row g + 8 (column
        # c + 32 + ...) from row t, then the same two columns from packed row t + 4.
        lines += [_LOP.format(d=d, s=src[j], mask=k["mask"], magic=k["magic"])
                  for d, j in (("a0", 0), ("a1", 2), ("a2", 1), ("a3", 3))]
        lines += _mmas(ty, "$0, $1, $2, $3", "$4, $5, $6, $7", "a0, a1, a2, a3", i, (p, q),
                       (p2, q2) if rows16 else None)
    lines.append("}")
    return "\n".join(lines)


def _mmas(ty: str, d: str, d2: str, a: str, i: int, rows: tuple[int, int],
          rows8: tuple[int, int] | None) -> list[str]:
    """The mma of A (registers a) by x's pair i of rows 0-7 into d (B's registers: operands
    rows[0] + i and rows[1] + i), and with rows8 the same A by rows 8-15 into d2."""
    out = [_MMA.format(ty=ty, d=d, a=a, b=f"${rows[0] + i}, ${rows[1] + i}")]
    if rows8:
        out.append(_MMA.format(ty=ty, d=d2, a=a, b=f"${rows8[0] + i}, ${rows8[1] + i}"))
    return out


def _ones_asm(rows16: bool, ty: str) -> str:
    """PTX of x's row sums over the same 64 inputs: 4 mma (8 with rows16) of an A of ones
    by x's pairs, so D's columns (2t, 2t + 1) are rows 2t and 2t + 1 of sum x (and 8 + 2t,
    9 + 2t). Operands: the sums (2 or 4, tied to the last inputs), x's pairs as in
    _column_asm."""
    nd = 4 if rows16 else 2
    p, q, p2, q2 = nd, nd + 4, nd + 8, nd + 12
    one = _TYPES[ty]["one"]
    lines = ["{", ".reg .b32 o0, o1, o2, o3;", ".reg .f32 e0, e1, e2, e3;",
             f"mov.b32 o0, {one};", f"mov.b32 o1, {one};",
             f"mov.b32 o2, {one};", f"mov.b32 o3, {one};",
             "mov.f32 e0, 0f00000000;", "mov.f32 e1, 0f00000000;",
             "mov.f32 e2, 0f00000000;", "mov.f32 e3, 0f00000000;"]
    for i in range(4):
        lines += _mmas(ty, "$0, $1, e0, e1", "$2, $3, e2, e3", "o0, o1, o2, o3", i, (p, q),
                       (p2, q2) if rows16 else None)
    lines.append("}")
    return "\n".join(lines)


def _constraints(outputs: int, ints: int) -> str:
    return ",".join(["=f"] * outputs + ["r"] * ints + [str(j) for j in range(outputs)])


@functools.cache
def asm_for(rows16: bool, f16: bool) -> dict:
    """The kernel's PTX and bias for x's type and row count: its constexpr arguments."""
    ty = "f16" if f16 else "bf16"
    return dict(COLUMN=_column_asm(rows16, ty), ONES=_ones_asm(rows16, ty),
                BIAS=_TYPES[ty]["bias"])


_COLUMN8_C: tl.constexpr = tl.constexpr(_constraints(4, 12))
_COLUMN16_C: tl.constexpr = tl.constexpr(_constraints(8, 20))
_ONES8_C: tl.constexpr = tl.constexpr(_constraints(2, 8))
_ONES16_C: tl.constexpr = tl.constexpr(_constraints(4, 16))


@triton.jit
def _words4(ptr):
    """Four int32 words at ptr (16-byte aligned), one 128-bit load per lane. Weights never
    change while serving, so the load may move (is_pure)."""
    return tl.inline_asm_elementwise(
        "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _x_pairs8(xw_ptr, ok):
    """x's 8 16-bit inputs at the int32 pointer xw_ptr as the pairs (x_i, x_{i+4}),
    i = 0..3 (zeros where not ok)."""
    return _pairs_i_i4(tl.load(xw_ptr, mask=ok, other=0), tl.load(xw_ptr + 1, mask=ok, other=0),
                       tl.load(xw_ptr + 2, mask=ok, other=0),
                       tl.load(xw_ptr + 3, mask=ok, other=0))


@triton.jit
def _column(w, jb: tl.constexpr, p, q, p2, q2, acc, acc2, ROWS16: tl.constexpr,
            COLUMN: tl.constexpr):
    """Product jb (words w[jb], w[4 + jb], w[8 + jb], w[12 + jb]): acc's four accumulators
    (and acc2's, x's rows 8-15) updated."""
    if ROWS16:
        d = tl.inline_asm_elementwise(
            COLUMN, _COLUMN16_C,
            [w[jb], w[4 + jb], w[8 + jb], w[12 + jb], p[0], p[1], p[2], p[3],
             q[0], q[1], q[2], q[3], p2[0], p2[1], p2[2], p2[3], q2[0], q2[1], q2[2], q2[3],
             acc[4 * jb], acc[4 * jb + 1], acc[4 * jb + 2], acc[4 * jb + 3],
             acc2[4 * jb], acc2[4 * jb + 1], acc2[4 * jb + 2], acc2[4 * jb + 3]],
            dtype=(tl.float32, ) * 8, is_pure=True, pack=1)
        return (d[0], d[1], d[2], d[3]), (d[4], d[5], d[6], d[7])
    d = tl.inline_asm_elementwise(
        COLUMN, _COLUMN8_C,
        [w[jb], w[4 + jb], w[8 + jb], w[12 + jb], p[0], p[1], p[2], p[3],
         q[0], q[1], q[2], q[3], acc[4 * jb], acc[4 * jb + 1], acc[4 * jb + 2], acc[4 * jb + 3]],
        dtype=(tl.float32, ) * 4, is_pure=True, pack=1)
    return (d[0], d[1], d[2], d[3]), (acc2[4 * jb], acc2[4 * jb + 1], acc2[4 * jb + 2],
                                      acc2[4 * jb + 3])


@triton.jit
def _products(w, p, q, p2, q2, acc, acc2, u, ROWS16: tl.constexpr, COLUMN: tl.constexpr,
              ONES: tl.constexpr):
    """The 16 products of 64 inputs (4 columns jb x 4 nibble pairs) and x's row sums."""
    a, a2 = _column(w, 0, p, q, p2, q2, acc, acc2, ROWS16, COLUMN)
    b, b2 = _column(w, 1, p, q, p2, q2, acc, acc2, ROWS16, COLUMN)
    c, c2 = _column(w, 2, p, q, p2, q2, acc, acc2, ROWS16, COLUMN)
    d, d2 = _column(w, 3, p, q, p2, q2, acc, acc2, ROWS16, COLUMN)
    if ROWS16:
        u = tl.inline_asm_elementwise(
            ONES, _ONES16_C, [p[0], p[1], p[2], p[3], q[0], q[1], q[2], q[3],
                                 p2[0], p2[1], p2[2], p2[3], q2[0], q2[1], q2[2], q2[3],
                                 u[0], u[1], u[2], u[3]],
            dtype=(tl.float32, ) * 4, is_pure=True, pack=1)
    else:
        v = tl.inline_asm_elementwise(
            ONES, _ONES8_C, [p[0], p[1], p[2], p[3], q[0], q[1], q[2], q[3], u[0], u[1]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        u = (v[0], v[1], u[2], u[3])
    return ((a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3],
             c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3]),
            (a2[0], a2[1], a2[2], a2[3], b2[0], b2[1], b2[2], b2[3],
             c2[0], c2[1], c2[2], c2[3], d2[0], d2[1], d2[2], d2[3]), u)


@triton.jit
def _words_at(qw_ptr, j, g_lo, g_hi, warp, t, col, sqk, hoff, GROUP: tl.constexpr,
              W: tl.constexpr, FRAG: tl.constexpr = False, lane=0, cb=0, steps=0):
    """The lane's 16 words of its j-th step of 64 inputs: packed rows t and t + 4 of
    columns col..col + 3, then of col + hoff..col + hoff + 3 (hoff: 32, or a gated
    projection's up offset; a step past the split's last group reads that group again; its
    x is masked to 0). FRAG: the weight is in fragment order (frag_pack), where those 16
    words are four 16-byte runs of lane-ordered 512-byte blocks, so each load of a warp
    reads 512 contiguous bytes and a program's steps follow one another in memory
    (cb: the program's column block, steps: K / 64)."""
    IT: tl.constexpr = GROUP // 64
    gi = tl.minimum(g_lo + warp + W * (j // IT), g_hi - 1)
    if FRAG:
        fp = qw_ptr + (cb * steps + gi * IT + j % IT) * 512 + lane * 4
        a0, a1, a2, a3 = _words4(fp)
        b0, b1, b2, b3 = _words4(fp + 128)
        c0, c1, c2, c3 = _words4(fp + 256)
        d0, d1, d2, d3 = _words4(fp + 384)
        return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3
    rp = qw_ptr + ((gi * GROUP + 64 * (j % IT)) // 8 + t) * sqk + col
    a0, a1, a2, a3 = _words4(rp)
    b0, b1, b2, b3 = _words4(rp + 4 * sqk)
    c0, c1, c2, c3 = _words4(rp + hoff)
    d0, d1, d2, d3 = _words4(rp + 4 * sqk + hoff)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _apply(acc, ua, ub, s, zz, o, ODD: tl.constexpr):
    """o += s * (acc - (BIAS + z) * sum x) for the group just finished: acc and o indexed
    4 jb + 2h + r (column col + 32h + jb, x row 2t + r), s and zz (BIAS + z) 2 jb + h."""
    o0, o1 = _apply2(acc, 0, ua, ub, s[0], zz[0], o, ODD)
    o2, o3 = _apply2(acc, 2, ua, ub, s[1], zz[1], o, ODD)
    o4, o5 = _apply2(acc, 4, ua, ub, s[2], zz[2], o, ODD)
    o6, o7 = _apply2(acc, 6, ua, ub, s[3], zz[3], o, ODD)
    o8, o9 = _apply2(acc, 8, ua, ub, s[4], zz[4], o, ODD)
    o10, o11 = _apply2(acc, 10, ua, ub, s[5], zz[5], o, ODD)
    o12, o13 = _apply2(acc, 12, ua, ub, s[6], zz[6], o, ODD)
    o14, o15 = _apply2(acc, 14, ua, ub, s[7], zz[7], o, ODD)
    return (o0, o1, o2, o3, o4, o5, o6, o7, o8, o9, o10, o11, o12, o13, o14, o15)


@triton.jit
def _apply2(acc, i: tl.constexpr, ua, ub, s, zz, o, ODD: tl.constexpr):
    """One column's rows 2t (accumulator i) and, with ODD, 2t + 1 (i + 1)."""
    even = o[i] + s * (acc[i] - zz * ua)
    if ODD:
        return even, o[i + 1] + s * (acc[i + 1] - zz * ub)
    return even, o[i + 1]


@triton.jit
def _scales(s_ptr, z_ptr, at, hoff, BIAS: tl.constexpr):
    """The group's scales and BIAS + zero points of the lane's 8 columns, indexed 2 jb + h
    (column col + hoff h + jb; at points at col)."""
    return _eight(s_ptr, at, hoff, 0.0), _eight(z_ptr, at, hoff, BIAS)


@triton.jit
def _eight(ptr, at, hoff, add: tl.constexpr):
    """ptr[at + hoff h + jb] (+ add where add is not 0) as float32, indexed 2 jb + h."""
    base = ptr + at  # the offsets below then fold into the loads' immediates
    up = base + hoff
    return (_ld(base, 0, add), _ld(up, 0, add), _ld(base, 1, add), _ld(up, 1, add),
            _ld(base, 2, add), _ld(up, 2, add), _ld(base, 3, add), _ld(up, 3, add))


@triton.jit
def _ld(base, off: tl.constexpr, add: tl.constexpr):
    v = tl.load(base + off).to(tl.float32)
    if add != 0.0:  # x + 0.0 is not folded away (it turns -0.0 into 0.0)
        v = v + add
    return v


@triton.jit(do_not_specialize=["M"])  # every batch size of a graph bucket: one variant
def int4_mma_gemv_kernel(x_ptr, y_ptr, ws_ptr, cnt_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, sxm,
                         sqk, ssg, up, GROUP: tl.constexpr, W: tl.constexpr, ODD: tl.constexpr,
                         ROWS16: tl.constexpr, AHEAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
                         PDL: tl.constexpr, COLUMN: tl.constexpr, ONES: tl.constexpr,
                         BIAS: tl.constexpr, GATED: tl.constexpr = 0,
                         FRAG: tl.constexpr = False, PAIRED: tl.constexpr = False):
    """y [M, N] (contiguous) = x [M, K] (M <= 16, bfloat16 or float16, even row stride) @ int4 qweight
    [K / 8, N] (row-major, N % 64 == 0) with float16 scales and zeros [K / GROUP, N],
    GROUP % 64 == 0. Program (n, s): columns 64n.., the s-th of the K splits (more than one:
    float32 partials in ws [splits, M, N], added by the last; SPLIT_PAD a power of two >=
    the splits). ODD: M > 1 (x's odd rows exist); ROWS16: M > 8; AHEAD (1 or 2): steps of
    64 inputs whose words are loaded ahead. COLUMN, ONES, BIAS: asm_for(ROWS16, float16).
    GATED (1: silu, 2: the tanh GELU): the weight's columns are a gated MLP's [gate; up],
    `up` of each; program n takes gate columns 32n.. as the first half of its 64 and their up
    columns, `up` further, as the second, so each lane holds a gate column and its up
    column, and y [M, up] gets act(g) * u (triton_jit._gated_store). See the module
    docstring. FRAG: qw_ptr holds the weight in fragment order (frag_pack; sqk unused).
    PAIRED: the programs take GATED's columns (32 gate columns and their up columns) but store
    both halves of y [M, N] without the activation: a [gate; up] weight packed in the gated
    launch's fragment order then also serves rows the activation does not fuse into."""
    if PDL:
        gdc_launch_dependents()
    IT: tl.constexpr = GROUP // 64  # 64-input steps per group
    e = tl.arange(0, 32 * W)
    lane = e % 32
    warp = e // 32
    g = lane // 4
    t = lane % 4
    c = tl.program_id(0) * (32 if GATED or PAIRED else 64)
    hoff = _second_half(up, GATED or PAIRED)
    pid_k = tl.program_id(1)
    cb, steps = tl.program_id(0), K // 64  # FRAG's column block and steps per column block
    splits = tl.num_programs(1)
    groups = K // GROUP
    per_split = tl.cdiv(groups, splits)
    g_lo = pid_k * per_split
    g_hi = tl.minimum(g_lo + per_split, groups)
    col = c + 4 * g  # this lane's columns: col + jb and col + hoff + jb
    xw_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    xg = xw_ptr + g * (sxm // 2) + 4 * t  # B's column g is x's row g (and g + 8)
    xg2 = xg + 8 * (sxm // 2)
    zero = tl.zeros((32 * W,), dtype=tl.float32)
    z16 = (zero, zero, zero, zero, zero, zero, zero, zero,
           zero, zero, zero, zero, zero, zero, zero, zero)
    o, o2 = z16, z16
    acc, acc2, u = z16, z16, (zero, zero, zero, zero)
    # Weights never change while serving: the first words load before the PDL wait.
    n1 = _words_at(qw_ptr, 0, g_lo, g_hi, warp, t, col, sqk, hoff, GROUP, W, FRAG, lane, cb, steps)
    if AHEAD == 2:
        n2 = _words_at(qw_ptr, 1, g_lo, g_hi, warp, t, col, sqk,
                       hoff, GROUP, W, FRAG, lane, cb, steps)
    if PDL:
        gdc_wait()
    for j in range(0, tl.cdiv(per_split, W) * IT):
        w = n1
        if AHEAD == 2:
            n1 = n2
            n2 = _words_at(qw_ptr, j + 2, g_lo, g_hi, warp, t, col, sqk,
                           hoff, GROUP, W, FRAG, lane, cb, steps)
        else:
            n1 = _words_at(qw_ptr, j + 1, g_lo, g_hi, warp, t, col, sqk,
                           hoff, GROUP, W, FRAG, lane, cb, steps)
        gi = g_lo + warp + W * (j // IT)
        gl = tl.minimum(gi, g_hi - 1)
        live = gi < g_hi
        k0 = gl * GROUP + 64 * (j % IT)
        p = _x_pairs8(xg + k0 // 2, live & (g < M))
        q = _x_pairs8(xg + k0 // 2 + 16, live & (g < M))
        if ROWS16:
            p2 = _x_pairs8(xg2 + k0 // 2, live & (g + 8 < M))
            q2 = _x_pairs8(xg2 + k0 // 2 + 16, live & (g + 8 < M))
        else:
            p2, q2 = p, q
        acc, acc2, u = _products(w, p, q, p2, q2, acc, acc2, u, ROWS16, COLUMN, ONES)
        if j % IT == IT - 1:  # the group is complete: its scales and zeros, then restart
            s, zz = _scales(s_ptr, z_ptr, gl * ssg + col, hoff, BIAS)
            o = _apply(acc, u[0], u[1], s, zz, o, ODD)
            if ROWS16:
                o2 = _apply(acc2, u[2], u[3], s, zz, o2, ODD)
            acc, acc2, u = z16, z16, (zero, zero, zero, zero)
    # Every lane of one warp, after the warps' partials are added: columns col + hoff h +
    # jb, rows 2t and 2t + 1 (and 8 more).
    lane32 = tl.arange(0, 32)
    col32 = c + 4 * (lane32 // 4)
    row32 = 2 * (lane32 % 4)
    if GATED and not SPLIT_PAD:
        _store16_gated(y_ptr, row32, col32, M, up, o, W, ODD, GATED)
        if ROWS16:
            _store16_gated(y_ptr, row32 + 8, col32, M, up, o2, W, ODD, GATED)
    else:
        if SPLIT_PAD:
            out = ws_ptr + pid_k * M * N
        else:
            out = y_ptr
        _store16(out, row32, col32, M, N, hoff, o, W, ODD)
        if ROWS16:
            _store16(out, row32 + 8, col32, M, N, hoff, o2, W, ODD)
    if SPLIT_PAD:
        # The last split of these 64 columns adds every split's M x 64 partials, in order.
        idx = tl.arange(0, ROWS * COLS)
        cc = idx % COLS
        offs = (idx // COLS) * N + c + cc % 32 + (cc // 32) * hoff
        _sum_if_last(ws_ptr, y_ptr, cnt_ptr + tl.program_id(0), offs, idx // COLS < M, M * N,
                     1, splits, SPLIT_PAD, x_ptr, y_ptr, K, 1, 0.0, c, up, M, False, False,
                     GATED, ROWS, 32)


@triton.jit
def _second_half(up, GATED: tl.constexpr):
    """How far the second half of a program's columns lies from the first: 32 (a constant,
    folded into the loads' offsets), or a gated projection's `up`."""
    if GATED:
        return up
    return 32


@triton.jit
def _store16(out_ptr, row, col, M, N, hoff, o, W: tl.constexpr, ODD: tl.constexpr):
    """o (indexed 4 jb + 2h + r: column col + hoff h + jb, row `row` + r; per lane of one
    warp after the W warps' partials are added) into out [M, N] in its dtype."""
    for jb in tl.static_range(4):
        for h in tl.static_range(2):
            _store1(out_ptr, row, col + hoff * h + jb, M, N, o[4 * jb + 2 * h], W)
            if ODD:
                _store1(out_ptr, row + 1, col + hoff * h + jb, M, N, o[4 * jb + 2 * h + 1],
                        W)


@triton.jit
def _store1(out_ptr, row, col, M, N, v, W: tl.constexpr):
    v = tl.sum(tl.reshape(v, (W, 32)), axis=0)
    tl.store(out_ptr + row * N + col, v.to(out_ptr.dtype.element_ty), mask=row < M)


@triton.jit
def _store16_gated(y_ptr, row, col, M, up, o, W: tl.constexpr, ODD: tl.constexpr,
                   GATED: tl.constexpr):
    """_store16 of a gated projection (GATED): the lane's gate column col + jb (h = 0) and
    its up column (h = 1) become act(g) * u in y [M, up] at column col + jb."""
    for jb in tl.static_range(4):
        _gate1(y_ptr, row, col + jb, M, up, o[4 * jb], o[4 * jb + 2], W, GATED)
        if ODD:
            _gate1(y_ptr, row + 1, col + jb, M, up, o[4 * jb + 1], o[4 * jb + 3], W, GATED)


@triton.jit
def _gate1(y_ptr, row, col, M, up, vg, vu, W: tl.constexpr, GATED: tl.constexpr):
    dtype = y_ptr.dtype.element_ty
    g = tl.sum(tl.reshape(vg, (W, 32)), axis=0).to(dtype).to(tl.float32)
    u = tl.sum(tl.reshape(vu, (W, 32)), axis=0).to(dtype).to(tl.float32)
    tl.store(y_ptr + row * up + col, gated(g, u, dtype, GATED == 2), mask=row < M)

"""The Triton kernels behind tpserve/kernels/quant/triton_kernel.py (import only when triton
imports). Layouts are those of base.py: int4 qweight int32 [K / 8, N] (row 8r + j in bits
4j.. of packed row r) with strides (sqk, sqn), row-major (sqn = 1) as in the checkpoint and
as the layers hold it for these kernels, or K-contiguous (sqk = 1); scales and zeros [G, N];
fp8 weight [N, K] with a scale per column n, or one per block of SN rows and SK columns
(scale [ceil(N / SN), ceil(K / SK)], row stride ssn), applied per K-block inside the loop.

int4 nibbles become floats without an int-to-float conversion (a quarter-rate instruction):
OR-ing a nibble into the mantissa of a float whose exponent makes the nibble's lowest bit
worth 1 (2^23 for bits 0-3, 2^19 for bits 4-7, ...) gives that power of two plus q exactly,
so one subtraction of (power + zero) yields q - zero, exact because zeros are small integers
(unpacked nibbles). The GEMVs read nibbles where they sit, in the word or in the word shifted
right by 16: one AND-OR, one subtraction and one multiply-add per weight, and the scale once
per packed word. On NVIDIA GPUs with bfloat16 inputs the row-major GEMV does the same with
two nibbles per instruction in packed bfloat16x2 (_dot8_bf16x2, inline PTX): the one-row
int4 GEMV is bound by its instructions, not by its bytes (docs/quantization.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpserve.kernels.triton_fused import gated
from tpserve.kernels.triton_pdl import gdc_launch_dependents, gdc_wait, pdl_enter
from tpserve.kernels.triton_rotary import _fp8_range, _round_e4m3

MAGIC: tl.constexpr = tl.constexpr(0x4B000000)  # the float 2^23: its mantissa holds an int
TWO23: tl.constexpr = tl.constexpr(8388608.0)


@triton.jit
def _nibble_float(src, J: tl.constexpr, ASM: tl.constexpr):
    """2^(23 - 4 (J % 4)) + nibble J of each packed word (src: the word, or for J >= 4 the
    word shifted right by 16), as an exact float: one AND-OR. ASM (CUDA): written as one
    PTX lop3, because ptxas otherwise splits it in two (a LOP3 holds only one immediate)."""
    mask: tl.constexpr = 15 << (4 * (J % 4))
    exp: tl.constexpr = (150 - 4 * (J % 4)) << 23
    if ASM:
        bits = tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
            [src, tl.full(src.shape, mask, tl.int32), tl.full(src.shape, exp, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (src & mask) | exp
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x_rows(x_ptr, xw_ptr, krow, J: tl.constexpr, xw, K, sxk, EVEN: tl.constexpr,
            XPAIRS: tl.constexpr):
    """Input J of each packed row (rows krow) as float32, and the int32 pair it came from.
    XPAIRS (bfloat16 x, unit stride): inputs 2i and 2i + 1 arrive as one 32-bit load and
    widen by a shift and an AND, half the loads and no conversion instruction."""
    if XPAIRS:
        if J % 2 == 0:
            if EVEN:
                xw = tl.load(xw_ptr + krow // 2 + J // 2)
            else:
                xw = tl.load(xw_ptr + krow // 2 + J // 2, mask=krow < K, other=0)
            return (xw << 16).to(tl.float32, bitcast=True), xw
        return (xw & -65536).to(tl.float32, bitcast=True), xw
    if EVEN:
        return tl.load(x_ptr + (krow + J) * sxk).to(tl.float32), xw
    return tl.load(x_ptr + (krow + J) * sxk, mask=krow < K, other=0.0).to(tl.float32), xw


@triton.jit
def _x_pairs(xw_ptr, krow, K, EVEN: tl.constexpr):
    """The 8 bfloat16 inputs of each packed row (rows krow) as 4 bfloat16x2 words, input i
    beside input i + 4 (the order of _dot8_bf16x2's nibble pairs): 4 loads and 4 PRMTs per
    row, shared by all the columns a thread holds."""
    base = xw_ptr + krow // 2
    if EVEN:
        a0 = tl.load(base)
        a1 = tl.load(base + 1)
        a2 = tl.load(base + 2)
        a3 = tl.load(base + 3)
    else:
        a0 = tl.load(base, mask=krow < K, other=0)
        a1 = tl.load(base + 1, mask=krow < K, other=0)
        a2 = tl.load(base + 2, mask=krow < K, other=0)
        a3 = tl.load(base + 3, mask=krow < K, other=0)
    return _pairs_i_i4(a0, a1, a2, a3)


@triton.jit
def _pairs_i_i4(a0, a1, a2, a3):
    """The int32 words (x0, x1), (x2, x3), (x4, x5), (x6, x7) of 8 bfloat16 inputs as the
    pairs (x_i, x_{i+4}), i = 0..3: 4 PRMTs."""
    return tl.inline_asm_elementwise(
        "prmt.b32 $0, $4, $6, 0x5410; prmt.b32 $1, $4, $6, 0x7632; "
        "prmt.b32 $2, $5, $7, 0x5410; prmt.b32 $3, $5, $7, 0x7632;",
        "=r,=r,=r,=r,r,r,r,r", [a0, a1, a2, a3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=1)


@triton.jit
def _dot8_bf16x2(word, p0, p1, p2, p3, zz):
    """sum over the 8 nibbles q_j of a packed word of x_j (q_j - z), as float32, in packed
    bfloat16x2 arithmetic (CUDA sm_90): nibbles j and j + 4 become the pair (128 + q_j,
    128 + q_{j+4}) with one lop3, zz = (128 + z, 128 + z) is subtracted exactly, and the
    pairs meet the inputs p_j = (x_j, x_{j+4}) in a chain of four bfloat16x2 multiply-adds:
    per weight about half the instructions of the float32 path. Products and the
    4-term chains round to bfloat16 (8 bits), about the rounding the reference makes when it
    dequantizes weights to bfloat16."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 q, a, t;
        .reg .b16 lo, hi;
        .reg .f32 f0, f1;
        lop3.b32 q, $1, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 q, q, $6;
        mul.rn.bf16x2 a, q, $2;
        shr.b32 t, $1, 4;
        lop3.b32 q, t, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 q, q, $6;
        fma.rn.bf16x2 a, q, $3, a;
        shr.b32 t, $1, 8;
        lop3.b32 q, t, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 q, q, $6;
        fma.rn.bf16x2 a, q, $4, a;
        shr.b32 t, $1, 12;
        lop3.b32 q, t, 0x000F000F, 0x43004300, 0xEA;
        sub.rn.bf16x2 q, q, $6;
        fma.rn.bf16x2 a, q, $5, a;
        mov.b32 {lo, hi}, a;
        cvt.f32.bf16 f0, lo;
        cvt.f32.bf16 f1, hi;
        add.f32 $0, f0, f1;
        }""",
        "=r,r,r,r,r,r,r", [word, p0, p1, p2, p3, zz], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _bf16x2_offset_zeros(z, ZF16: tl.constexpr):
    """(128 + z, 128 + z) as one bfloat16x2 word per zero point (exact: z is a small
    integer). ZF16 (z as loaded, float16; CUDA): two zero points per packed float16 add of
    1024, whose low byte is then z (its bits are 0x6400 + z), and one PRMT each that puts
    that byte beside 0x43 twice (0x4300 + z is the bfloat16 128 + z): 3 instructions per
    two columns where widening, adding, rounding and duplicating took 8."""
    if ZF16:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 h, c; mov.b32 c, 0x64006400; add.rn.f16x2 h, $2, c; "
            "prmt.b32 $0, h, 0x43434343, 0x4040; prmt.b32 $1, h, 0x43434343, 0x4242; }",
            "=r,=r,r", [z], dtype=tl.int32, is_pure=True, pack=2)
    h = (z + 128.0).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return h | (h << 16)


@triton.jit
def _int4_rows_tile(ptrs, k_lo, kk, K, K_SPAN: tl.constexpr, rr, nmask, sqk,
                    EVEN: tl.constexpr):
    """The packed tile kk inputs into the span at k_lo; zeros once kk reaches the span's end
    (or, unless EVEN, K)."""
    more = kk < K_SPAN
    if EVEN:
        return tl.load(ptrs + (kk // 8) * sqk, mask=more, other=0)
    more = ((k_lo + kk + 8 * rr) < K) & more
    return tl.load(ptrs + (kk // 8) * sqk, mask=more[:, None] & nmask[None, :], other=0)


@triton.jit
def int4_gemv_n_kernel(x_ptr, out_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, y_ptr, cnt_ptr, gam_ptr,
                       res_ptr, N, K, group_size, sxk, sos, son, sqk, ssg, up, eps,
                       HAS_GIDX: tl.constexpr,
                       ROW_SCALES: tl.constexpr, PREFETCH: tl.constexpr, K_SPAN: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                       ASM: tl.constexpr, XPAIRS: tl.constexpr, PACKED: tl.constexpr,
                       PDL: tl.constexpr, SPLIT_PAD: tl.constexpr,
                       GROUP_LOG2: tl.constexpr = -1, ZF16: tl.constexpr = False,
                       LOOP_STAGES: tl.constexpr = 1, GATED: tl.constexpr = 0,
                       RMS: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                       BLOCKED: tl.constexpr = False):
    """One activation row against a row-major qweight (N contiguous: the checkpoint's order,
    which the layers keep). Program (n, s) reduces K rows [s * K_SPAN, (s + 1) * K_SPAN) of
    BLOCK_N columns into out[s, n] (the output itself when there is one split). The packed
    tile is [BLOCK_K / 8, BLOCK_N], contiguous along N (128-bit loads); partial sums stay 2-D
    in registers and are reduced across rows once, at the end. A weight costs one AND-OR,
    one subtraction and one multiply-add (the int4 GEMV is bound by instructions as much as
    by bytes: docs/quantization.md); the scale is applied once per packed word, and with
    ROW_SCALES (every BLOCK_K rows in one group: no g_idx, group_size % BLOCK_K == 0) the
    zero-point offsets once per block and column. EVEN: K_SPAN divides K and BLOCK_N
    divides N, so the main loop has no masks. PREFETCH (0, 1 or 2): how many tiles ahead
    the loads are issued before this one is reduced, held in registers (LOOP_STAGES below is
    Triton's own pipeline instead); more tiles in flight per program hide more of the memory latency. PDL
    (kernels/pdl.py): the prefetched weight tiles are loaded before the wait for the previous
    kernel, since weights, scales and zeros never change while serving; x and the output are
    touched only after it. SPLIT_PAD (a power of two >= the number of splits; 0: none, or
    summed by sum_splits_kernel): the split that finishes last for its columns sums the
    float32 partials of out [splits, N] into y, found by a counter per column block in
    cnt_ptr (int32, zero between launches: that program resets it), so a split GEMV is one
    launch, not two. GROUP_LOG2 (>= 0: the group size is that power of two): a packed row's
    group is a shift, not an integer division by a runtime value (about 25 instructions a
    tile). ZF16 (PACKED, zeros in float16): zero points become bfloat16x2 pairs with
    integer instructions (_bf16x2_offset_zeros). LOOP_STAGES > 1 (with PREFETCH 0): Triton
    pipelines the loop's loads through shared memory (asynchronous copies issued that many
    K-blocks ahead), so more bytes are in flight than registers could hold.
    GATED (1: silu, 2: the tanh GELU; 0: off): a gated MLP's [gate; up] projection and its
    activation in one launch. The weight's columns are [gate; up], `up` of each; program n
    reads the BLOCK_N / 2 gate columns from n * BLOCK_N / 2 and the up columns `up` further
    (the bytes of a plain program, two contiguous runs) and writes act(g) * u for them into
    y [up] (_gated_store), so the [gate; up] row is never written and read back. With
    splits, out holds the partials of both halves and the last split gates their sums.
    RMS (x unit stride): x is the residual stream and the product is that of an RMSNorm's
    output, x / rms(x) * gamma (gam_ptr, in x's dtype; eps added to the mean square), so a
    decoder layer's input norm needs no launch: x * gamma is formed as x is read (packed: one
    bfloat16x2 multiply per pair, so rounded to bfloat16 where the norm rounds x / rms(x)),
    and the program that writes the output scales it by 1 / rms(x) (_finish).
    RESIDUAL: y = res + the product (rounded to y's dtype first, as a separate add would see
    it): the residual stream's add done by the layer that feeds it. BLOCKED (EVEN): qw_ptr
    holds the weight column-blocked (quant/frag.py blocked_pack: [programs][K / 8][BLOCK_N],
    a program's columns in its own order), so each program streams one contiguous region;
    sqk is then BLOCK_N."""
    tl.static_assert(not (PACKED and HAS_GIDX), "act-order takes the float32 path")
    tl.static_assert(not ZF16 or PACKED, "ZF16 is for the packed path")
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GATED:
        H: tl.constexpr = BLOCK_N // 2
        jn = tl.arange(0, BLOCK_N)
        cols = pid_n * H + jn % H  # the gate column each lane's half stands for
        offs_n = cols + (jn // H) * up
        nmask = cols < up
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
    rr = tl.arange(0, BLOCK_K // 8)
    xw_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) if XPAIRS else x_ptr
    acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    if BLOCKED:
        ptrs = (qw_ptr + pid_n * ((K // 8) * BLOCK_N) + (k_lo // 8 + rr)[:, None] * BLOCK_N
                + tl.arange(0, BLOCK_N)[None, :])
    else:
        ptrs = qw_ptr + (k_lo // 8 + rr)[:, None] * sqk + offs_n[None, :]
    if PREFETCH:
        nxt = _int4_rows_tile(ptrs, k_lo, 0, K, K_SPAN, rr, nmask, sqk, EVEN)
    if PREFETCH == 2:
        nxt2 = _int4_rows_tile(ptrs, k_lo, BLOCK_K, K, K_SPAN, rr, nmask, sqk, EVEN)
    if PDL:
        gdc_wait()
    # Spans are whole K-blocks, so only K itself cuts a tile (the last span may run past it).
    for kk in tl.range(0, K_SPAN, BLOCK_K, num_stages=LOOP_STAGES):
        k0 = k_lo + kk
        krow = k0 + 8 * rr  # first input row of each packed row
        rmask = krow < K
        mask = rmask[:, None] & nmask[None, :]
        if PREFETCH == 2:
            word = nxt
            nxt = nxt2
            nxt2 = _int4_rows_tile(ptrs, k_lo, kk + 2 * BLOCK_K, K, K_SPAN, rr, nmask, sqk,
                                   EVEN)
        elif PREFETCH:
            word = nxt
            nxt = _int4_rows_tile(ptrs, k_lo, kk + BLOCK_K, K, K_SPAN, rr, nmask, sqk, EVEN)
        else:
            word = _int4_rows_tile(ptrs, k_lo, kk, K, K_SPAN, rr, nmask, sqk, EVEN)
        if ROW_SCALES:
            at = (k0 // group_size) * ssg + offs_n
            if EVEN:
                s = tl.load(s_ptr + at).to(tl.float32)[None, :]
                z = tl.load(z_ptr + at).to(tl.float32)[None, :]
            else:
                smask = nmask & (k0 < K)
                s = tl.load(s_ptr + at, mask=smask, other=0.0).to(tl.float32)[None, :]
                z = tl.load(z_ptr + at, mask=smask, other=0.0).to(tl.float32)[None, :]
        elif not HAS_GIDX:  # a packed row's 8 inputs share a group (group sizes are 8 k)
            if GROUP_LOG2 >= 0:
                at = (krow >> GROUP_LOG2)[:, None] * ssg + offs_n[None, :]
            else:
                at = (krow // group_size)[:, None] * ssg + offs_n[None, :]
            if EVEN:  # whole tiles: no masks (they cost a predicate and a zeroing each)
                s = tl.load(s_ptr + at).to(tl.float32)
                z = tl.load(z_ptr + at)
            else:
                s = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + at, mask=mask, other=0.0)
            if not ZF16:
                z = z.to(tl.float32)
        if PACKED:
            p0, p1, p2, p3 = _x_pairs(xw_ptr, krow, K, EVEN)
            if RMS:
                gw_ptr = gam_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                g0, g1, g2, g3 = _x_pairs(gw_ptr, krow, K, EVEN)
                p0, p1, p2, p3 = _mul_bf16x2(p0, g0), _mul_bf16x2(p1, g1), \
                    _mul_bf16x2(p2, g2), _mul_bf16x2(p3, g3)
            t = _dot8_bf16x2(word, p0[:, None], p1[:, None], p2[:, None], p3[:, None],
                             _bf16x2_offset_zeros(z, ZF16 and not ROW_SCALES))
            acc += t * s
        else:
            hi = word >> 16
            t = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            xw = krow  # the int32 pair of the previous input (XPAIRS); a placeholder before
            for j in tl.static_range(8):
                xj, xw = _x_rows(x_ptr, xw_ptr, krow, j, xw, K, sxk, EVEN, XPAIRS)
                if RMS:
                    xj = xj * tl.load(gam_ptr + krow + j, mask=rmask, other=0.0).to(tl.float32)
                off = 1.0 * (1 << (23 - 4 * (j % 4)))
                q = _nibble_float(word if j < 4 else hi, j, ASM)  # off + nibble
                if HAS_GIDX:  # every input row has its own group
                    g = tl.load(g_ptr + krow + j, mask=rmask, other=0)
                    at = g[:, None] * ssg + offs_n[None, :]
                    sj = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
                    zj = tl.load(z_ptr + at, mask=mask, other=0.0).to(tl.float32)
                    t += xj[:, None] * ((q - (zj + off)) * sj)
                else:
                    t += xj[:, None] * (q - (z + off))
            if HAS_GIDX:
                acc += t
            else:
                acc += t * s
    y = tl.sum(acc, axis=0)
    plain: tl.constexpr = SPLIT_PAD > 0 or (GATED == 0 and not RMS and not RESIDUAL)
    if not plain:  # the only program of its columns: it finishes them
        _finish(y, y_ptr, offs_n, nmask, x_ptr, res_ptr, K, sxk, eps, pid_n * (BLOCK_N // 2),
                up, 1, RMS, RESIDUAL, GATED, 1, BLOCK_N // 2)
    else:
        if EVEN:
            tl.store(out_ptr + pid_k * sos + offs_n * son, y.to(out_ptr.dtype.element_ty))
        else:
            tl.store(out_ptr + pid_k * sos + offs_n * son, y.to(out_ptr.dtype.element_ty),
                     mask=nmask)
    if SPLIT_PAD:
        _sum_if_last(out_ptr, y_ptr, cnt_ptr + pid_n, offs_n, nmask, sos, son,
                     tl.num_programs(1), SPLIT_PAD, x_ptr, res_ptr, K, sxk, eps,
                     pid_n * (BLOCK_N // 2), up, 1, RMS, RESIDUAL, GATED, 1, BLOCK_N // 2)


@triton.jit
def _sum_if_last(ws_ptr, y_ptr, cnt_ptr, offs_n, nmask, sws, son, splits,
                 SPLIT_PAD: tl.constexpr, x_ptr, res_ptr, K, sxk, eps, col0, up, m,
                 RMS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                 R: tl.constexpr, H: tl.constexpr):
    """Called by every split of a column block after it stored its partial sums to ws
    [splits, N]: the split that arrives last (the counter at cnt_ptr says so) reads all of
    them, in split order, and writes their sum to y through _finish (whose arguments
    follow SPLIT_PAD; plain: RMS, RESIDUAL and GATED off). The barrier makes every thread's
    stores part of the counter's release; the partials are read through L2 (.cg), where
    the other programs' stores are."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if arrived == splits - 1:
        sp = tl.arange(0, SPLIT_PAD)
        parts = tl.load(ws_ptr + sp[:, None] * sws + offs_n[None, :] * son,
                        mask=(sp < splits)[:, None] & nmask[None, :], other=0.0,
                        cache_modifier=".cg")
        _finish(tl.sum(parts, axis=0), y_ptr, offs_n, nmask, x_ptr, res_ptr, K, sxk, eps,
                col0, up, m, RMS, RESIDUAL, GATED, R, H)
        tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch


@triton.jit
def _finish(y, y_ptr, offs_n, nmask, x_ptr, res_ptr, K, sxk, eps, col0, up, m,
            RMS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, R: tl.constexpr,
            H: tl.constexpr):
    """Store a GEMV's float32 sums y (columns offs_n) into y_ptr: scaled by 1 / rms(x) with
    RMS, added to the residual res with RESIDUAL, through _gated_store with GATED (offs_n
    then lists R rows of H gate columns and their H up columns; col0, up, m its
    arguments)."""
    if RMS:
        y = y * _inv_rms(x_ptr, K, sxk, eps)
    if GATED:
        _gated_store(y, y_ptr, col0, up, m, R, H, GATED)
    else:
        dtype = y_ptr.dtype.element_ty
        if RESIDUAL:
            r = tl.load(res_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
            y = y.to(dtype).to(tl.float32) + r
        tl.store(y_ptr + offs_n, y.to(dtype), mask=nmask)


@triton.jit
def _inv_rms(x_ptr, K, sxk, eps):
    """1 / sqrt(mean(x^2) + eps) over x's K inputs, in float32 (x is in L2: the GEMV just
    read it)."""
    BLOCK: tl.constexpr = 1024
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + kk * sxk, mask=kk < K, other=0.0).to(tl.float32)
        ss += v * v
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _mul_bf16x2(a, b):
    """Two bfloat16 products in one instruction (CUDA sm_90), rounded to bfloat16."""
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _gated_store(y, y_ptr, col0, up, m, R: tl.constexpr, H: tl.constexpr,
                 GATED: tl.constexpr):
    """y: float32 sums of R rows, each H gate columns then the H matching up columns
    (R * 2H values in that order). Stores act(g) * u into rows < m of y [m, up] at columns
    col0..col0 + H, each of g and u rounded to y's dtype first, as the projection's output
    would be before a separate activation kernel reads it (triton_fused.gated)."""
    dtype = y_ptr.dtype.element_ty
    y3 = tl.reshape(y, (R, 2, H))
    half = tl.arange(0, 2)[None, :, None]
    g = tl.sum(tl.where(half == 0, y3, 0.0), axis=1).to(dtype).to(tl.float32)
    u = tl.sum(tl.where(half == 1, y3, 0.0), axis=1).to(dtype).to(tl.float32)
    cols = col0 + tl.arange(0, H)[None, :]
    rows = tl.arange(0, R)[:, None]
    tl.store(y_ptr + rows * up + cols, gated(g, u, dtype, GATED == 2),
             mask=(cols < up) & (rows < m))


@triton.jit
def int4_gemv_k_kernel(x_ptr, out_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, N, K, KW, group_size,
                       sxk, sos, son, sqk, sqn, ssg, HAS_GIDX: tl.constexpr,
                       PREFETCH: tl.constexpr, K_SPAN: tl.constexpr, GPB: tl.constexpr,
                       WPG: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr):
    """One activation row against a K-contiguous qweight (sqk = 1: [N, K / 8] in memory).
    Program (n, s) reduces inputs [s * K_SPAN, (s + 1) * K_SPAN) of BLOCK_N output columns
    into out[s, n]. A K-block is GPB chunks of WPG packed words, each chunk inside one group,
    so the tile [BLOCK_N, GPB, WPG] is BLOCK_N runs of 32 * GPB * WPG contiguous bytes (128-bit
    loads) and the scales and zeros are one [BLOCK_N, GPB] load per block. Partial sums stay
    in registers and are reduced once, at the end. HAS_GIDX:
    act-order, each input row looks up its own group. BLOCK_K = 8 * GPB * WPG. Masks compare
    word indices with KW = K / 8 (specialized when a multiple of 16), so they are constant over
    a vector and the loads stay 128-bit. PDL: as in int4_gemv_n_kernel."""
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    n3 = offs_n[:, None, None]
    nmask3 = nmask[:, None, None]
    chunk = tl.arange(0, GPB)
    kw = chunk[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [GPB, WPG] words of a block
    k_lo = pid_k * K_SPAN
    ptrs = qw_ptr + n3 * sqn + (k_lo // 8 + kw)[None, :, :] * sqk
    acc = tl.zeros((BLOCK_N, GPB, WPG), dtype=tl.float32)
    if PREFETCH:
        nxt = tl.load(ptrs, mask=nmask3 & ((k_lo // 8 + kw) < KW)[None, :, :], other=0)
    if PDL:
        gdc_wait()
    # Spans are whole K-blocks, so only K itself cuts a tile (the last span may run past it).
    for kk in range(0, K_SPAN, BLOCK_K):
        k0 = k_lo + kk
        krow = k0 + 8 * kw  # first input row of each packed word, [GPB, WPG]
        rmask = (k0 // 8 + kw) < KW
        mask = nmask3 & rmask[None, :, :]
        if PREFETCH:
            word = nxt
            more = ((k0 + BLOCK_K) // 8 + kw < KW) & (kk + BLOCK_K < K_SPAN)
            nxt = tl.load(ptrs + ((kk + BLOCK_K) // 8) * sqk, mask=nmask3 & more[None, :, :],
                          other=0)
        else:
            word = tl.load(ptrs + (kk // 8) * sqk, mask=mask, other=0)
        hi = word >> 16
        if not HAS_GIDX:  # chunk c lies in group (k0 + 8 WPG c) // group_size
            kc = k0 + chunk * (8 * WPG)
            at = (kc // group_size)[None, :] * ssg + offs_n[:, None]
            smask = nmask[:, None] & (kc < K)[None, :]
            s = tl.load(s_ptr + at, mask=smask, other=0.0).to(tl.float32)[:, :, None]
            z = tl.load(z_ptr + at, mask=smask, other=0.0).to(tl.float32)[:, :, None]
        t = tl.zeros((BLOCK_N, GPB, WPG), dtype=tl.float32)
        for j in tl.static_range(8):
            xj = tl.load(x_ptr + (krow + j) * sxk, mask=rmask, other=0.0).to(tl.float32)
            off = 1.0 * (1 << (23 - 4 * (j % 4)))
            if HAS_GIDX:
                g = tl.load(g_ptr + krow + j, mask=rmask, other=0)
                at = g[None, :, :] * ssg + n3
                sj = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
                zj = tl.load(z_ptr + at, mask=mask, other=0.0).to(tl.float32)
                t += xj[None, :, :] * ((_nibble_float(word if j < 4 else hi, j, False) - (zj + off)) * sj)
            else:
                t += xj[None, :, :] * (_nibble_float(word if j < 4 else hi, j, False) - (z + off))
        if HAS_GIDX:
            acc += t
        else:
            acc += t * s
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + pid_k * sos + offs_n * son, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def fp8_gemv_kernel(x_ptr, out_ptr, w_ptr, scale_ptr, N, K, sxk, sos, son, swn, ssn,
                    BLOCKS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                    PREFETCH: tl.constexpr, K_SPAN: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """One activation row against fp8 weight [N, K]: tiles [BLOCK_N, BLOCK_K] contiguous
    along K. BLOCKS 0: the per-column scale is applied once to the sum; 1: block scales,
    the program's BLOCK_N columns inside one block row (SN a multiple of BLOCK_N), so each
    input is multiplied by its block's scale as it is read (one load per input, shared by
    the columns); 2: block scales, any SN, each weight multiplied by its block's scale.
    PDL: as in int4_gemv_n_kernel."""
    if PDL:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_n[:, None] * swn + offs_k[None, :]
    if PREFETCH:
        nxt = tl.load(ptrs, mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
    for kk in range(0, K_SPAN, BLOCK_K):
        kmask = offs_k + kk < K
        x = tl.load(x_ptr + (offs_k + kk) * sxk, mask=kmask, other=0.0).to(tl.float32)
        if BLOCKS == 1:
            x *= tl.load(scale_ptr + (pid_n * BLOCK_N // SN) * ssn + (offs_k + kk) // SK,
                         mask=kmask, other=0.0)
        if PREFETCH:
            w = nxt
            more = (offs_k + kk + BLOCK_K < K) & (kk + BLOCK_K < K_SPAN)
            nxt = tl.load(ptrs + kk + BLOCK_K, mask=nmask[:, None] & more[None, :], other=0.0)
        else:
            w = tl.load(ptrs + kk, mask=nmask[:, None] & kmask[None, :], other=0.0)
        w = w.to(tl.float32)
        if BLOCKS == 2:
            w *= tl.load(scale_ptr + (offs_n // SN)[:, None] * ssn + ((offs_k + kk) // SK)[None, :],
                         mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if BLOCKS == 0:
        y *= tl.load(scale_ptr + offs_n, mask=nmask, other=0.0)
    tl.store(out_ptr + pid_k * sos + offs_n * son, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _int4_dot_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, K, KW, offs_n, nmask, group_size, sqk, sqn,
                   ssg,
                   HAS_GIDX: tl.constexpr, ROW_SCALES: tl.constexpr, SCALED: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dequantized rows [k0, k0 + BLOCK_K) x offs_n as float32 [BLOCK_K, BLOCK_N]; with
    ROW_SCALES and not SCALED, q - zero only (the caller applies the block's one scale)."""
    rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    word = tl.load(qw_ptr + rows[:, None] * sqk + offs_n[None, :] * sqn,
                   mask=(rows[:, None] < KW) & nmask[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    bits = ((word[:, None, :] >> shifts[None, :, None]) & 15) | MAGIC
    q = tl.reshape(bits.to(tl.float32, bitcast=True), (BLOCK_K, BLOCK_N))  # 2^23 + q
    if ROW_SCALES:
        at = (k0 // group_size) * ssg + offs_n
        smask = nmask & (k0 < K)
        s = tl.load(s_ptr + at, mask=smask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + at, mask=smask, other=0.0).to(tl.float32)
        if SCALED:
            return (q - (z + TWO23)[None, :]) * s[None, :]
        return q - (z + TWO23)[None, :]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=kmask, other=0)
    else:
        g = offs_k // group_size
    at = g[:, None] * ssg + offs_n[None, :]
    mask = kmask[:, None] & nmask[None, :]
    s = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return (q - (z + TWO23)) * s


@triton.jit(do_not_specialize=["M", "sos"])
def gemm_kernel(x_ptr, out_ptr, w_ptr, s_ptr, z_ptr, g_ptr, M, N, K, KW, group_size,
                sxm, sxk, sos, som, son, sw0, sw1, ssg, FP8: tl.constexpr, HAS_GIDX: tl.constexpr,
                ROW_SCALES: tl.constexpr, FACTOR: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                K_SPAN: tl.constexpr, BLOCKS: tl.constexpr = 0, SN: tl.constexpr = 1,
                SK: tl.constexpr = 1):
    """Tensor-core tiles: each weight tile is dequantized once into x's dtype and fed to
    tl.dot. int4: (sw0, sw1) are qweight's strides, either order; FACTOR (with ROW_SCALES): the dot takes the
    exact integers q - zero and the block's scales multiply its [BLOCK_M, BLOCK_N] result,
    one multiply per output instead of one per weight. fp8: weight [N, K] with row stride sw0;
    BLOCKS 0: its scale, per column, multiplies the finished sum; block scales (row stride
    ssg) 1: each K-block lies in one block column (SK a multiple of BLOCK_K), its dot takes
    the exact e4m3 values and the block's scales multiply its result; 2: any SK, each weight
    multiplied by its block's scale before the dot. Neither M nor the split stride
    M * N is specialized on, so every batch size of a bucket runs one compiled variant."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    # Spans are whole K-blocks, so only K itself cuts a tile (the last span may run past it).
    for kk in range(0, K_SPAN, BLOCK_K):
        k0 = k_lo + kk
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk,
                    mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
        if FP8:
            w = tl.load(w_ptr + offs_n[None, :] * sw0 + offs_k[:, None],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
            if BLOCKS == 2:
                w = w.to(tl.float32) * tl.load(
                    s_ptr + (offs_n // SN)[None, :] * ssg + (offs_k // SK)[:, None],
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        else:
            w = _int4_dot_tile(w_ptr, s_ptr, z_ptr, g_ptr, k0, K, KW, offs_n, nmask,
                               group_size, sw0, sw1, ssg, HAS_GIDX, ROW_SCALES, not FACTOR, BLOCK_K,
                               BLOCK_N)
        if FACTOR:
            s = tl.load(s_ptr + (k0 // group_size) * ssg + offs_n, mask=nmask & (k0 < K),
                        other=0.0).to(tl.float32)
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32,
                          input_precision=PRECISION) * s[None, :]
        elif BLOCKS == 1:
            s = tl.load(s_ptr + (offs_n // SN) * ssg + k0 // SK, mask=nmask & (k0 < K),
                        other=0.0)
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32,
                          input_precision=PRECISION) * s[None, :]
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32,
                          input_precision=PRECISION)
    if FP8 and BLOCKS == 0:
        acc = acc * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)[None, :]
    out = out_ptr + pid_k * sos + offs_m[:, None] * som + offs_n[None, :] * son
    tl.store(out, acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & nmask[None, :])


@triton.jit(do_not_specialize=["numel"])
def sum_splits_kernel(ws_ptr, y_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """y = sum over the split axis of the float32 partials ws [SPLIT, numel], in y's dtype."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def int4_dequant_kernel(w_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, N, K, KW, group_size, sqk, sqn, ssg,
                        swk,
                        HAS_GIDX: tl.constexpr, ROW_SCALES: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The whole int4 weight into w [K, N] (x's dtype), for a dense matmul on large M."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    k0 = tl.program_id(0) * BLOCK_K
    w = _int4_dot_tile(qw_ptr, s_ptr, z_ptr, g_ptr, k0, K, KW, offs_n, nmask, group_size, sqk,
                       sqn, ssg, HAS_GIDX, ROW_SCALES, True, BLOCK_K, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_k[:, None] * swk + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(offs_k[:, None] < K) & nmask[None, :])


@triton.jit(do_not_specialize=["K", "sxm", "sqm"])
def fp8_quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, sxm, sqm, BLOCK: tl.constexpr):
    """Row r of x in e4m3 with its own scale (w8a8.py): s[r] = max |x[r, :]| / 448 (at least
    1e-12 / 448), q[r, :] = x[r, :] * (448 / max) rounded to e4m3. Two passes over the row, one
    program per row: the first finds the largest magnitude, the second scales and rounds."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * sxm + k0 + cols, mask=k0 + cols < K, other=0.0)
        top = tl.maximum(top, tl.abs(x.to(tl.float32)))
    amax = tl.maximum(tl.max(top, axis=0), 1e-12)
    inv = 448.0 / amax
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * sxm + k0 + cols, mask=k0 + cols < K, other=0.0)
        q = _round_e4m3(_fp8_range(x.to(tl.float32), inv))
        tl.store(q_ptr + row * sqm + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)
    tl.store(s_ptr + row, amax / 448.0)


KERNELS = (int4_gemv_n_kernel, int4_gemv_k_kernel, fp8_gemv_kernel, gemm_kernel, sum_splits_kernel,
           int4_dequant_kernel, fp8_quant_rows_kernel)

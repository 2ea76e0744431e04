"""Paged-attention kernels in Triton (CUDA, and XPU through Intel's Triton backend).

Imported only by triton_backend.py once Triton is known to be importable. Both kernels read
the cache layout [num_blocks, block_size, kv_heads, head_dim] through strides and walk the
block table key by key, so any block id order (holes, unused ids) works.

Every integer that changes from step to step (block-table width, counts) is excluded from
specialisation: otherwise Triton would compile a new variant when such a value crosses a
multiple of 16, on a live request. What remains in the compile key is fixed per model:
dtype, head_dim, GQA group, block size and the feature flags, which warmup covers.

KV_FP8: the cache holds float8 e4m3 (kernels/kv_quant.py). Keys and values are loaded as
one byte each and widened to the query's dtype in registers (exact); the per-tensor K scale
is folded into the score scale by the launcher and the V scale multiplies the output, so
the rest of the kernel is the full-precision one. KV_F16 (the launcher sets it for a
bfloat16 model): the dots run in float16 instead, q converted once per program. e4m3 widens
to float16 exactly and in one instruction per two values on CUDA, where bfloat16 takes a
detour through float32 for every value, and at large batches that conversion bounded the
fp8 decode (docs/benchmarks.md, "FP8 KV cache"). float16 keeps more of q's mantissa than
bfloat16; its range is clamped (_f16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpserve.kernels.triton_pdl import gdc_launch_dependents, gdc_wait, pdl_enter
from tpserve.kernels.triton_rotary import (
    _dims_ok,
    _fp8_range,
    _rotate_heads,
    _rotate_row,
    _round_e4m3,
)

# Step-varying scalars: never specialise on their value (see the module docstring).
_RUNTIME_INTS = ["window", "chunk", "stride_bt"]
# Small integer tables, sliced by callers at any offset: no alignment specialisation.
_TABLES = ["block_tables_ptr", "seq_lens_ptr", "alibi_ptr", "sinks_ptr"]


@triton.jit
def _tanh(x):
    # Built from exp so it compiles on every Triton backend and in the interpreter
    # (libdevice is per vendor); a short series near 0 avoids the 1 - e cancellation.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    series = ax * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    t = tl.where(ax < 0.0625, series, t)
    return tl.where(x < 0, -t, t)


@triton.jit
def _f16(q):
    """q as float16 for the dots with an fp8 cache (KV_F16), clamped to float16's range: a
    bfloat16 query beyond it would otherwise become inf."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _scores(q, k, q_pos, k_pos, visible, slopes, scale, softcap,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q [M, D] x k [N, D] -> masked fp32 scores [M, N], in the reference's order:
    scale, softcap, ALiBi, mask."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    if HAS_ALIBI:
        s += slopes[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _with_sink(m_i, l_i, acc, sinks_ptr, heads, row_ok):
    """(max, sum, acc) of an online softmax with each head's sink logit added as one more
    term of the denominator that contributes nothing to the output (gpt-oss): all three
    rescaled to max(m_i, sink), as a key with that score and a zero value would leave them."""
    sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
    m = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m)
    return m, l_i * alpha + tl.exp(sink - m), acc * alpha[:, None]


@triton.jit
def _new_key(q, k_new_ptr, v_new_ptr, cos_row, sin_row, mine, d, kvh, seq, stride_kt,
             stride_kh, stride_vt, stride_vh, k_inv_scale, v_inv_scale,
             KV_FP8: tl.constexpr, ROT: tl.constexpr, cache_dtype: tl.constexpr):
    """This step's key and value of KV head kvh (loaded only where `mine`: a scalar, or a
    mask over d for a head padded to a power of two): the key rotated by ROT dims, both as
    the cache stores them (an fp8 cache: clamped to +-448 after 1 / scale and rounded to
    e4m3 before the then exact cast, as the W8A8 rows are), and both widened again to q's
    dtype, as the attention reads a cached tile."""
    k_row = k_new_ptr + seq * stride_kt + kvh * stride_kh
    if ROT > 0:
        kf = _rotate_row(k_row, d, mine, cos_row, sin_row, ROT // 2, ROT)
    else:
        kf = tl.load(k_row + d, mask=mine, other=0.0).to(tl.float32)
    vf = tl.load(v_new_ptr + seq * stride_vt + kvh * stride_vh + d, mask=mine,
                 other=0.0).to(tl.float32)
    kf = kf.to(k_new_ptr.dtype.element_ty).to(tl.float32)  # stored as the model's dtype
    if KV_FP8:
        kf = _round_e4m3(_fp8_range(kf, k_inv_scale))
        vf = _round_e4m3(_fp8_range(vf, v_inv_scale))
    kc = kf.to(cache_dtype)
    vc = vf.to(cache_dtype)
    return kc, vc, kc.to(q.dtype), vc.to(q.dtype)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["num_splits", "stride_pt", "stride_ph",
                                               "stride_kt", "stride_kh", "stride_vt",
                                               "stride_vh", "stride_rt"],
            do_not_specialize_on_alignment=_TABLES + ["slot_ptr"])
def paged_decode_kernel(
    out_ptr, part_ptr, ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    alibi_ptr, sinks_ptr, scale, softcap, v_scale, window, chunk, stride_bt,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
    num_splits, stride_pt, stride_ph,
    k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_rt, k_inv_scale, v_inv_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    KV_F16: tl.constexpr, PDL: tl.constexpr, HEADS_FIRST: tl.constexpr = False,
    NEW_KV: tl.constexpr = False, ROT: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False,
    HAS_CHUNK: tl.constexpr = False,
):
    """One program per (sequence, KV head, split): the GROUP query heads sharing that KV head
    are the rows of one tile, so each key is read once per group (GQA / MQA).

    SPLIT (flash-decoding): the visible context is cut into num_splits runs of whole BLOCK_N
    tiles, one per program, so a small batch still fills the GPU; each program writes its
    normalised partial output [num_splits, HEAD_DIM] and (max score, sum of exponentials) per
    head to part/ml (fp32), and paged_decode_reduce_kernel combines them. A split with no
    keys (short contexts) writes max -1e30 and sum 0, which the reduction weighs by zero.

    NEW_KV (a decode step's attention, rotary and cache write in one launch): q_ptr and
    k_new/v_new_ptr are this step's raw projections. Each program rotates its query heads
    by the sequence's cos/sin row (ROT dims, 0: no rotary) and reads the cached keys before
    position ctx - 1; the program whose run of keys holds that position rotates the newest
    key, stores it and the value at the sequence's slot (a negative slot stores nothing;
    an fp8 cache quantized with 1 / scale, as the fused rotary kernel does) and starts its
    softmax from them. The separate rotary + cache-write launch is gone.

    HAS_SINKS: each query head's sink logit (sinks_ptr, float32) joins the softmax's
    denominator; a split program leaves it out, the reduction adds it once. HAS_CHUNK: the
    query sees only the keys of its chunk of `chunk` positions (and the window's, if both).
    HEAD_PAD: the power of two the tile's head dims are padded to (masked loads and stores;
    the cache rows stay HEAD_DIM wide).

    PDL: the sequence length is written before a step's first kernel, so it is read
    before the wait."""
    if PDL:
        gdc_launch_dependents()
    if HEADS_FIRST:  # grid (KV heads, sequences, splits): a sequence's heads run side by side
        kvh = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    d = tl.arange(0, HEAD_PAD)
    q_ok = _dims_ok(row_ok[:, None], d[None, :], HEAD_DIM, HEAD_PAD)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (ctx - 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    if HAS_CHUNK:
        chunk_lo = tl.maximum(ctx - 1, 0) // chunk * chunk  # the first key of q's chunk
        lo = tl.maximum(lo, chunk_lo)
    lo = lo // BLOCK_N * BLOCK_N
    hi = ctx
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(ctx - lo, BLOCK_N), num_splits) * BLOCK_N
        lo = lo + split * per_split
        hi = tl.minimum(ctx, lo + per_split)
    if PDL:
        gdc_wait()
    q_row = q_ptr + seq * stride_qt
    if NEW_KV and ROT > 0:
        cos_row = cos_ptr + seq * stride_rt
        sin_row = sin_ptr + seq * stride_rt
        q = _rotate_heads(q_row, stride_qh, heads, q_ok, d, cos_row, sin_row, ROT // 2,
                          ROT).to(q_ptr.dtype.element_ty)
    else:
        cos_row = cos_ptr
        sin_row = sin_ptr
        q = tl.load(q_row + heads[:, None] * stride_qh + d[None, :], mask=q_ok, other=0.0)
    if KV_F16:
        q = _f16(q)
    slopes = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    if NEW_KV:
        # The program whose run of keys holds position ctx - 1 stores this step's key and
        # value at the sequence's slot and starts its softmax from them (score s_new,
        # weight 1, output v_new), so the loop below is the cached-keys loop unchanged:
        # selecting the new row inside every tile cost more than the launch it saved, and
        # adding it after the loop put its loads behind the loop's (docs/benchmarks.md).
        # The newest key is always visible and its ALiBi distance is 0.
        here = (ctx - 1 >= lo) & (ctx - 1 < hi)
        mine = _dims_ok(here, d, HEAD_DIM, HEAD_PAD)
        kc, vc, k_new, v_new = _new_key(q, k_new_ptr, v_new_ptr, cos_row, sin_row, mine, d,
                                        kvh, seq, stride_kt, stride_kh, stride_vt,
                                        stride_vh, k_inv_scale, v_inv_scale, KV_FP8, ROT,
                                        k_cache_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + seq, mask=here, other=-1).to(tl.int64)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + kvh * stride_ch
        tl.store(k_cache_ptr + dst + d, kc, mask=mine & (slot >= 0))
        tl.store(v_cache_ptr + dst + d, vc, mask=mine & (slot >= 0))
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            s_new = softcap * _tanh(s_new / softcap)
        m_i = tl.where(here, s_new, m_i)
        l_i = tl.where(here, 1.0, l_i)
        acc = tl.where(here, acc + v_new.to(tl.float32)[None, :], acc)
        hi = tl.minimum(hi, ctx - 1)  # the cached keys stop before the newest
    bt_row = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_ok = _dims_ok(k_ok[:, None], d[None, :], HEAD_DIM, HEAD_PAD)
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        visible = k_ok[None, :] & (q_pos[:, None] >= 0)
        if HAS_WINDOW:
            visible &= (q_pos[:, None] - k_pos[None, :]) < window
        if HAS_CHUNK:
            visible &= (k_pos >= chunk_lo)[None, :]
        s = _scores(q, k, q_pos, k_pos, visible, slopes, scale, softcap,
                    HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if HAS_SINKS and not SPLIT:  # a split's partial sum leaves the sink to the reduction
        m_i, l_i, acc = _with_sink(m_i, l_i, acc, sinks_ptr, heads, row_ok)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * v_scale
    if SPLIT:
        part = seq.to(tl.int64) * stride_pt + heads * stride_ph + split * HEAD_DIM
        tl.store(part_ptr + part[:, None] + d[None, :], acc, mask=q_ok)
        ml = (seq.to(tl.int64) * stride_pt + heads * stride_ph) // HEAD_DIM * 2 + split * 2
        tl.store(ml_ptr + ml, m_i, mask=row_ok)
        tl.store(ml_ptr + ml + 1, l_i, mask=row_ok)
    else:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=q_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_pt", "stride_ph", "stride_ot",
                               "stride_oh"], do_not_specialize_on_alignment=["sinks_ptr"])
def paged_decode_reduce_kernel(out_ptr, part_ptr, ml_ptr, sinks_ptr, num_splits, stride_pt,
                               stride_ph, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                               HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                               PDL: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """One program per (sequence, query head): the splits' partial outputs weighed by
    exp(max_s - max) * sum_s. Every split is loaded at once as one [SPLITS_PAD, HEAD_DIM]
    tile (SPLITS_PAD: a power of two >= num_splits) rather than walked one after another:
    a serial walk keeps a single load in flight and took longer than the split decode
    itself at batch 1 (8 us against 4.5 us per layer on the H200). HAS_SINKS: the head's
    sink logit joins the combined denominator here, once (the splits leave it out)."""
    pdl_enter(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    ok = s < num_splits
    base = seq * stride_pt + head * stride_ph
    ml_base = base // HEAD_DIM * 2
    m_s = tl.load(ml_ptr + ml_base + 2 * s, mask=ok, other=-1.0e30)
    l_s = tl.load(ml_ptr + ml_base + 2 * s + 1, mask=ok, other=0.0)
    o_s = tl.load(part_ptr + base + s[:, None] * HEAD_DIM + d[None, :],
                  mask=_dims_ok(ok[:, None], d[None, :], HEAD_DIM, HEAD_PAD), other=0.0)
    m = tl.max(m_s, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m = tl.maximum(m, sink)
        w = tl.exp(m_s - m) * l_s
        total = tl.sum(w, axis=0) + tl.exp(sink - m)
    else:
        w = tl.exp(m_s - m) * l_s
        total = tl.sum(w, axis=0)
    acc = tl.sum(o_s * w[:, None], axis=0)
    acc = acc / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq * stride_ot + head * stride_oh + d
    if HEAD_PAD != HEAD_DIM:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    else:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["num_seqs"],
            do_not_specialize_on_alignment=_TABLES + ["query_start_ptr"])
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    alibi_ptr, sinks_ptr, scale, softcap, v_scale, window, chunk, stride_bt,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, num_seqs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    KV_F16: tl.constexpr, HAS_SINKS: tl.constexpr = False, HAS_CHUNK: tl.constexpr = False,
):
    """One program per (tile of TOKENS new tokens of one sequence, KV head). The BLOCK_M rows
    of a tile are TOKENS tokens x the GROUP query heads sharing the KV head (row r: token
    r // GROUP, head r % GROUP), so each key tile is read once for the whole group (GQA /
    MQA), and a short chunk or a decode row still fills the tile. The new tokens are the
    last q_len positions of a context of seq_len (chunked prefill and decode rows of a mixed
    batch alike); each attends causally to its own sequence's cache.

    The grid's first axis numbers the tiles of all num_seqs sequences back to back: sequence
    i's tiles start at query_start[i] // TOKENS + i (less that of sequence 0), a bound that
    leaves each sequence at least its ceil(q_len / TOKENS) tiles and at most one spare, found
    by binary search. A grid over (sequences x the longest query's tiles) gave every short
    query (the decode rows riding along with a prefill) as many empty programs as the
    longest had tiles. query_start may be a slice of the step's (a prefix of decode rows
    goes to the decode kernel), so its first entry need not be zero.

    HAS_SINKS, HAS_CHUNK and HEAD_PAD as in paged_decode_kernel; with chunks a tile's rows
    may fall in two chunks, so the key loop starts at the chunk of its first row and each
    row masks the keys before its own chunk."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(query_start_ptr) // TOKENS
    seq = num_seqs * 0  # the search's bounds as tensors: they are carried by the loop
    past = num_seqs + 0
    while past - seq > 1:
        mid = (seq + past) // 2
        below = tl.load(query_start_ptr + mid) // TOKENS + mid - first <= pid
        seq = tl.where(below, mid, seq)
        past = tl.where(below, past, mid)
    q_start = tl.load(query_start_ptr + seq)
    tile = pid - (q_start // TOKENS + seq - first)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    rows = tile * TOKENS + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (rows < q_len)
    q_pos = ctx - q_len + rows
    d = tl.arange(0, HEAD_PAD)
    q_ok = _dims_ok(row_ok[:, None], d[None, :], HEAD_DIM, HEAD_PAD)
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_ok, other=0.0)
    if KV_F16:
        q = _f16(q)
    slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slopes += tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    hi = tl.minimum(ctx, ctx - q_len + (tile + 1) * TOKENS)
    first_pos = ctx - q_len + tile * TOKENS  # the tile's first row
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_CHUNK:
        lo = tl.maximum(lo, first_pos // chunk * chunk)
        chunk_lo = q_pos // chunk * chunk
    lo = lo // BLOCK_N * BLOCK_N
    # A spare tile past this sequence's new tokens (the docstring's bound) does no work.
    hi = tl.where(tile * TOKENS < q_len, hi, lo)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_ok = _dims_ok(k_ok[:, None], d[None, :], HEAD_DIM, HEAD_PAD)
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible &= (q_pos[:, None] - k_pos[None, :]) < window
        if HAS_CHUNK:
            visible &= k_pos[None, :] >= chunk_lo[:, None]
        s = _scores(q, k, q_pos, k_pos, visible, slopes, scale, softcap,
                    HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if HAS_SINKS:
        m_i, l_i, acc = _with_sink(m_i, l_i, acc, sinks_ptr, head, row_ok)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * v_scale
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=q_ok)


KERNELS = (paged_decode_kernel, paged_decode_reduce_kernel, paged_prefill_kernel)

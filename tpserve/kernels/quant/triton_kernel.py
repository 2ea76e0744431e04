"""Triton weight-only GEMV/GEMM for CUDA and XPU: int4 (w4a16) and fp8 (w8a16) weights are
dequantized in registers, tile by tile, and never written back to memory, so a decode step
reads 0.5 (int4) or 1 (fp8) byte per weight instead of 2.

int4 weights are held in GPTQ's row-major order by default: on one H200 its GEMV beat the
K-contiguous one (base.py: int4_k_contiguous), which streams each output column's packed
inputs, by 16% summed over the Llama-3-8B layers at one row (2.58 against 3.08 ms,
docs/quantization.md). The kernels read either order, chosen by the weight's strides. One row (single-stream decode) takes a GEMV kernel (multiply-and-add in float32,
no tensor cores); more rows take tensor-core tiles (tl.dot on tiles dequantized into x's dtype). When
the output tiles are too few programs to fill the device, K is split across programs that
write float32 partials: in the row-major int4 GEMV the split that finishes last for its
columns sums them (a counter per column block, _split_counters), elsewhere a second small
kernel does. Tiles: triton_tiles.py; kernels: triton_jit.py.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import replace

import torch

from tpserve.kernels import pdl
from tpserve.kernels.quant.base import QuantKernel
from tpserve.kernels.quant.triton_tiles import Tile, pick_tile

log = logging.getLogger(__name__)

try:  # Triton is optional: supports() says why when it is missing.
    import triton

    from tpserve.kernels.quant import triton_jit as jit
    from tpserve.kernels.quant import triton_mma
except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
    triton = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = ""

SUM_BLOCK = 1024
# The one-row int4 GEMV on NVIDIA GPUs with bfloat16 activations computes in packed
# bfloat16x2 (triton_jit._dot8_bf16x2: about half the instructions per weight, the
# products rounded to bfloat16); TPSERVE_INT4_PACKED=0 keeps exact float32 arithmetic.
PACKED_BF16 = os.environ.get("TPSERVE_INT4_PACKED", "1") != "0"
# 1 or 2 to 16 rows of bfloat16 or float16 against int4 weights on the tensor cores
# (triton_mma.py) where the layout allows it (NVIDIA sm_80+); TPSERVE_INT4_MMA=0 keeps the
# GEMV and tiles.
INT4_MMA = os.environ.get("TPSERVE_INT4_MMA", "1") != "0"
# TPSERVE_INT4_MMA_F16=0 keeps float16 activations off it (on one H200 its float16 variant
# passed the float64 oracle and transformers, docs/quantization.md).
MMA_F16 = os.environ.get("TPSERVE_INT4_MMA_F16", "1") != "0"
# The fewest rows it takes, per activation type. One bfloat16 row keeps the packed
# bfloat16x2 GEMV: on one H200 the one-row step took 2.70 ms with this kernel on gate_up
# alone and 2.55 without it, though gate_up alone timed faster. One float16 row has only the
# float32 GEMV, which is slower: 3.12 against 2.84 ms per step on the tensor cores
# (docs/quantization.md). TPSERVE_INT4_MMA_MIN_ROWS=N sets both.
_MIN_ROWS = os.environ.get("TPSERVE_INT4_MMA_MIN_ROWS", "")
MMA_MIN_ROWS = {torch.bfloat16: int(_MIN_ROWS or 2), torch.float16: int(_MIN_ROWS or 1)}
# 17 to MMA_CHUNK_ROWS rows: the kernel once per 16 rows. On one H200 24 rows took 172.6 us
# over a decoder layer's four linears this way against 206.2 on the 17-64 tiles; 32 rows
# took as long either way (206.4 against 206.1), more took longer (docs/quantization.md).
MMA_CHUNK_ROWS = int(os.environ.get("TPSERVE_INT4_MMA_CHUNK_ROWS", "24"))
# Rows up to which it launches with programmatic dependent launch (kernels/pdl.py; at most
# pdl.MAX_ROWS): 2 rows 2.94 -> 2.79 ms per step with it, 8 rows unchanged.
MMA_PDL_ROWS = int(os.environ.get("TPSERVE_INT4_MMA_PDL_ROWS", "8"))
# Warps per 64-column program sharing its K range (up to 8 rows, more), the split-K target
# and how many steps of 64 inputs are loaded ahead: the best of the variants that
# benchmarks/int4_mma_bench.py times on one H200 (docs/quantization.md).
MMA_WARPS = (4, 2)
# One-row gated MLPs: [gate; up] projection and activation in one launch (quant_matmul's
# `gated`); TPSERVE_INT4_GATED=0 runs them as two.
INT4_GATED = os.environ.get("TPSERVE_INT4_GATED", "1") != "0"
# One-row steps of Llama-shaped int4 models: the input norm inside the QKV GEMV and the
# residual add inside down_proj's (quant_matmul's `rms` and `residual`, LlamaModel's
# fold_norms); TPSERVE_INT4_FOLD=0 keeps both as launches of their own.
INT4_FOLD = os.environ.get("TPSERVE_INT4_FOLD", "1") != "0"
# How int4 layers hold qweight on CUDA for these kernels (int4_pack): "rows", the stored
# row-major order, or "fragment", the tensor-core GEMV's fragment order (quant/frag.py), read
# by that GEMV at every row count it takes and unpacked for the dense path of large batches.
INT4_LAYOUT = os.environ.get("TPSERVE_INT4_LAYOUT", "rows")
FRAG_MAX_ROWS = 64  # above: the dense path (a fragment-order weight has no GEMM tiles)
# Experiment switch (A/B on a GPU, docs/quantization.md): the one-row GEMV reads a
# column-blocked copy of each weight (frag.blocked_pack), made on first use and kept beside
# the row-major one. Not for serving: it holds both layouts.
INT4_BLOCKED = os.environ.get("TPSERVE_INT4_BLOCKED", "0") == "1"
_BLOCKED: dict[tuple, torch.Tensor] = {}
# At most this many registers a thread for the packed one-row GEMV (bfloat16, no act-order,
# no input norm, tiles of several groups) where a thread holds at most 4 packed words a tile
# and one tile ahead (the table's tile): at 32 an SM keeps 16 programs of 4 warps (its 64
# warps), at 33-40 only 12, and Llama-3-8B's gated gate_up (1,792 programs on 132 SMs) then
# runs in two waves. On an H100 a variant of this kernel that compiled to 34 registers took
# gate_up from 28.2 to 37.8 us (docs/quantization.md). Today's build already fits in 32
# (the cap changes no instruction); the cap keeps a compiler or kernel change from falling
# off that edge unseen. At 32 the sm_90 build spills nothing
# (tests/kernels/test_triton_compiles.py checks); tiles of one group (row scales) would
# spill, so they are not capped. 0: no cap.
GEMV_MAXNREG = int(os.environ.get("TPSERVE_INT4_GEMV_MAXNREG", "32"))
MMA_PROGRAMS_PER_SM = 2  # K is split until the grid has this many programs per SM
MMA_AHEAD = 2


def _cdiv(a: int, b: int) -> int:  # triton.cdiv is a jit function: slow to call from Python
    return -(-a // b)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64  # XPU and the interpreter: a fixed guess, only steers split-K


@functools.cache
def _smem_limit(device: torch.device) -> int:
    """Shared memory one program may use (the limit Triton checks at launch)."""
    if device.type == "cuda":
        optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin",
                        0)
        if optin:
            return int(optin)
        try:  # an older torch: ask Triton's driver
            from triton.runtime import driver

            index = device.index if device.index is not None else torch.cuda.current_device()
            return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
        except Exception:  # noqa: BLE001 - unknown: keep the tiles as chosen
            return 1 << 30
    return 64 * 1024 if device.type == "xpu" else 1 << 30  # the interpreter has no limit


@functools.cache
def fit_shared_memory(tile: Tile, elem_bytes: int, limit: int) -> Tile:
    """A tensor-core tile with fewer stages, then shorter K-blocks, until its shared memory
    fits `limit`: per stage an x and a weight block, one converted weight block and the
    output tile in 16 bits (Triton's layout; this reproduces the 237,568 bytes Triton asked
    for a 64 x 64 x 128 three-stage tile with float32 activations on an H200)."""
    def need(t: Tile) -> int:
        return ((t.stages * (t.block_m + t.block_n) + t.block_n) * t.block_k * elem_bytes
                + t.block_m * t.block_n * 2)

    while need(tile) > limit and tile.stages > 1:
        tile = replace(tile, stages=tile.stages - 1)
    while need(tile) > limit and tile.block_k > 16:
        tile = replace(tile, block_k=tile.block_k // 2)
    return tile


def quant_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                 g: torch.Tensor | None, group_size: int, fp8: bool,
                 tile: Tile | None = None, gated: int = 0,
                 rms: tuple[torch.Tensor, float] | None = None,
                 residual: torch.Tensor | None = None,
                 block: tuple[int, int] | None = None,
                 blocked_w: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ the dequantized weight (layouts of base.py) -> [M, N] in x's dtype.
    blocked_w (benchmarks, tests): w column-blocked for the one-row GEMV's tile
    (frag.blocked_pack with the tile's block_n), read instead of w where that GEMV runs.
    block (fp8): s holds one scale per block of block[0] rows and block[1] columns.
    gated (int4, one row; 1: silu, 2: the tanh GELU): w's columns are a gated MLP's
    [gate; up], and the result is act(x W_gate) * (x W_up), [1, N / 2], from one launch; or
    None where no single launch does that here (the caller runs the projection, then the
    activation). rms = (gamma, eps) and residual (int4, one row; the same None where they
    cannot be done in the launch): x is the residual stream, multiplied as an RMSNorm's
    output x / rms(x) * gamma; residual + the product."""
    if not fp8 and is_fragment(w):
        return _fragment_matmul(x, w, s, z, group_size, gated, rms is not None or
                                residual is not None)
    m, k = x.shape
    n = w.shape[0] if fp8 else w.shape[1]
    s = s if s.stride(-1) == 1 else s.contiguous()
    fused = gated or rms is not None or residual is not None
    if fused and (fp8 or m != 1 or (gated and n % 2)):
        return None
    if (not fp8 and tile is None and INT4_MMA
            and MMA_MIN_ROWS.get(x.dtype, 2) <= m <= max(16, MMA_CHUNK_ROWS)):
        if rms is not None or residual is not None:
            return None  # the tensor-core GEMV has neither (its float16 x * gamma would overflow)
        y = _int4_rows_on_tensor_cores(x, w, s, z, g, group_size, gated)
        if y is not None:
            return y
    k_contig = not fp8 and _k_contiguous(w)
    if fused and (k_contig or (gated and g is not None)):
        return None
    if not k_contig and w.stride(-1) != 1:
        w = w.contiguous()
    if tile is None:
        tile = pick_tile("fp8" if fp8 else "int4", m, n, k, _num_sms(x.device))
    if tile.dense:
        return _dense(x, w, s, z, g, group_size, fp8, block)
    blocks, sn, sk = 0, 1, 1
    if block is not None:
        tile, blocks = _fit_blocks(tile, block)
        sn, sk = block
    if tile.block_m:
        tile = fit_shared_memory(tile, x.element_size(), _smem_limit(x.device))
    bk = tile.block_k
    k_span = _cdiv(_cdiv(k, tile.split), bk) * bk
    split = _cdiv(k, k_span)
    if fused and tile.block_m:
        return None
    y = torch.empty(m, n // 2 if gated else n, device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    sos = out.stride(0) if split > 1 else 0
    has_gidx = g is not None and not fp8
    if not fp8 and not has_gidx and group_size % 8:
        raise ValueError(f"int4 group size {group_size} is not a multiple of 8 (a packed word "
                         "would straddle groups); pass g_idx")
    row_scales = not fp8 and not has_gidx and group_size % bk == 0
    # Unused pointer arguments still need a tensor: pass the scales.
    z = z if z is not None else s
    g = g if g is not None else s
    # One-row GEMVs (and their split sums) chain with programmatic dependent launch
    # (kernels/pdl.py): a single-stream step is 4 of them per layer, short enough that each
    # launch gap cost a tenth of the kernel (H200: int4 2.86 -> 2.74 ms per token). The
    # tensor-core tiles of 2-16 rows keep the plain launch: with PDL the int4 step at 8 rows
    # went from 5.36 to 6.92 ms on the same GPU.
    chain = pdl.launch(x.device) if tile.block_m == 0 else {"PDL": False}
    launch = dict(num_warps=tile.warps, num_stages=tile.stages)
    if tile.block_m == 0:
        assert m == 1, "the GEMV tile takes one row"
        grid = (_cdiv(n, tile.block_n), split)
        if fp8:
            jit.fp8_gemv_kernel[grid](x, out, w, s, n, k, x.stride(1), sos, out.stride(-1),
                                      w.stride(0), s.stride(0), BLOCKS=blocks, SN=sn, SK=sk,
                                      PREFETCH=tile.prefetch, K_SPAN=k_span,
                                      BLOCK_K=bk, BLOCK_N=tile.block_n, **launch, **chain)
        elif k_contig:
            # Chunks of gcd(group, block) inputs lie in one group each (blocks start at
            # multiples of bk); act-order looks groups up per input instead.
            wpg = bk // 8 if has_gidx else math.gcd(group_size, bk) // 8
            jit.int4_gemv_k_kernel[grid](x, out, w, s, z, g, n, k, k // 8, group_size,
                                         x.stride(1), sos, out.stride(-1), w.stride(0),
                                         w.stride(1), s.stride(0), HAS_GIDX=has_gidx,
                                         PREFETCH=tile.prefetch, K_SPAN=k_span,
                                         GPB=bk // (8 * wpg), WPG=wpg, BLOCK_K=bk,
                                         BLOCK_N=tile.block_n, **launch, **chain)
        else:
            pairs = _bf16_pairs(x)
            packed = PACKED_BF16 and pairs and _ptx(x.device) and not has_gidx
            cols = grid[0]
            counters = _split_counters(x.device) if split > 1 else None
            if counters is not None and cols <= counters.numel():
                summed, split_pad = True, max(2, 1 << (split - 1).bit_length())
            else:
                summed, split_pad, counters = False, 0, s
            up = n // 2 if gated else 0
            if fused and (split > 1 and not summed or tile.block_n < 2 or x.stride(1) != 1):
                return None  # partials a second kernel would sum, plain
            if gated:
                # Each program takes block_n / 2 gate columns and as many up columns (the
                # bytes of a plain program), so the grid is the same size.
                grid = (_cdiv(up, tile.block_n // 2), split)
            gamma = rms[0] if rms is not None else s
            res = residual.reshape(-1) if residual is not None else s
            if residual is not None and res.stride(0) != 1:
                return None
            if rms is not None and (gamma.stride(-1) != 1 or packed and (
                    gamma.dtype != x.dtype or gamma.data_ptr() % 4)):
                return None
            even = k % k_span == 0 and (up % (tile.block_n // 2) == 0 if gated
                                        else n % tile.block_n == 0)
            wq, sqk, blocked = w, w.stride(0), False
            if (blocked_w is not None or INT4_BLOCKED) and even and not has_gidx:
                if blocked_w is None:
                    key = ("blocked", w.data_ptr(), gated, tile.block_n)
                    if key not in _BLOCKED:
                        from tpserve.kernels.quant.frag import blocked_pack
                        _BLOCKED[key] = blocked_pack(w, tile.block_n, up)
                    blocked_w = _BLOCKED[key]
                wq, sqk, blocked = blocked_w, tile.block_n, True
            if (GEMV_MAXNREG and packed and rms is None and not row_scales
                    and int(tile.prefetch) <= 1
                    and tile.block_n * tile.block_k <= 4 * 8 * 32 * tile.warps):
                launch["maxnreg"] = GEMV_MAXNREG
            jit.int4_gemv_n_kernel[grid](x, out, wq, s, z, g, y, counters, gamma, res, n, k,
                                         group_size, x.stride(1), sos, out.stride(-1),
                                         sqk, s.stride(0), up,
                                         rms[1] if rms is not None else 0.0,
                                         HAS_GIDX=has_gidx,
                                         ROW_SCALES=row_scales,
                                         PREFETCH=0 if tile.pipeline else int(tile.prefetch),
                                         K_SPAN=k_span, BLOCK_K=bk, BLOCK_N=tile.block_n,
                                         EVEN=even, ASM=_ptx(x.device), XPAIRS=pairs,
                                         PACKED=packed, SPLIT_PAD=split_pad,
                                         GROUP_LOG2=_log2(group_size),
                                         ZF16=packed and z.dtype == torch.float16,
                                         LOOP_STAGES=max(1, tile.pipeline), GATED=gated,
                                         RMS=rms is not None, RESIDUAL=residual is not None,
                                         BLOCKED=blocked, **launch, **chain)
            if summed or fused:
                return y
    else:
        grid = (_cdiv(m, tile.block_m), _cdiv(n, tile.block_n), split)
        # float32 activations get an exact float32 product, not TF32.
        jit.gemm_kernel[grid](x, out, w, s, z, g, m, n, k, k // 8, group_size, x.stride(0),
                              x.stride(1), sos, out.stride(-2), out.stride(-1), w.stride(0),
                              1 if fp8 else w.stride(1), s.stride(0) if s.dim() > 1 else 0,
                              FP8=fp8, HAS_GIDX=has_gidx, ROW_SCALES=row_scales,
                              FACTOR=tile.factor and row_scales,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                              BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, K_SPAN=k_span,
                              BLOCK_K=bk, BLOCKS=blocks, SN=sn, SK=sk, **launch)
    if split > 1:
        jit.sum_splits_kernel[(_cdiv(m * n, SUM_BLOCK),)](
            out, y, m * n, SPLIT=split, BLOCK=SUM_BLOCK, **chain)
    return y


def _fit_blocks(tile: Tile, block: tuple[int, int]) -> tuple[Tile, int]:
    """The tile for fp8 block scales of block = (rows, columns), and the kernels' BLOCKS
    mode. The GEMV scales each input as it reads it (1) where its columns lie in one block
    row, else each weight (2). A tensor-core tile halves its K-block (down to 16) until it
    divides the block's columns, so its dot takes the exact e4m3 values and the scales
    multiply its result (1); where none does, each weight is scaled before the dot (2)."""
    rows, cols = block
    if tile.block_m == 0:
        return tile, 1 if rows % tile.block_n == 0 else 2
    bk = tile.block_k
    while cols % bk and bk > 16:
        bk //= 2
    return (replace(tile, block_k=bk), 1) if cols % bk == 0 else (tile, 2)


def _int4_rows_on_tensor_cores(x, w, s, z, g, group_size: int,
                               gated: int = 0) -> torch.Tensor | None:
    """quant_matmul's MMA_MIN_ROWS to MMA_CHUNK_ROWS rows through the tensor-core GEMV where
    it applies, 16 rows a launch (gated: quant_matmul's, one row); the first use on a
    device, and each reason it does not apply, logged once."""
    m = x.shape[0]
    if g is not None:
        why = "act-order g_idx (each input its own group)"
    elif x.dtype == torch.float16 and not MMA_F16:
        why = "float16 activations (TPSERVE_INT4_MMA_F16=0 is set)"
    else:
        why = mma_refusal(x[:16], w, s, z, group_size)
    if why:
        _log_once(f"int4 matmuls of {_rows(x.dtype)} rows use the GEMV and tiles, not the "
                  f"tensor-core GEMV: {why}")
        return None
    _log_once(f"int4 matmuls of {_rows(x.dtype)} rows on {x.device}: tensor-core GEMV "
              "(kernels/quant/triton_mma.py)")
    if m <= 16:
        return _mma_launch(x, w, s, z, group_size, MMA_WARPS[m > 8], 0, 0, gated=gated)
    y = torch.empty(m, w.shape[1], device=x.device, dtype=x.dtype)
    for i in range(0, m, 16):
        rows = min(16, m - i)
        if _mma_launch(x[i:i + rows], w, s, z, group_size, MMA_WARPS[rows > 8], 0, 0,
                       out=y[i:i + rows]) is None:
            return None
    return y


def is_fragment(qweight: torch.Tensor) -> bool:
    """qweight is int4_pack's fragment-order form: [N / 64, K / 64, 4, 32, 4] int32."""
    return qweight.dim() == 5


def _fragment_matmul(x, f, s, z, group_size: int, gated: int,
                     fused_norm_or_add: bool) -> torch.Tensor | None:
    """quant_matmul of a fragment-order weight: the tensor-core GEMV 16 rows a launch up to
    FRAG_MAX_ROWS rows, else the weight unpacked and dequantized for the vendor matmul. None
    where the caller runs the unfused launches instead (a norm or residual add to fuse: the
    tensor-core GEMV has neither; a gated launch of more than one row)."""
    from tpserve.kernels.quant.frag import frag_unpack

    m, k = x.shape
    n = s.shape[1]
    paired = bool(getattr(f, "paired", False))
    if fused_norm_or_add or (gated and (m != 1 or not paired)):
        return None
    y = None
    if m <= 16:
        y = _mma_launch(x, f, s, z, group_size, MMA_WARPS[m > 8], 0, 0, gated=gated,
                        frag=f, paired=paired)
    elif m <= FRAG_MAX_ROWS:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        for i in range(0, m, 16):
            rows = min(16, m - i)
            if _mma_launch(x[i:i + rows], f, s, z, group_size, MMA_WARPS[rows > 8], 0, 0,
                           out=y[i:i + rows], frag=f, paired=paired) is None:
                y = None
                break
    if y is not None or gated:
        return y
    # Large batches, or no split-K counters yet (a capture that comes first): dense.
    rows = frag_unpack(f.reshape(-1), k, n, n // 2 if paired else 0)
    return x @ int4_dequantize(rows, s, z, group_size, None, x.dtype)


def _rows(dtype: torch.dtype) -> str:
    lo = MMA_MIN_ROWS.get(dtype, 2)
    return f"{lo}-{max(16, MMA_CHUNK_ROWS)}"


def int4_mma_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                    group_size: int, warps: int = 0, split: int = 0,
                    ahead: int = 0, gated: int = 0,
                    frag: torch.Tensor | None = None, paired: bool = False) -> torch.Tensor | None:
    """x [M <= 16, K] @ the int4 weight on the tensor cores (triton_mma.py), or None where
    that kernel does not apply (mma_refusal says why). warps / split / ahead: fixed choices
    (tests, benchmarks); 0 picks them (MMA_WARPS, MMA_PROGRAMS_PER_SM, MMA_AHEAD). gated:
    as quant_matmul's. frag: w in fragment order (quant/frag.py, packed gated when gated or
    paired), read instead of w. paired: the gated launch's columns without the activation
    (y [M, N])."""
    warps = warps or MMA_WARPS[x.shape[0] > 8]
    if mma_refusal(x, w, s, z, group_size, warps):
        return None
    return _mma_launch(x, w, s, z, group_size, warps, split, ahead, gated=gated, frag=frag,
                       paired=paired)


def _mma_launch(x, w, s, z, group_size: int, warps: int, split: int, ahead: int,
                out: torch.Tensor | None = None, gated: int = 0,
                frag: torch.Tensor | None = None, paired: bool = False) -> torch.Tensor | None:
    """int4_mma_matmul once mma_refusal has passed, into out (contiguous [M, N]) or a new
    tensor (None only where the split-K counters cannot be made: during a capture that comes
    first). gated: as quant_matmul's; y is then [M, N / 2] (a program takes 32 gate columns
    and their 32 up columns, so the grid is the same)."""
    m, k = x.shape
    n = s.shape[1]  # w's columns (w may be in fragment order)
    programs = n // MMA_COLS
    groups = k // group_size
    if not split:
        split = 1
        while (programs * split < MMA_PROGRAMS_PER_SM * _num_sms(x.device)
               and groups // (2 * split) >= warps and split < MAX_MMA_SPLIT):
            split *= 2
    split = min(split, groups)
    if out is None:
        out = torch.empty(m, n // 2 if gated else n, device=x.device, dtype=x.dtype)
    y = out
    counters, ws, split_pad = s, y, 0
    if split > 1:
        counters = _split_counters(x.device)
        if counters is None or programs > counters.numel():
            return None
        ws = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        split_pad = max(2, 1 << (split - 1).bit_length())
    chain = pdl.launch(x.device, m) if m <= MMA_PDL_ROWS else {"PDL": False}
    triton_mma.int4_mma_gemv_kernel[(programs, split)](
        x, y, ws, counters, w if frag is None else frag, s, z, m, n, k, x.stride(0),
        w.stride(0) if frag is None else 0, s.stride(0), n // 2, GROUP=group_size, W=warps,
        ODD=m > 1,
        ROWS16=m > 8, AHEAD=ahead or MMA_AHEAD, SPLIT_PAD=split_pad, GATED=gated,
        FRAG=frag is not None, PAIRED=paired and not gated, num_warps=warps, **chain,
        **triton_mma.asm_for(m > 8, x.dtype == torch.float16))
    return y


MAX_MMA_SPLIT = 16
MMA_COLS = 64  # output columns per program of triton_mma (its COLS; here too for hosts
# without Triton, where mma_refusal still answers)
assert triton is None or triton_mma.COLS.value == MMA_COLS


def mma_refusal(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                group_size: int, warps: int = 0) -> str:
    """Why the tensor-core int4 GEMV cannot take x @ w ("" when it can)."""
    m, k = x.shape
    n = w.shape[1]
    if m > 16:
        return f"{m} rows (it takes 16 at most)"
    if not _ptx(x.device) or not _mma_capable(x.device):
        return "it needs an NVIDIA GPU of compute capability 8.0 or later"
    if not _16bit_pairs(x) or x.stride(0) % 2:
        return f"{x.dtype} activations (it takes bfloat16 and float16, unit stride)"
    if z is None:
        return "no zero points"
    if group_size % 64 or k % group_size:
        return f"group size {group_size} (it takes multiples of 64 that divide K = {k})"
    if k // group_size < (warps or MMA_WARPS[m > 8]):
        return f"{k // group_size} group(s) per column (GPTQ group size -1)"
    if n % MMA_COLS:
        return f"{n} output columns (it takes multiples of {MMA_COLS})"
    if w.stride(1) != 1 or w.stride(0) % 4 or w.data_ptr() % 16:
        return "qweight not row-major with 16-byte aligned rows"
    if (s.dtype != torch.float16 or z.dtype != torch.float16 or z.stride(-1) != 1
            or z.stride(0) != s.stride(0)):
        return "scales and zeros not float16 [groups, N] alike"
    return ""


_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:  # once per process: every layer of every step would repeat it
        _LOGGED.add(msg)
        log.info(msg)


@functools.cache
def _mma_capable(device: torch.device) -> bool:
    """mma.sync with bfloat16 inputs: compute capability 8.0 or later."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


# Counters of the one-row int4 GEMV's in-kernel split sum (triton_jit._sum_if_last), one per
# column block, zero between launches. One set per device serves every layer: the launches
# of a step follow one another on one stream, and each leaves its counters at zero.
SPLIT_COUNTERS = 1 << 15
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor | None:
    """The device's counters, made on first use (warmup, before any graph capture), or None:
    the caller then sums with a second kernel."""
    if device.type == "xpu" or (device.type == "cuda" and not _ptx(device)):
        return None  # the release/acquire pair is only relied on where it was run (CUDA)
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a zeroing captured, not run, would leave them undefined until replay
        c = _COUNTERS[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return c


def _log2(group_size: int) -> int:
    """log2 of a power-of-two group size, else -1 (the GEMV then divides)."""
    return group_size.bit_length() - 1 if group_size > 0 and not group_size & (group_size - 1) else -1


@functools.cache
def _ptx(device: torch.device) -> bool:
    """Inline PTX is allowed: an NVIDIA GPU (not ROCm, whose torch also says "cuda")."""
    return device.type == "cuda" and torch.version.hip is None


def _16bit_pairs(x: torch.Tensor) -> bool:
    """x's bfloat16 or float16 inputs can be read two per 32-bit load."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and x.data_ptr() % 4 == 0


def _bf16_pairs(x: torch.Tensor) -> bool:
    """x's bfloat16 inputs can be read two per 32-bit load (unit stride, 4-byte aligned)."""
    return x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.data_ptr() % 4 == 0


def _k_contiguous(qweight: torch.Tensor) -> bool:
    """qweight [K / 8, N] held K-contiguous (strides (1, K / 8)), as layers hold it for us."""
    return qweight.stride(0) == 1 and qweight.shape[1] > 1 and qweight.stride(1) != 1


def _dense(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
           g: torch.Tensor | None, group_size: int, fp8: bool,
           block: tuple[int, int] | None = None) -> torch.Tensor:
    """Large batches: the weight dequantized into x's dtype (a temporary of K x N elements),
    then the vendor matmul, which beats the fused tiles once the matmul is compute-bound."""
    if block is not None:  # block scales: the reference's dequantization (float32, by blocks)
        from tpserve.kernels.quant.torch_ref import dequantize_fp8

        return x @ dequantize_fp8(w, s, block).to(x.dtype).t()
    if fp8:  # e4m3 is exact in bf16, fp16 and fp32; the per-column scale goes on the output
        y = x @ w.to(x.dtype).t()
        return y.mul_(s)
    return x @ int4_dequantize(w, s, z, group_size, g, x.dtype)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, g_idx: torch.Tensor | None, dtype: torch.dtype,
                    block_k: int = 64, block_n: int = 128) -> torch.Tensor:
    """The int4 weight as a dense [K, N] tensor of dtype (for a dense matmul at large M)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, device=qweight.device, dtype=dtype)
    has_gidx = g_idx is not None
    jit.int4_dequant_kernel[(_cdiv(k, block_k), _cdiv(n, block_n))](
        w, qweight, scales, zeros, g_idx if has_gidx else scales, n, k, k // 8, group_size,
        qweight.stride(0), qweight.stride(1), scales.stride(0), w.stride(0), HAS_GIDX=has_gidx,
        ROW_SCALES=not has_gidx and group_size % block_k == 0, BLOCK_K=block_k,
        BLOCK_N=block_n)
    return w


class TritonQuantKernel(QuantKernel):
    name = "triton"
    # Measured slower on the H200 (module docstring); kept for devices where it may win.
    int4_k_contiguous = False

    def __init__(self, tile_for: Callable[[str, int, int, int], Tile] | None = None) -> None:
        # tile_for(method, m, n, k): a fixed choice of tiles (tests and the sweep).
        self.tile_for = tile_for

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, method: str) -> str | None:
        if triton is None:
            return f"triton is not importable ({_IMPORT_ERROR})"
        if device.type not in ("cuda", "xpu"):
            return f"runs on CUDA and XPU devices, not {device.type}"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"activation dtype {dtype} is not supported"
        if method == "fp8":
            # Triton converts e4m3 in registers only from sm89 (Ada, Hopper) on; elsewhere the
            # torch reference dequantizes each layer on the fly.
            if device.type != "cuda":
                return "fp8 weights in Triton are supported on CUDA sm89+ only"
            cap = torch.cuda.get_device_capability(device)
            if cap < (8, 9):
                return f"fp8 weights need CUDA compute capability 8.9+, this GPU has {cap}"
        return None

    def _tile(self, method: str, x: torch.Tensor, n: int) -> Tile | None:
        return self.tile_for(method, x.shape[0], n, x.shape[1]) if self.tile_for else None

    def int4_pack(self, qweight, scales, zeros, group_size, g_idx, dtype, paired):
        """Fragment order (quant/frag.py) where INT4_LAYOUT asks for it and the tensor-core
        GEMV takes the layer (mma_refusal with one row of dtype), else None."""
        if INT4_LAYOUT != "fragment" or not INT4_MMA or qweight.device.type != "cuda":
            return None
        if g_idx is not None or (dtype == torch.float16 and not MMA_F16):
            return None
        kw, n = qweight.shape
        x = torch.empty(1, kw * 8, dtype=dtype, device=qweight.device)
        why = mma_refusal(x, qweight, scales, zeros, group_size)
        if why:
            _log_once(f"int4 weights stay row-major where the tensor-core GEMV cannot take "
                      f"them: {why}")
            return None
        from tpserve.kernels.quant.frag import frag_pack

        f = frag_pack(qweight, n // 2 if paired else 0)
        f = f.view(n // MMA_COLS, kw // 8, 4, 32, 4)
        f.paired = paired
        return f

    def int4_matmul(self, x, qweight, scales, zeros, group_size, g_idx=None):
        tile = self._tile("int4", x, qweight.shape[1])
        return quant_matmul(x, qweight, scales, zeros, g_idx, group_size, False, tile)

    def fp8_matmul(self, x, weight, scale, block=None):
        return quant_matmul(x, weight, scale, None, None, 1, True,
                            self._tile("fp8", x, weight.shape[0]), block=block)

    def int4_normed_matmul(self, x, qweight, scales, zeros, group_size, gamma, eps,
                           g_idx=None):
        if not INT4_FOLD:
            return None
        return quant_matmul(x, qweight, scales, zeros, g_idx, group_size, False,
                            self._tile("int4", x, qweight.shape[1]), rms=(gamma, eps))

    def int4_add_matmul(self, x, qweight, scales, zeros, group_size, residual, g_idx=None):
        if not INT4_FOLD:
            return None
        return quant_matmul(x, qweight, scales, zeros, g_idx, group_size, False,
                            self._tile("int4", x, qweight.shape[1]), residual=residual)

    def int4_gated_matmul(self, x, qweight, scales, zeros, group_size, gelu_tanh):
        if not INT4_GATED:
            return None
        return quant_matmul(x, qweight, scales, zeros, None, group_size, False,
                            self._tile("int4", x, qweight.shape[1]), gated=2 if gelu_tanh else 1)

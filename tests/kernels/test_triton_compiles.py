"""Every Triton kernel variant compiles for a real GPU target (sm_90, Hopper), on a machine
without one: Triton's compiler and ptxas run on the CPU. The interpreter (other tests) checks
the arithmetic but not what only the compiler rejects (types, layouts, constexpr misuse)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

FLOATS = {"scale", "softcap", "eps", "offset", "v_scale", "k_inv_scale", "v_inv_scale"}
FP8_CACHE = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}  # --kv-cache-dtype fp8


def _compile(fn, pointers: dict[str, str], constexprs: dict, div16: tuple = (), **options):
    """div16: integer arguments the launch would see divisible by 16 (pointers always are),
    specialised as Triton's launcher specialises them (128-bit loads depend on it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, pointers["*"])
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in constexprs and (name.endswith("_ptr") or name in div16)}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                      attrs=attrs if div16 else None),
                            target=GPUTarget("cuda", 90, 32), options=options or None)
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    return kernel


def _sass(kernel) -> str:
    """The kernel's machine code, through the nvdisasm that ships with Triton."""
    import os
    import subprocess
    import tempfile

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip("triton ships no nvdisasm here")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def _have_nvidia_backend() -> bool:
    import triton.backends

    return "nvidia" in getattr(triton.backends, "backends", {})


pytestmark = [pytest.mark.slow,  # ~1-2 s per variant on a busy CPU
              pytest.mark.skipif(not _have_nvidia_backend(), reason="no nvidia backend")]

# The flags the launchers always pass (a constexpr left out would compile as an int here).
ALL = dict(HAS_WINDOW=True, HAS_ALIBI=True, HAS_SOFTCAP=True, DOT_PRECISION="tf32",
           KV_FP8=False, KV_F16=False, HAS_SINKS=False, HAS_CHUNK=False)
NONE = dict(HAS_WINDOW=False, HAS_ALIBI=False, HAS_SOFTCAP=False, DOT_PRECISION="tf32",
            KV_FP8=False, KV_F16=False, HAS_SINKS=False, HAS_CHUNK=False)
FP8 = dict(NONE, KV_FP8=True, KV_F16=True)  # a bfloat16 model's fp8 cache: float16 dots
FLAGS = [ALL, NONE, FP8]
FLAG_IDS = ["all-features", "plain", "fp8-cache"]
PDL = [False, True]  # programmatic dependent launch (kernels/pdl.py): sm_90's griddepcontrol


DECODE_TABLES = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "alibi_ptr": "*fp32",
                 "sinks_ptr": "*fp32", "part_ptr": "*fp32", "ml_ptr": "*fp32",
                 "slot_ptr": "*i64", "*": "*bf16"}


def _compile_decode(flags: dict, head_dim: int = 128, **constexprs) -> None:
    from tpserve.kernels import triton_kernels as tk
    from tpserve.kernels.fused_ops import head_pad

    tables = dict(DECODE_TABLES, **(FP8_CACHE if flags["KV_FP8"] else {}))
    _compile(tk.paged_decode_kernel, tables,
             dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=head_dim, HEAD_PAD=head_pad(head_dim),
                  BLOCK_SIZE=16, BLOCK_N=128 if flags["KV_FP8"] else 64, **flags,
                  **constexprs))


def _compile_reduce(head_dim: int, pdl: bool, sinks: bool = False) -> None:
    from tpserve.kernels import triton_kernels as tk
    from tpserve.kernels.fused_ops import head_pad

    _compile(tk.paged_decode_reduce_kernel, {"part_ptr": "*fp32", "ml_ptr": "*fp32",
                                             "sinks_ptr": "*fp32", "*": "*bf16"},
             dict(HEAD_DIM=head_dim, HEAD_PAD=head_pad(head_dim), SPLITS_PAD=64, PDL=pdl,
                  HAS_SINKS=sinks))


def _compile_prefill(flags: dict, head_dim: int = 128, **constexprs) -> None:
    from tpserve.kernels import triton_kernels as tk
    from tpserve.kernels.fused_ops import head_pad

    tables = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
              "alibi_ptr": "*fp32", "sinks_ptr": "*fp32", "*": "*bf16"}
    if flags["KV_FP8"]:
        tables.update(FP8_CACHE)
    _compile(tk.paged_prefill_kernel, tables,
             dict(GROUP=4, HEAD_DIM=head_dim, HEAD_PAD=head_pad(head_dim), BLOCK_SIZE=16,
                  BLOCK_M=64, TOKENS=16, BLOCK_N=64, **flags, **constexprs))


@pytest.mark.parametrize("pdl", PDL, ids=["plain-launch", "pdl"])
@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("new_kv", [False, True], ids=["cached-kv", "new-kv"])
@pytest.mark.parametrize("split", [False, True])
def test_decode_kernels_compile(split, new_kv, flags, pdl):
    """new-kv: the decode that rotates, stores and attends to the step's own keys
    (decode_new), with full-width rotary."""

    _compile_decode(flags, SPLIT=split, PDL=pdl, NEW_KV=new_kv, ROT=128 if new_kv else 0)
    _compile_reduce(128, pdl)


@pytest.mark.parametrize("rot", [0, 64], ids=["no-rotary", "partial-rotary"])
def test_decode_with_new_keys_compiles_without_or_with_partial_rotary(rot):
    _compile_decode(ALL if rot == 0 else NONE, SPLIT=True, PDL=True, NEW_KV=True, ROT=rot)


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
def test_prefill_kernel_compiles(flags):
    _compile_prefill(flags)


# gpt-oss (sinks, a window, head_dim 64), Llama 4 (chunks, 128), DeepSeek-V3 (192 padded to
# 256, 64 rope dims) and Phi (80 padded to 128, all at once here): decode split and whole,
# with new keys, the reduction with sinks, and the prefill.
FEATURES = [(dict(NONE, HAS_WINDOW=True, HAS_SINKS=True), 64, 64),
            (dict(NONE, HAS_CHUNK=True), 128, 128),
            (NONE, 192, 64),
            (dict(ALL, HAS_SINKS=True, HAS_CHUNK=True), 80, 32)]


@pytest.mark.parametrize("flags,head_dim,rot", FEATURES, ids=["sinks", "chunked", "d192",
                                                               "d80-everything"])
def test_sinks_chunks_and_padded_heads_compile(flags, head_dim, rot):
    for split in (False, True):
        _compile_decode(flags, head_dim, SPLIT=split, PDL=True, NEW_KV=True, ROT=rot)
    _compile_reduce(head_dim, True, flags.get("HAS_SINKS", False))
    _compile_prefill(flags, head_dim)


@pytest.mark.parametrize("pdl", PDL, ids=["plain-launch", "pdl"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_fused_kernels_compile(dtype, pdl):
    from tpserve.kernels import triton_fused as tf

    ptr = "*" + dtype
    for has_res in (False, True):
        for cast_first in (False, True):
            _compile(tf.add_rms_norm_kernel, {"*": ptr},
                     dict(HAS_RES=has_res, CAST_FIRST=cast_first, BLOCK=4096, PDL=pdl))
    for gelu in (False, True):
        _compile(tf.gated_act_kernel, {"*": ptr}, dict(GELU_TANH=gelu, BLOCK=1024, PDL=pdl))
    for fp8 in (False, True):
        caches = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"} if fp8 else {}
        # 192: DeepSeek-V3's padded head (masked dims), 64 of them rotated
        for d, rot in ((128, 128),) + (((192, 64),) if fp8 else ()):
            _compile(tf.rotary_write_kv_kernel, {"slot_ptr": "*i64", "cos_ptr": ptr,
                                                 "sin_ptr": ptr, "*": ptr, **caches},
                     dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=d, ROT=rot,
                          HB=1 if pdl else 8, KV_FP8=fp8, PDL=pdl,
                          HEAD_PAD=1 << (d - 1).bit_length()))


@pytest.mark.parametrize("pdl", PDL, ids=["plain-launch", "pdl"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gemv_kernel_compiles(dtype, pdl):
    from tpserve.kernels import triton_gemv as tg
    from tpserve.kernels.gemv import CANDIDATES

    for tile in CANDIDATES:
        for even in (False, True):
            # Folded norms (RMS, RESIDUAL): every combination on the even tiles.
            for rms, residual in ((False, False), (True, False), (False, True))[:3 if even else 1]:
                _compile(tg.gemv_kernel, {"*": "*" + dtype},
                         dict(EVEN_N=even, EVEN_K=even, PREFETCH=tile.prefetch,
                              BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PDL=pdl, RMS=rms,
                              RESIDUAL=residual))
            _compile(tg.gemv_gated_kernel, {"*": "*" + dtype},
                     dict(EVEN_N=even, EVEN_K=even, PREFETCH=tile.prefetch,
                          BLOCK_N=tile.block_n // 2, BLOCK_K=tile.block_k, PDL=pdl,
                          GELU_TANH=even))


def test_sampling_kernel_compiles():
    from tpserve.kernels import triton_sampling as ts

    _compile(ts.gumbel_argmax_kernel, {"keys_ptr": "*i64", "out_ptr": "*i64", "*": "*fp32"},
             dict(BLOCK=1024))
    for logits in ("fp32", "bf16", "fp16"):  # the LM head's dtype, or its float32 copy
        _compile(ts.greedy_chunk_kernel,
                 {"x_ptr": "*" + logits, "i_ptr": "*i32", "*": "*fp32"},
                 dict(CHUNK=4096, BLOCK=1024))
    _compile(ts.greedy_combine_kernel, {"i_ptr": "*i32", "tok_ptr": "*i64", "*": "*fp32"},
             dict(CHUNKS=32))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_int4_gemv_compiles(dtype):
    """The row-major int4 GEMV in every variant: its inline PTX (one lop3 per weight) and
    the bfloat16 input pairs are only checked by a real compile (the interpreter runs the
    plain AND-OR and per-input loads)."""
    from tpserve.kernels.quant import triton_jit as jit

    ptrs = {"qw_ptr": "*i32", "g_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16",
            "cnt_ptr": "*i32", "out_ptr": "*fp32", "*": "*" + dtype}
    if dtype == "fp32":
        ptrs.update(s_ptr="*fp32", z_ptr="*fp32")
    # (act-order, row scales, whole tiles, prefetch, log2 of the group size, loop stages)
    for gidx, row_scales, even, prefetch, log2, stages in [
            (False, True, True, True, -1, 1), (False, True, False, True, -1, 1),
            (False, False, True, False, 7, 3), (False, False, False, True, -1, 1),
            (False, False, False, False, 5, 4), (True, False, False, True, -1, 1)]:
        packed = dtype == "bf16" and not gidx
        _compile(jit.int4_gemv_n_kernel, ptrs,
                 dict(HAS_GIDX=gidx, ROW_SCALES=row_scales, PREFETCH=prefetch, K_SPAN=1024,
                      BLOCK_K=128, BLOCK_N=64, EVEN=even, ASM=True, XPAIRS=dtype == "bf16",
                      PACKED=packed, PDL=even, SPLIT_PAD=4 if prefetch else 0,
                      GROUP_LOG2=log2, ZF16=packed and not row_scales, LOOP_STAGES=stages,
                      GATED=0, RMS=False, RESIDUAL=False, BLOCKED=even and not gidx))
        if not gidx and prefetch:  # the gated MLP's launch: silu, then the tanh GELU
            _compile(jit.int4_gemv_n_kernel, ptrs,
                     dict(HAS_GIDX=False, ROW_SCALES=row_scales, PREFETCH=prefetch,
                          K_SPAN=1024, BLOCK_K=128, BLOCK_N=16, EVEN=even, ASM=True,
                          XPAIRS=dtype == "bf16", PACKED=packed, PDL=even, SPLIT_PAD=4,
                          GROUP_LOG2=log2, ZF16=packed and not row_scales, LOOP_STAGES=stages,
                          GATED=1 + even, RMS=False, RESIDUAL=False, BLOCKED=even))
            # A decoder layer's input norm (x * gamma as read, 1 / rms(x) as stored) and
            # the residual add, whole K and split.
            for rms in (True, False):
                _compile(jit.int4_gemv_n_kernel, ptrs,
                         dict(HAS_GIDX=False, ROW_SCALES=row_scales, PREFETCH=prefetch,
                              K_SPAN=1024, BLOCK_K=128, BLOCK_N=16, EVEN=even, ASM=True,
                              XPAIRS=dtype == "bf16", PACKED=packed, PDL=even,
                              SPLIT_PAD=4 * rms, GROUP_LOG2=log2,
                              ZF16=packed and not row_scales, LOOP_STAGES=stages, GATED=0,
                              RMS=rms, RESIDUAL=not rms))


@pytest.mark.parametrize("mode", ["plain", "split", "gated", "residual"])
def test_packed_int4_gemv_fits_32_registers_without_spilling(mode):
    """quant_matmul caps the packed one-row GEMV at GEMV_MAXNREG registers (16 programs of
    4 warps per SM instead of 12) for the tiles it caps: the cap must not make the compiler
    spill to local memory, which would cost more than the occupancy gains. The table's
    tile, as the launch specialises it (strides and sizes divisible by 16)."""
    from tpserve.kernels.quant import triton_jit as jit
    from tpserve.kernels.quant.triton_kernel import GEMV_MAXNREG

    ptrs = {"qw_ptr": "*i32", "g_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16",
            "cnt_ptr": "*i32", "out_ptr": "*fp32" if mode == "split" else "*bf16",
            "*": "*bf16"}
    constexprs = dict(HAS_GIDX=False, ROW_SCALES=False, PREFETCH=True, K_SPAN=1024,
                      BLOCK_K=256, BLOCK_N=16, EVEN=True, ASM=True, XPAIRS=True, PACKED=True,
                      PDL=True, SPLIT_PAD=4 if mode == "split" else 0, GROUP_LOG2=7,
                      ZF16=True, LOOP_STAGES=1, GATED=int(mode == "gated"), RMS=False,
                      RESIDUAL=mode == "residual", BLOCKED=False, sxk=1, son=1)
    kernel = _compile(jit.int4_gemv_n_kernel, ptrs, constexprs,
                      div16=("N", "K", "group_size", "sos", "sqk", "ssg", "up"),
                      num_warps=4, maxnreg=GEMV_MAXNREG)
    code = _sass(kernel)
    spills = [line for line in code.splitlines() if "STL" in line or "LDL" in line]
    assert not spills, f"{mode}: {len(spills)} local-memory accesses at {GEMV_MAXNREG} " \
                       f"registers, e.g. {spills[0].strip()}"


@pytest.mark.parametrize("pdl", PDL, ids=["plain-launch", "pdl"])
def test_quant_kernels_compile(pdl):
    """The other quantized-matmul kernels (K-contiguous int4 GEMV, fp8 GEMV, the split-K sum
    with and without programmatic dependent launch; the tensor-core tiles; W8A8's per-row
    e4m3 rounding of activations)."""
    from tpserve.kernels.quant import triton_jit as jit

    ptrs = {"qw_ptr": "*i32", "g_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "*": "*bf16"}
    _compile(jit.int4_gemv_k_kernel, ptrs,
             dict(HAS_GIDX=False, PREFETCH=True, K_SPAN=1024, GPB=2, WPG=8, BLOCK_K=128,
                  BLOCK_N=32, PDL=pdl))
    # fp8: per-column scales (BLOCKS 0), 128 x 128 block scales (1), one scale per row and
    # 8 columns (2), as quant_matmul chooses them for the GEMV and the tensor-core tiles.
    for blocks, sn, sk in ((0, 1, 1), (1, 128, 128), (2, 1, 8)):
        _compile(jit.fp8_gemv_kernel, {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "*": "*bf16"},
                 dict(BLOCKS=blocks, SN=sn, SK=sk, PREFETCH=True, K_SPAN=1024, BLOCK_K=1024,
                      BLOCK_N=8, PDL=pdl))
        _compile(jit.gemm_kernel, {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "z_ptr": "*fp32",
                                   "g_ptr": "*fp32", "*": "*bf16"},
                 dict(FP8=True, HAS_GIDX=False, ROW_SCALES=False, FACTOR=False,
                      PRECISION="tf32", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, K_SPAN=1024,
                      BLOCKS=blocks, SN=sn, SK=sk))
    _compile(jit.gemm_kernel, {"w_ptr": "*i32", "g_ptr": "*i32", "*": "*bf16"},
             dict(FP8=False, HAS_GIDX=False, ROW_SCALES=True, FACTOR=True, PRECISION="tf32",
                  BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, K_SPAN=1024, BLOCKS=0, SN=1, SK=1))
    _compile(jit.sum_splits_kernel, {"ws_ptr": "*fp32", "*": "*bf16"},
             dict(SPLIT=4, BLOCK=1024, PDL=pdl))
    _compile(jit.fp8_quant_rows_kernel, {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "*": "*bf16"},
             dict(BLOCK=1024))


@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("split_pad", [0, 4], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("f16", [False, True], ids=["bf16", "f16"])
def test_int4_mma_gemv_compiles(rows, split_pad, f16):
    """The tensor-core int4 GEMV of 1-16 rows (triton_mma.py: mma.sync in inline PTX), one
    row under PDL, several rows and a split K summed by the last program, weights loaded
    one and two steps ahead; bfloat16 and float16 activations; bfloat16 also with the
    weight in fragment order (quant/frag.py)."""
    from tpserve.kernels.quant import triton_mma as tm

    act = "*fp16" if f16 else "*bf16"
    _compile(tm.int4_mma_gemv_kernel, {"ws_ptr": "*fp32", "cnt_ptr": "*i32", "qw_ptr": "*i32",
                                       "s_ptr": "*fp16", "z_ptr": "*fp16", "*": act},
             dict(GROUP=128, W=4, ODD=rows > 1, ROWS16=rows > 8, AHEAD=1 + (rows == 8),
                  SPLIT_PAD=split_pad, PDL=rows == 1, GATED=0, FRAG=not f16,
                  PAIRED=rows > 1, **tm.asm_for(rows > 8, f16)))
    if rows == 1:  # a gated MLP's projection and activation in one launch (one row)
        _compile(tm.int4_mma_gemv_kernel, {"ws_ptr": "*fp32", "cnt_ptr": "*i32",
                                           "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16",
                                           "*": act},
                 dict(GROUP=128, W=4, ODD=False, ROWS16=False, AHEAD=1, SPLIT_PAD=split_pad,
                      PDL=True, GATED=1 + f16, FRAG=not f16, **tm.asm_for(False, f16)))

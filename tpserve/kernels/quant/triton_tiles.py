"""Which tile the Triton quantized matmul runs for a batch size and layer shape.

A batch of M rows falls in one of four buckets (1, 2-16, 17-64, more); within a bucket the
tile and the split of K depend only on the layer shape, and the kernels do not specialize on
M, so each layer shape compiles one variant per bucket: warmup's decode batch sizes (powers
of two) and its prefill step reach them all. The constants come from benchmarks/quant_sweep.py
on one H200 (docs/quantization.md has the tables).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    block_m: int  # 0: the GEMV kernel (one activation row)
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split: int = 1  # K cut into this many spans; a second kernel sums their float32 partials


# (bucket's largest M, tile) for the tensor-core path, int4 and fp8 alike.
GEMM_TILES = (
    (16, Tile(16, 64, 128, 4, 3)),
    (64, Tile(64, 64, 128, 4, 3)),
    (1 << 62, Tile(128, 128, 64, 8, 3)),
)
GEMV_TILES = {"int4": Tile(0, 64, 256, 4, 1), "fp8": Tile(0, 32, 256, 4, 1)}
# Split K until the grid has this many programs per SM (while each keeps MIN_SPAN_BLOCKS
# K-blocks): a GEMV over few output columns (o_proj, down_proj) would leave SMs idle.
PROGRAMS_PER_SM = {"gemv": 2, "gemm": 1}
MIN_SPAN_BLOCKS = 4
MAX_SPLIT = 16


def bucket(m: int) -> int:
    """0 for one row (the GEMV), else the index of the GEMM bucket + 1."""
    if m == 1:
        return 0
    return 1 + next(i for i, (hi, _) in enumerate(GEMM_TILES) if m <= hi)


def split_for(programs: int, k: int, block_k: int, sms: int, per_sm: int) -> int:
    split = 1
    while (programs * split < per_sm * sms and split < MAX_SPLIT
           and k // (2 * split) >= MIN_SPAN_BLOCKS * block_k):
        split *= 2
    return split


def pick_tile(method: str, m: int, n: int, k: int, sms: int) -> Tile:
    """The tile for x [m, k] against a weight with n output columns on a device of `sms`
    multiprocessors; independent of m within its bucket (see the module docstring)."""
    b = bucket(m)
    if b == 0:
        t = GEMV_TILES[method]
        programs, per_sm = -(-n // t.block_n), PROGRAMS_PER_SM["gemv"]
    else:
        hi, t = GEMM_TILES[b - 1]
        # The bucket's largest M (capped) stands for every M in it.
        rows = min(hi, 256)
        programs = -(-rows // t.block_m) * -(-n // t.block_n)
        per_sm = PROGRAMS_PER_SM["gemm"]
    split = split_for(programs, k, t.block_k, sms, per_sm)
    return Tile(t.block_m, t.block_n, t.block_k, t.warps, t.stages, split)

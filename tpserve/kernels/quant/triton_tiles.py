"""Which tile the Triton quantized matmul runs for a batch size and layer shape.

A batch of M rows falls in one of four buckets (1, 2-16, 17-64, more); within a bucket the
tile and the split of K depend only on the layer shape, and the kernels do not specialize on
M, so each layer shape compiles one variant per bucket: warmup's decode batch sizes (powers
of two) and its prefill step reach them all. The table comes from benchmarks/quant_sweep.py
on one H200 (docs/quantization.md has the measurements); `set_tiles` swaps in another.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

BUCKET_MAX = (1, 16, 64, 1 << 62)  # largest M of each bucket


@dataclass(frozen=True)
class Tile:
    block_m: int  # 0: the GEMV kernel (one activation row)
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split: int = 1  # K cut into this many spans, whose float32 partials are summed (triton_kernel)
    # GEMV: load the next K-block before reducing this one (row-major int4: 2 = two ahead)
    prefetch: bool | int = False
    # Row-major int4 GEMV: Triton's software pipeline over this many K-blocks (copies into
    # shared memory issued ahead, no registers held) instead of `prefetch`; 0: off
    pipeline: int = 0
    factor: bool = False  # int4 GEMM: scale each K-block's dot, not each weight
    dense: bool = False  # dequantize the whole weight, then torch.matmul (large M)


# method -> bucket -> (tile, programs per SM that split-K aims for): the choice of
# benchmarks/quant_sweep.py on one H200 (2026-12-01; its OUT/quant_tiles.json), the least
# time summed over the Llama-3-8B layers among 1,328 timed variants. int4's one-row tile is
# for the row-major order the layers hold, re-chosen for the packed bfloat16x2 GEMV by
# the GEMV mode of benchmarks/quant_sweep.py (2026-12-02: n16 k512 with a split aiming at 4
# programs per SM, 61.9 us over the four decoder layers against 64.2 at 2 per SM). Re-chosen
# the same night after the GEMV lost its per-tile division and zero-point conversions
# (fewer registers, more programs per SM): n16 k256 aiming at 16 programs per SM, 59.2 us
# against 62.8 for the previous tile with the new kernel (the old kernel's best: 59.8).
# Re-timed on 2026-12-03 with the pipelined candidates (Tile.pipeline) in the sweep: none
# won; the same tile aiming at 8 programs per SM (less split-K) did, 58.7 us, and took the
# engine's one-row step from 2.65 to 2.56 ms (engine_step.py, both in one call).
TILES: dict[str, list[tuple[Tile, int]]] = {
    "int4": [(Tile(0, 16, 256, 4, 3, prefetch=True), 8),
             (Tile(16, 128, 128, 4, 3, factor=True), 1),
             (Tile(64, 64, 128, 4, 3, factor=True), 1),
             (Tile(0, 0, 64, dense=True), 1)],
    "fp8": [(Tile(0, 8, 1024, 4, 3), 1),
            (Tile(16, 32, 256, 4, 3), 2),
            (Tile(64, 64, 64, 4, 4), 1),
            (Tile(128, 128, 64, 8, 3), 1)],
}
MAX_SPLIT = 16


def bucket(m: int) -> int:
    return next(i for i, hi in enumerate(BUCKET_MAX) if m <= hi)


def split_for(programs: int, k: int, block_k: int, sms: int, per_sm: int) -> int:
    """Double the split while the grid has fewer than per_sm programs per SM and each span
    keeps at least one K-block."""
    split = 1
    while programs * split < per_sm * sms and split < MAX_SPLIT and k // (2 * split) >= block_k:
        split *= 2
    return split


def pick_tile(method: str, m: int, n: int, k: int, sms: int) -> Tile:
    """The tile for x [m, k] against a weight with n output columns on a device of `sms`
    multiprocessors; independent of m within its bucket (see the module docstring)."""
    b = bucket(m)
    key = (method, b, n, k, sms)
    tile = _PICKED.get(key)
    if tile is None:  # a few per layer shape: keep them, the lookup runs on every call
        tile = _PICKED[key] = with_split(*TILES[method][b], b, n, k, sms)
    return tile


_PICKED: dict[tuple, Tile] = {}


def with_split(tile: Tile, per_sm: int, b: int, n: int, k: int, sms: int) -> Tile:
    """`tile` with the split-K its rule gives in bucket b (the bucket's largest M, capped,
    stands for every M in it)."""
    if tile.dense:
        return tile
    rows = min(BUCKET_MAX[b], 256)
    programs = -(-rows // max(tile.block_m, 1)) * -(-n // tile.block_n)
    return replace(tile, split=split_for(programs, k, tile.block_k, sms, per_sm))


def set_tiles(table: dict[str, list[tuple[Tile, int]]]) -> None:
    """Replace the table (all methods and buckets given), e.g. with a sweep's choice."""
    for method, rules in table.items():
        if len(rules) != len(BUCKET_MAX):
            raise ValueError(f"{method}: one (tile, programs per SM) per bucket "
                             f"({len(BUCKET_MAX)}), got {len(rules)}")
        TILES[method] = list(rules)
    _PICKED.clear()


def tiles_to_json(table: dict[str, list[tuple[Tile, int]]]) -> str:
    return json.dumps({m: [[asdict(t), p] for t, p in rules] for m, rules in table.items()})


def tiles_from_json(text: str) -> dict[str, list[tuple[Tile, int]]]:
    return {m: [(Tile(**t), p) for t, p in rules] for m, rules in json.loads(text).items()}

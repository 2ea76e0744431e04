"""int4 weights in the tensor-core GEMV's fragment order (triton_mma.py, FRAG).

Why: the checkpoint's row-major qweight [K / 8, N] gives each warp of the tensor-core GEMV
128-byte runs, one per packed row, 4 * N bytes apart, so a program's words are scattered
over as many DRAM pages as it has packed rows; the GEMV then reads ~2.5 TB/s of an H200's
4.8 (docs/quantization.md). In fragment order the 16 words a lane loads for one step of 64
inputs are four 16-byte pieces of four 512-byte blocks, each block one load of the whole
warp in lane order, and a program's steps follow each other: every load is 512
contiguous bytes and a program streams one contiguous region.

Layout: [N / 64 column blocks][K / 64 steps][4 loads][32 lanes][4 words] of int32, where
lane (g, t) = (lane // 4, lane % 4) and load i holds packed row t + 4 (i % 2) of the block's
columns 32 (i // 2) + 4 g .. + 3 (the words triton_mma._words_at reads from the row-major
weight). A block's 64 columns are 64 consecutive ones, or for a gated [gate; up]
projection 32 gate columns and their 32 up columns (the program's columns when GATED).
"""

from __future__ import annotations

import torch

COLS = 64  # columns per block (triton_mma.COLS)
STEP = 64  # inputs per step (8 packed rows)


def block_columns(n: int, gated_up: int = 0, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """The original column of each fragment-order column, [N]: block b's 64 columns. Built
    on `device` itself: a host-to-device copy is not allowed inside a CUDA graph capture,
    where frag_unpack may run."""
    blocks = n // COLS
    x = torch.arange(32, device=device)
    if gated_up:
        b = torch.arange(blocks, device=device)[:, None, None]
        h = torch.arange(2, device=device)[None, :, None]
        cols = h * gated_up + b * 32 + x[None, None, :]
    else:
        cols = torch.arange(n, device=device).view(blocks, 2, 32)
    return cols.reshape(-1)


def frag_pack(qweight: torch.Tensor, gated_up: int = 0) -> torch.Tensor:
    """qweight [K / 8, N] (int32, row-major) in fragment order, flat int32 on its device.
    gated_up: N / 2 for a [gate; up] weight served by the gated launch, else 0."""
    kw, n = qweight.shape
    if n % COLS or kw % (STEP // 8):
        raise ValueError(f"fragment order needs N % {COLS} == 0 and K % {STEP} == 0 "
                         f"(qweight {tuple(qweight.shape)})")
    steps, blocks = kw // 8, n // COLS
    q = qweight[:, block_columns(n, gated_up, qweight.device)]
    # [steps, row-half ri, t, block, h, g, w] -> [block, steps, h, ri, g, t, w]
    q = q.reshape(steps, 2, 4, blocks, 2, 8, 4).permute(3, 0, 4, 1, 5, 2, 6)
    return q.contiguous().reshape(-1)


def lane_words(qweight: torch.Tensor, block: int, step: int, lane: int,
               gated_up: int = 0) -> list[int]:
    """The 16 words lane `lane` of a program of column block `block` loads for one step,
    read from the row-major weight as triton_mma._words_at does (tests check frag_pack
    against it)."""
    g, t = lane // 4, lane % 4
    if gated_up:
        col, hoff = block * 32 + 4 * g, gated_up
    else:
        col, hoff = block * COLS + 4 * g, 32
    r = step * 8 + t
    out = []
    for row, off in ((r, 0), (r + 4, 0), (r, hoff), (r + 4, hoff)):
        out += [int(v) for v in qweight[row, col + off:col + off + 4]]
    return out


def blocked_pack(qweight: torch.Tensor, block_n: int, gated_up: int = 0) -> torch.Tensor:
    """qweight [K / 8, N] column-blocked for the one-row GEMV (triton_jit.int4_gemv_n_kernel,
    BLOCKED): [N / block_n][K / 8][block_n], block b's columns those of its program: b *
    block_n.., or for a gated projection block_n / 2 gate columns b * block_n / 2.. then
    their up columns."""
    kw, n = qweight.shape
    if n % block_n:
        raise ValueError(f"column blocks need N % {block_n} == 0 "
                         f"(qweight {tuple(qweight.shape)})")
    blocks, dev = n // block_n, qweight.device  # built on the device, as block_columns
    if gated_up:
        h = block_n // 2
        cols = (torch.arange(2, device=dev)[None, :, None] * gated_up
                + torch.arange(blocks, device=dev)[:, None, None] * h
                + torch.arange(h, device=dev)[None, None, :])
        cols = cols.reshape(-1)
    else:
        cols = torch.arange(n, device=dev)
    q = qweight[:, cols].reshape(kw, blocks, block_n).permute(1, 0, 2)
    return q.contiguous()


def frag_unpack(frag: torch.Tensor, k: int, n: int, gated_up: int = 0) -> torch.Tensor:
    """frag_pack's inverse: the row-major qweight [K / 8, N] (a temporary, for the paths
    that read row-major words, such as the dense dequantization of large batches)."""
    steps, blocks = k // STEP, n // COLS
    q = frag.reshape(blocks, steps, 2, 2, 8, 4, 4).permute(1, 3, 5, 0, 2, 4, 6)
    q = q.reshape(k // 8, n)  # columns in block order
    if gated_up:
        inverse = torch.empty(n, dtype=torch.long, device=q.device)
        inverse[block_columns(n, gated_up, q.device)] = torch.arange(n, device=q.device)
        return q[:, inverse]
    return q.contiguous()

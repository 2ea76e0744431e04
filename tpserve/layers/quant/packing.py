"""int4 nibble packing of GPTQ and AWQ checkpoints, converted at load to the one stored layout
the kernels read (tpserve/kernels/quant/base.py): qweight packed along input rows in GPTQ's
order, zeros unpacked to the activation dtype."""

from __future__ import annotations

import torch

# AWQ's GEMM layout puts output column 8c + AWQ_ORDER[i] in bits 4i.. of packed column c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(AWQ_ORDER.index(j) for j in range(8))  # nibble that holds column 8c + j


def unpack_cols(packed: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8 C]: the nibbles of each column, in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8], nibble i at [..., i]
    if awq:
        q = q[..., list(_AWQ_UNDO)]
    return q.reshape(packed.shape[0], -1)


def pack_cols(q: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """int [R, 8 C] values 0..15 -> int32 [R, C], unpack_cols' inverse: column 8c + i in
    bits 4i.. of column c (GPTQ's qzeros), or AWQ's nibble order (awq)."""
    r, n = q.shape
    q = q.to(torch.int32).reshape(r, n // 8, 8)
    if awq:
        q = q[..., list(AWQ_ORDER)]  # nibble i holds column 8c + AWQ_ORDER[i]
    out = torch.zeros(r, n // 8, dtype=torch.int32, device=q.device)
    for i in range(8):
        out |= q[..., i] << (4 * i)
    return out


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] values 0..15 -> int32 [K // 8, N], row 8r + i in bits 4i.. of row r."""
    return pack_cols(q.t()).t().contiguous()


def awq_qweight_to_rows(packed: torch.Tensor) -> torch.Tensor:
    """AWQ qweight slice int32 [K, N / 8] -> stored int32 [K / 8, N]."""
    return pack_rows(unpack_cols(packed, awq=True))


def zeros_from_packed(packed: torch.Tensor, offset: int, dtype: torch.dtype,
                      awq: bool = False) -> torch.Tensor:
    """qzeros slice int32 [G, N / 8] -> zeros [G, N] in dtype (GPTQ v1 stores zero - 1)."""
    return (unpack_cols(packed, awq) + offset).to(dtype)

"""MXFP4 (the OCP microscaling format gpt-oss's released checkpoints store their experts in),
read back to floats at load: tpserve runs the experts in the model dtype.

A tensor of `rows` output features by `cols` input features is stored as
- `*_blocks` uint8 [..., rows, cols / 32, 16]: 32 FP4 (E2M1) values per group, two per byte,
  the low nibble first;
- `*_scales` uint8 [..., rows, cols / 32]: one E8M0 exponent per group, 2 ** (scale - 127).
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale

# E2M1 by its 4-bit code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in dtype. Computed
    in float32, where every FP4 value times its power of two is exact, then rounded once."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and "
                         f"{scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    values = lut[codes.long()]
    exps = scales.to(torch.int32) - 127
    return torch.ldexp(values, exps.unsqueeze(-1).float()).flatten(-2).to(dtype)


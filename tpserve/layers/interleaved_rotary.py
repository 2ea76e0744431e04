"""Rotary over interleaved pairs (Cohere's: dimensions (2i, 2i + 1) rotate by frequency i)
served by the rotate-half rotary every attention backend applies (pairs (i, i + d / 2)).

Attention reads queries and keys only through q . k, which a permutation of head_dim applied
to both leaves unchanged. So the rows of q_proj and k_proj (and their biases, per-head
norm weights, fp8 per-channel scales and int4 checkpoints' output columns, packed or not:
half_order_rows) are reordered within each head at load, evens first then odds: pair (2i, 2i + 1) lands on (i, i + d / 2) and the backend's rotate-half
rotary, with the same frequencies, rotates it as the interleaved one would. Values and
o_proj are untouched, so the attention output is the checkpoint's. The KV cache holds keys
in the reordered layout, which nothing but this model's queries reads."""

from __future__ import annotations

import torch

from tpserve.errors import CheckpointError
from tpserve.layers.quant.packing import pack_cols, unpack_cols
from tpserve.weights import TensorSlice


def half_order(head_dim: int) -> torch.Tensor:
    """The reordering of one head's dimensions: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


class HalfOrderRows:
    """A checkpoint tensor (TensorSlice) read with each head's dimensions in half_order:
    along dim 0 for a projection's weight [heads * head_dim, in] or bias, along the last dim
    for a per-head norm weight [heads, head_dim]. Every read of dim 0 must cover whole heads
    (tp slices do: heads are never split across ranks).

    Quantized tensors keep their output features along `dim` (GPTQ's and AWQ's qweight,
    scales and qzeros along dim 1, compressed-tensors' along dim 0), packed 8 a word where
    `packed` names the nibble order ("gptq": feature 8c + i in bits 4i.. of word c, as
    compressed-tensors' weight_zero_point too; "awq": AWQ's order): such a read is unpacked
    (layers/quant/packing.py), reordered per head and packed again, so a rank still reads
    only its words."""

    def __init__(self, w: TensorSlice, head_dim: int, per_head_last: bool = False,
                 dim: int = 0, packed: str | None = None) -> None:
        self._w, self.name, self.shape = w, w.name, w.shape
        self._d, self._last, self._dim, self._packed = head_dim, per_head_last, dim, packed
        self._per = 8 if packed else 1  # output features per entry along dim
        if head_dim % self._per:
            raise CheckpointError(
                f"checkpoint tensor {w.name!r} packs 8 output features a word, and its rows "
                f"are reordered within each head at load (interleaved rotary): head_dim "
                f"{head_dim} must be a multiple of 8")
        self._order = half_order(head_dim)

    def __getitem__(self, index) -> torch.Tensor:
        t = self._w[index]
        if self._last:
            return t[..., self._order]
        index = index if isinstance(index, tuple) else (index,)
        sel = index[self._dim] if len(index) > self._dim else slice(None)
        start = sel.start if isinstance(sel, slice) else None
        per_head = self._d // self._per  # entries of one head along dim
        if t.shape[self._dim] % per_head or (start or 0) % per_head:
            raise ValueError(f"{self.name}: a read of rows that splits a head (a tpserve bug)")
        n = t.shape[self._dim] * self._per  # output features read
        idx = (torch.arange(0, n, self._d)[:, None] + self._order).flatten()
        if not self._packed:
            return t[(slice(None),) * self._dim + (idx,)]
        awq = self._packed == "awq"
        x = unpack_cols(t.movedim(self._dim, -1), awq)[:, idx]
        return pack_cols(x, awq).movedim(-1, self._dim).contiguous()

    def all(self) -> torch.Tensor:
        return self[:]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self[tuple(index)]


# How each tensor of a quantized q_proj / k_proj keeps its output features, by quantization
# method and tensor name: (dim, packed) for HalfOrderRows, or None where the tensor has no
# output features (g_idx indexes input rows; weight_shape is (N, K)).
_QUANT_ROWS = {
    "gptq": {"qweight": (1, None), "scales": (1, None), "qzeros": (1, "gptq"), "g_idx": None},
    "awq": {"qweight": (1, "awq"), "scales": (1, None), "qzeros": (1, "awq")},
    "compressed-tensors": {"weight_packed": (0, None), "weight_scale": (0, None),
                           "weight_zero_point": (0, "gptq"), "weight_shape": None},
}
_FLOAT_ROWS = {"weight": (0, None), "bias": (0, None)}


def half_order_rows(w: TensorSlice, head_dim: int, method: str | None):
    """A q_proj / k_proj checkpoint tensor read in each head's rotate-half order, for a
    checkpoint quantized with method (None: float; a float layer of a quantized checkpoint,
    and the bias, read as float). Refuses a tensor whose layout is not known here."""
    tensor = w.name.rpartition(".")[2]
    rows = {**_FLOAT_ROWS, **_QUANT_ROWS.get(method or "", {})}
    if tensor not in rows:
        raise CheckpointError(
            f"checkpoint tensor {w.name!r}: q_proj / k_proj rows are reordered within each "
            f"head at load (interleaved rotary), which tpserve does for "
            f"{', '.join(sorted(rows))} of a {method or 'float'} checkpoint, not {tensor!r}")
    if rows[tensor] is None:
        return w
    dim, packed = rows[tensor]
    return HalfOrderRows(w, head_dim, dim=dim, packed=packed)

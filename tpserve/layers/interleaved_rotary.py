"""Rotary over interleaved pairs (Cohere's: dimensions (2i, 2i + 1) rotate by frequency i)
served by the rotate-half rotary every attention backend applies (pairs (i, i + d / 2)).

Attention reads queries and keys only through q . k, which a permutation of head_dim applied
to both leaves unchanged. So the rows of q_proj and k_proj (and their biases, per-head
norm weights and fp8 per-channel scales) are reordered within each head at load, evens
first then odds: pair (2i, 2i + 1) lands on (i, i + d / 2) and the backend's rotate-half
rotary, with the same frequencies, rotates it as the interleaved one would. Values and
o_proj are untouched, so the attention output is the checkpoint's. The KV cache holds keys
in the reordered layout, which nothing but this model's queries reads."""

from __future__ import annotations

import torch

from tpserve.weights import TensorSlice


def half_order(head_dim: int) -> torch.Tensor:
    """The reordering of one head's dimensions: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


class HalfOrderRows:
    """A checkpoint tensor (TensorSlice) read with each head's dimensions in half_order:
    along dim 0 for a projection's weight [heads * head_dim, in] or bias, along the last dim
    for a per-head norm weight [heads, head_dim]. Every read of dim 0 must cover whole heads
    (tp slices do: heads are never split across ranks)."""

    def __init__(self, w: TensorSlice, head_dim: int, per_head_last: bool = False) -> None:
        self._w, self.name, self.shape = w, w.name, w.shape
        self._d, self._last = head_dim, per_head_last
        self._order = half_order(head_dim)

    def __getitem__(self, index) -> torch.Tensor:
        t = self._w[index]
        if self._last:
            return t[..., self._order]
        index = index if isinstance(index, tuple) else (index,)
        start = index[0].start if index and isinstance(index[0], slice) else None
        if t.shape[0] % self._d or (start or 0) % self._d:
            raise ValueError(f"{self.name}: a read of rows that splits a head (a tpserve bug)")
        return t.view(-1, self._d, *t.shape[1:])[:, self._order].reshape(t.shape)

    def all(self) -> torch.Tensor:
        return self[:]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self[tuple(index)]

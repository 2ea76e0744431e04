"""In-memory tensors standing in for a safetensors file's slices, so that load-time code
reading TensorSlice (reorders, rank slicing) is tested without writing a file."""

from __future__ import annotations

import torch

from tpserve.weights import LoadStats, TensorSlice


class RawSlice:
    """What safe_open's get_slice returns, over a tensor: shape, dtype name, indexing."""

    def __init__(self, t: torch.Tensor, dtype: str) -> None:
        self.t, self.dtype = t, dtype

    def get_shape(self):
        return list(self.t.shape)

    def get_dtype(self):
        return self.dtype

    def __getitem__(self, index):
        return self.t[index]


def tensor_slice(name: str, t: torch.Tensor, dtype: str = "F32") -> TensorSlice:
    """A TensorSlice named `name` over t (dtype: the safetensors dtype name it reports)."""
    return TensorSlice(name, RawSlice(t, dtype), LoadStats())

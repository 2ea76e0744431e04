"""Shared helpers for splitting checkpoint tensors across ranks, with errors that name them."""

from __future__ import annotations

import torch

from tpserve.errors import ShardingError
from tpserve.weights import TensorSlice


def shard_size(total: int, tp: int, *, tensor: str, what: str, shape: tuple | None = None) -> int:
    """total // tp, or a ShardingError naming the tensor, its shape, tp and the rule."""
    if total % tp:
        shp = f" (shape {list(shape)})" if shape else ""
        raise ShardingError(
            f"cannot shard {tensor!r}{shp} across tp={tp}: {what} = {total} is not divisible "
            f"by {tp}. Choose a tp that divides {total}."
        )
    return total // tp


def check_shape(param: torch.Tensor, got: tuple, tensor: str) -> None:
    if tuple(param.shape) != tuple(got):
        raise ShardingError(
            f"checkpoint tensor {tensor!r} has shape {list(got)} but this rank expects "
            f"{list(param.shape)}: the checkpoint does not match its config.json"
        )


def copy_full(param: torch.Tensor, w: TensorSlice) -> None:
    """Replicated parameter: every rank reads the whole tensor."""
    check_shape(param, w.shape, w.name)
    param.data.copy_(w.all())


def copy_narrow(param: torch.Tensor, w: TensorSlice, dim: int, start: int, length: int,
                out_offset: int = 0) -> None:
    """Copy rows [start, start+length) along dim of w into param at out_offset along dim."""
    if start + length > w.shape[dim]:
        raise ShardingError(
            f"{w.name!r} (shape {list(w.shape)}) has {w.shape[dim]} entries on dim {dim}; "
            f"rank needs [{start}, {start + length})"
        )
    part = w.narrow(dim, start, length)
    param.data.narrow(dim, out_offset, length).copy_(part)


def expect_shape(w: TensorSlice, expected: tuple) -> None:
    """The full checkpoint tensor must have exactly the shape config.json implies, so a
    mismatched checkpoint fails at load instead of being partly loaded."""
    if tuple(w.shape) != tuple(expected):
        raise ShardingError(
            f"checkpoint tensor {w.name!r} has shape {list(w.shape)} but the model's "
            f"config.json implies {list(expected)}: the checkpoint does not match its config"
        )

"""Where a linear layer's parameters keep its output and input features, so one loader slices
float, packed int4 and fp8 tensors alike.

A linear layer thinks in logical coordinates: output features (rows of W) and input features
(columns of W). A checkpoint tensor stores them along some dims, possibly several per entry:
GPTQ packs 8 input rows per int32 of qweight, a scale covers group_size input features, AWQ
packs 8 output columns per int32. ParamLayout records that mapping for one tensor; the loader
turns a logical slice into a tensor index, reads only that, converts it to the stored layout
and copies it in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpserve.errors import ShardingError
from tpserve.weights import TensorSlice


@dataclass(frozen=True)
class ParamLayout:
    out_dim: int | None = 0  # dim indexing output features; None: the tensor has none
    in_dim: int | None = 1  # dim indexing input features; None: the tensor has none
    out_per: int = 1  # output features per entry along out_dim (8 for AWQ's packed int32)
    in_per: int = 1  # input features per entry along in_dim (8 packed, or the group size)
    # False: every rank holds the whole input extent (act-order scales of a row-parallel layer,
    # whose rows may belong to any group).
    in_sharded: bool = True
    # Block scales (fp8 weight_scale_inv, dims (0, 1)): an entry covers out_per x in_per weight
    # features, the last ones cut by the weight's edge, and a rank's slice may start or end
    # inside one (load_region reads the entries it touches, load_blocks says how).
    blocked: bool = False


FLOAT_WEIGHT = ParamLayout()
VECTOR = ParamLayout(out_dim=0, in_dim=None)  # biases and per-channel scales


def _div(n: int, per: int, tensor: str, what: str) -> int:
    if n % per:
        raise ShardingError(
            f"cannot slice {tensor!r}: {what} {n} is not a multiple of {per} (entries of this "
            f"tensor hold {per} features each). Choose a tp that keeps slices whole.")
    return n // per


def full_shape(layout: ParamLayout, out_total: int, in_total: int, ndim: int) -> tuple:
    """The checkpoint shape a tensor of this layout has for (out_total, in_total) features."""
    shape = [1] * ndim
    if layout.out_dim is not None:
        shape[layout.out_dim] = math.ceil(out_total / layout.out_per) if layout.blocked \
            else out_total // layout.out_per
    if layout.in_dim is not None:
        shape[layout.in_dim] = math.ceil(in_total / layout.in_per)
    return tuple(shape)


def attach(param: torch.nn.Parameter, src: ParamLayout, dst: ParamLayout | None = None,
           convert: Callable[[torch.Tensor], torch.Tensor] | None = None,
           optional: bool = False) -> torch.nn.Parameter:
    """Record how param's checkpoint tensor (src) and param itself (dst) lay out features;
    convert maps a checkpoint slice to the stored layout (AWQ repacking, zero offsets).
    optional: a checkpoint may omit it (a GPTQ g_idx without act-order)."""
    param.src_layout, param.dst_layout = src, dst or src
    param.convert, param.optional = convert, optional
    return param


def load_region(param: torch.nn.Parameter, w: TensorSlice, out: tuple[int, int, int],
                inp: tuple[int, int]) -> None:
    """Copy logical output features [out[0], out[0]+out[1]) to out[2] on this rank, and input
    features [inp[0], inp[0]+inp[1]) (the rank's whole input extent), from checkpoint w."""
    src, dst = param.src_layout, param.dst_layout
    if math.prod(w.shape) == 1 and src.in_dim is None and param.dim() == 1:
        # A per-tensor scale for a per-channel parameter (fp8 checkpoints): broadcast it.
        value = w[...] if w.shape == () else w.all()  # a 0-dim tensor takes no slice
        param.data.narrow(0, out[2], out[1]).fill_(value.reshape(()).item())
        return
    if src.blocked:
        load_blocks(param, w, out, inp)
        return
    index = [slice(None)] * len(w.shape)
    o_start, o_len, o_dst = out
    if src.out_dim is not None:
        s = _div(o_start, src.out_per, w.name, "output offset")
        index[src.out_dim] = slice(s, s + _div(o_len, src.out_per, w.name, "output features"))
    if src.in_dim is not None and src.in_sharded:
        s = _div(inp[0], src.in_per, w.name, "input offset")
        n = math.ceil(inp[1] / src.in_per) if inp[0] == 0 else \
            _div(inp[1], src.in_per, w.name, "input features")
        index[src.in_dim] = slice(s, s + n)
    part = w[tuple(index)]
    if param.convert is not None:
        part = param.convert(part, out)
    target = param.data
    if dst.out_dim is not None:
        target = target.narrow(dst.out_dim, o_dst // dst.out_per, o_len // dst.out_per)
    if tuple(target.shape) != tuple(part.shape):
        raise ShardingError(f"{w.name!r}: slice of shape {list(part.shape)} does not fit this "
                            f"rank's parameter region {list(target.shape)} (a tpserve bug)")
    target.copy_(part)


def load_blocks(param: torch.nn.Parameter, w: TensorSlice, out: tuple[int, int, int],
                inp: tuple[int, int]) -> None:
    """load_region for block scales. The parameter's blocks (dst.out_per x dst.in_per) divide
    the checkpoint's (src's) and every offset a slice starts at, so each lies inside one
    checkpoint block: read the checkpoint blocks the slice touches (a block shared with the
    neighbouring rank too) and give each parameter block its checkpoint block's scale."""
    src, dst = param.src_layout, param.dst_layout
    o_start, o_len, o_dst = out
    if o_start % dst.out_per or o_dst % dst.out_per or inp[0] % dst.in_per:
        raise ShardingError(f"{w.name!r}: a slice at output {o_start} (to {o_dst}), input "
                            f"{inp[0]} cuts this rank's {dst.out_per} x {dst.in_per} scale "
                            "blocks (a tpserve bug)")
    rows = torch.arange(o_start, o_start + o_len, dst.out_per) // src.out_per
    cols = torch.arange(inp[0], inp[0] + inp[1], dst.in_per) // src.in_per
    r0, c0 = int(rows[0]), int(cols[0])
    part = w[r0:int(rows[-1]) + 1, c0:int(cols[-1]) + 1]
    if param.convert is not None:
        part = param.convert(part, out)
    part = part[rows - r0][:, cols - c0]
    target = param.data.narrow(0, o_dst // dst.out_per, len(rows))
    if tuple(target.shape) != tuple(part.shape):
        raise ShardingError(f"{w.name!r}: scale blocks of shape {list(part.shape)} do not fit "
                            f"this rank's parameter region {list(target.shape)} (a tpserve bug)")
    target.copy_(part)


def expect_full(param: torch.nn.Parameter, w: TensorSlice, out_total: int, in_total: int) -> None:
    """The whole checkpoint tensor must have the shape config.json implies for this layer."""
    src = param.src_layout
    if math.prod(w.shape) == 1 and src.in_dim is None and param.dim() == 1:
        return
    expected = full_shape(src, out_total, in_total, len(w.shape))
    if tuple(w.shape) != expected:
        raise ShardingError(
            f"checkpoint tensor {w.name!r} has shape {list(w.shape)} but the model's "
            f"config.json implies {list(expected)}: the checkpoint does not match its config")

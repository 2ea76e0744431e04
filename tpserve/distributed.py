"""Tensor-parallel rank/size and the collectives the layers use.

TPInfo is set once per process; layers read it through get_tp() which raises when unset,
so a layer built outside a worker fails loudly instead of silently running unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.size):
            raise ValueError(f"tp rank {self.rank} outside [0, {self.size})")


_TP: TPInfo | None = None
_GROUP: dist.ProcessGroup | None = None


def set_tp(info: TPInfo, group: dist.ProcessGroup | None = None) -> None:
    global _TP, _GROUP
    if _TP is not None and _TP != info:
        raise RuntimeError(f"tensor-parallel info already set to {_TP}; refusing {info}")
    if info.size > 1 and group is None and not dist.is_initialized():
        raise RuntimeError("tp size > 1 needs an initialised torch.distributed group")
    _TP, _GROUP = info, group


def reset_tp() -> None:
    """For tests and for a worker that tears down its model."""
    global _TP, _GROUP
    _TP, _GROUP = None, None


def get_tp() -> TPInfo:
    if _TP is None:
        raise RuntimeError("tensor-parallel info is not set: call tpserve.distributed.set_tp first")
    return _TP


class tp_context:
    """Temporarily set TPInfo (tests and meta-device shape checks); restores what was there."""

    def __init__(self, rank: int, size: int) -> None:
        self.info = TPInfo(rank, size)

    def __enter__(self) -> TPInfo:
        global _TP
        self._saved = _TP
        _TP = self.info
        return self.info

    def __exit__(self, *exc: object) -> None:
        global _TP
        _TP = self._saved


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp().size == 1:
        return x
    dist.all_reduce(x, group=_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension (rank order)."""
    size = get_tp().size
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=_GROUP)
    return torch.cat(parts, dim=-1)


def gather_last_dim_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's x concatenated along the last dimension (rank order) on tp rank 0 only;
    None on the other ranks, which send their part and receive nothing."""
    tp = get_tp()
    if tp.size == 1:
        return x
    x = x.contiguous()
    dst = dist.get_global_rank(_GROUP, 0) if _GROUP is not None else 0
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(x, parts, dst=dst, group=_GROUP)
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """tp rank 0's x into x on every rank of the group, in place (with a device collective
    backend, queued on the device's stream: the host does not wait)."""
    if get_tp().size == 1:
        return x
    src = dist.get_global_rank(_GROUP, 0) if _GROUP is not None else 0
    dist.broadcast(x, src=src, group=_GROUP)
    return x

"""LoRA deltas of one linear layer for every loaded adapter, applied per token row.

A layer holding LoRA weights keeps every adapter stacked: a [slots, parts * r, in] and
b [slots, out, parts * r] (this rank's slice; r is the largest rank among the adapters,
smaller ranks are zero padded; the scale is folded into b). A layer fusing several checkpoint projections (q, k, v
or gate, up) stacks each projection's A along the rank dim and places its B block-diagonally,
so the fused output gets every projection's own delta in one pair of matmuls.

Which rows use which adapter is the step's (LoraRows), scoped by lora_rows(); outside it (the
base model's steps, warmup, graph capture) a layer adds nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class LoraRows:
    """(slot, token rows of that adapter on the device) per adapter in the step."""

    groups: list[tuple[int, torch.Tensor]]


_CURRENT: LoraRows | None = None


@contextmanager
def lora_rows(rows: LoraRows | None) -> Iterator[None]:
    global _CURRENT
    saved, _CURRENT = _CURRENT, rows
    try:
        yield
    finally:
        _CURRENT = saved


def active(layer: nn.Module) -> bool:
    """Whether this step adds a LoRA delta to `layer` (its fused fast paths must not run)."""
    return _CURRENT is not None and getattr(layer, "lora", None) is not None


class LoraWeights(nn.Module):
    def __init__(self, slots: int, parts: int, rank: int, in_features: int,
                 out_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.rank = rank
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("a", torch.zeros(slots, parts * rank, in_features, **kw))
        self.register_buffer("b", torch.zeros(slots, out_features, parts * rank, **kw))

    def set(self, slot: int, part: int, a: torch.Tensor, b_rows: torch.Tensor,
            out_at: int) -> None:
        """One projection of one adapter: a [r, in] whole (this rank's input columns), and
        b_rows [n, r] (already scaled) as output rows out_at.. of this rank's slice."""
        r, lo = a.shape[0], part * self.rank
        self.a[slot, lo : lo + r].copy_(a)
        self.b[slot, out_at : out_at + b_rows.shape[0], lo : lo + r].copy_(b_rows)

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter delta x A^T B^T (rows of the base model unchanged)."""
        rows = _CURRENT
        if rows is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        for slot, idx in rows.groups:
            xs = x2.index_select(0, idx)
            y2 = y2.index_add(0, idx, (xs @ self.a[slot].T) @ self.b[slot].T)
        return y2.view(y.shape)


def step_groups(adapters: list[int], q_lens: list[int]) -> list[tuple[int, np.ndarray]]:
    """(slot, token rows) of each adapter in a step, from each sequence's adapter (0: the
    base model) and its number of new tokens."""
    rows: dict[int, list[int]] = {}
    at = 0
    for adapter, n in zip(adapters, q_lens, strict=True):
        if adapter:
            rows.setdefault(adapter - 1, []).extend(range(at, at + n))
        at += n
    return [(slot, np.asarray(r, dtype=np.int64)) for slot, r in sorted(rows.items())]

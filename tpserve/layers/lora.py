"""LoRA deltas of one linear layer for every loaded adapter, applied per token row.

A layer holding LoRA weights keeps every adapter stacked: a [slots, parts * r, in] and
b [slots, out, parts * r] (this rank's slice; r is the largest rank among the adapters,
smaller ranks are zero padded; the scale is folded into b). A layer fusing several checkpoint
projections (q, k, v or gate, up) stacks each projection's A along the rank dim and places
its B block-diagonally, so the fused output gets every projection's own delta in one pair of
matmuls. A slot is an adapter's index in --lora-modules: every loaded adapter has its own.

Which rows use which adapter is the step's (LoraRows), scoped by lora_rows(); outside it (the
base model's eager steps, warmup) a layer adds nothing. Two forms of the same delta:
- groups (eager steps): per adapter in the step, gather its rows, two matmuls, index_add.
  Each row's delta is computed once, whatever the number of adapters, which is what a long
  prefill wants; the gathers have data-dependent shapes, so no graph can hold them.
- mask (captured steps): every row against every slot, x A_all^T with the columns of the
  other slots zeroed, then B_all: three launches of static shapes, no host sync. The work
  grows with the number of loaded adapters, small at the few hundred rows a graph holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn


@dataclass
class LoraRows:
    """groups: (slot, token rows of that adapter on the device) per adapter in the step; or
    unused: bool [rows, slots], False at each row's adapter slot only (all True for the
    base model): the mask, stored inverted for masked_fill."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    unused: torch.Tensor | None = None


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
        self.rank, self.slots, self.width = rank, slots, parts * rank
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("a", torch.zeros(slots, parts * rank, in_features, **kw))
        # B of every slot side by side, [out, slots * parts * r]: the masked delta's second
        # matmul reads it whole and contiguous; `b` is the per-slot view of the same memory.
        self.register_buffer("b_all", torch.zeros(out_features, slots * parts * rank, **kw))

    @property
    def b(self) -> torch.Tensor:
        """[slots, out, parts * r], a view of b_all."""
        return self.b_all.view(self.b_all.shape[0], self.slots, self.width).transpose(0, 1)

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
        if rows.unused is not None:
            return self._masked(y2, x2, rows.unused).view(y.shape)
        for slot, idx in rows.groups:
            xs = x2.index_select(0, idx)
            y2 = y2.index_add(0, idx, (xs @ self.a[slot].T) @ self.b[slot].T)
        return y2.view(y.shape)

    def _masked(self, y2: torch.Tensor, x2: torch.Tensor, unused: torch.Tensor
                ) -> torch.Tensor:
        n = x2.shape[0]
        h = x2 @ self.a.view(-1, self.a.shape[-1]).T  # [rows, slots * parts * r]
        # A fill, not a multiply by 0/1: a masked-out term is an exact zero even where another
        # slot's x A^T overflowed, so base rows and padded rows keep y bit for bit.
        h = h.view(n, self.slots, self.width).masked_fill(unused[:, :, None], 0.0)
        return torch.addmm(y2, h.view(n, -1), self.b_all.T)


def lora_slots(model: nn.Module) -> int:
    """Adapter slots of the model's LoRA layers; 0 where no adapter is loaded."""
    return max((m.slots for m in model.modules() if isinstance(m, LoraWeights)), default=0)


class StaticLoraRows:
    """A captured step's LoRA input: each token row's adapter slot (-1: the base model, or a
    row the step does not fill) in a static buffer that every replay refills, like the other
    graph inputs. scope() builds the row mask from it with one comparison into another
    static buffer, inside the graph, so the graph holds every slot's delta and the buffer
    picks each row's. -1 matches no slot: the row's mask is all zeros."""

    def __init__(self, rows: int, slots: int, device: torch.device) -> None:
        self.slot = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.cols = torch.arange(slots, device=device)
        self.unused = torch.ones(rows, slots, dtype=torch.bool, device=device)

    @classmethod
    def of(cls, model: nn.Module, rows: int, device: torch.device) -> StaticLoraRows | None:
        """None for a model without adapters: its graphs capture nothing of LoRA."""
        slots = lora_slots(model)
        return cls(rows, slots, device) if slots else None

    @contextmanager
    def scope(self, n: int) -> Iterator[None]:
        unused = self.unused[:n]
        torch.ne(self.slot[:n, None], self.cols, out=unused)
        with lora_rows(LoraRows(unused=unused)):
            yield


def static_scope(rows: StaticLoraRows | None, n: int):
    """rows.scope(n), or nothing for a model without adapters."""
    return rows.scope(n) if rows is not None else nullcontext()


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


def row_slots(adapters: list[int], q_lens: list[int]) -> np.ndarray:
    """Each token row's slot (-1: the base model), from each sequence's adapter and its
    number of new tokens: what a captured step's StaticLoraRows.slot takes."""
    return np.repeat(np.asarray(adapters, dtype=np.int64) - 1, q_lens)

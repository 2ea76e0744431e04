"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded up to a multiple of tp so every rank owns the same number of rows;
padded rows are zero and their logits are cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed import (
    all_gather_last_dim,
    all_reduce,
    gather_last_dim_to_first,
    get_tp,
)
from tpserve.kernels import fused_ops, gemv
from tpserve.layers.sharding import check_shape, copy_full, copy_narrow
from tpserve.weights import TensorSlice


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp()
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.rows_per_rank = self.padded_vocab // tp.size
        self.start = tp.rank * self.rows_per_rank
        self.end = self.start + self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        # Rows of [vocab, hidden] or, for a head's bias (Phi), entries of [vocab].
        if w.shape[0] < self.vocab_size or tuple(w.shape[1:]) != tuple(param.shape[1:]):
            check_shape(param, (self.vocab_size, *param.shape[1:]), w.name)
        # Checkpoints may carry extra (padding) rows beyond config.vocab_size; ignore them.
        real = max(0, min(self.end, self.vocab_size) - self.start)
        param.data.zero_()
        if real:
            copy_narrow(param, w, 0, self.start, real)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mine, self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)


class ReplicatedEmbedding(nn.Module):
    """A table every rank holds whole, so a lookup needs no collective (GPTBigCode's learned
    positions, `wpe`: n_positions x hidden, small beside the layers)."""

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)
        self.weight.weight_loader = copy_full

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h W^T over this rank's vocabulary rows, gathered across ranks."""

    def __init__(self, vocab_size: int, hidden: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden)
        self.gemv_tile = None  # set by warmup where the one-row GEMV beats F.linear
        fused_ops.plan_greedy(vocab_size)  # the sampler's kernels for these logits
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.rows_per_rank), requires_grad=False)
            self.bias.weight_loader = self.load_rows

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        """Full-vocabulary logits on every rank; with to_first_rank, only on tp rank 0 (the
        rank that samples) and None elsewhere, which moves 1/tp of the bytes."""
        if self.bias is None:
            logits = gemv.linear(hidden, self.weight, self.gemv_tile)
        else:
            logits = F.linear(hidden, self.weight, self.bias)
        if to_first_rank:
            logits = gather_last_dim_to_first(logits)
            return None if logits is None else logits[..., : self.vocab_size]
        return all_gather_last_dim(logits)[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.compute_logits(hidden)

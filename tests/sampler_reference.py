"""A straightforward per-row sampler: the oracle for tpserve.layers.sampler's vectorised one.

Each rule is written the plain way, one row at a time, as transformers' logits processors and
warpers do (repetition penalty, temperature, top-k, top-p, typical-p).
"""

from __future__ import annotations

import torch

from tpserve.engine.request import SamplingParams


def penalise(logits: torch.Tensor, p: SamplingParams, history: list[int] | None,
             generated: list[int] | None) -> torch.Tensor:
    logits = logits.clone()
    for tid, value in p.logit_bias:  # OpenAI's logit_bias, before any penalty
        logits[tid] += value
    if history and p.repetition_penalty and p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(history)))
        seen = logits[ids]
        logits[ids] = torch.where(seen < 0, seen * p.repetition_penalty,
                                  seen / p.repetition_penalty)
    if generated and p.frequency_penalty:
        ids, counts = torch.tensor(generated).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype)
    if generated and p.presence_penalty:  # once per distinct generated token
        logits[torch.tensor(sorted(set(generated)))] -= p.presence_penalty
    return logits


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and typical-p masks, for one row."""
    if p.temperature and p.temperature != 1.0:
        logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p.top_p
        drop[-1] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if p.typical_p is not None and p.typical_p < 1.0:
        logp = logits.log_softmax(-1)
        ent = -(logp.exp() * logp).nansum()
        shifted = (-logp - ent).abs()
        s_sorted, order = torch.sort(shifted)
        cum = logits.softmax(-1)[order].cumsum(-1)
        last = int((cum < p.typical_p).sum())
        drop = s_sorted > s_sorted[min(last, len(s_sorted) - 1)]
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def distribution(logits: torch.Tensor, p: SamplingParams, history: list[int] | None = None,
                 num_generated: int = 0) -> torch.Tensor:
    """log p over the vocabulary that one row's token is drawn from (or arg-maxed, if greedy)."""
    generated = history[len(history) - num_generated:] if history and num_generated else None
    x = penalise(logits.float(), p, history, generated)
    return (x if p.greedy else warp(x, p)).log_softmax(-1)

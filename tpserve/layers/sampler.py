"""Turns the last-position logits of a step into next tokens (runs on rank 0 only).

Greedy rows are one vectorised arg-max. Sampled rows draw with a generator seeded by
(seed, tokens generated so far), so a seeded request gives the same text whatever else
shares its batch, and nothing has to be kept between steps.
"""

from __future__ import annotations

import torch

from tpserve.engine.request import SamplingParams
from tpserve.engine.step import SampledToken, SeqStep


def apply_penalties(logits: torch.Tensor, p: SamplingParams, history: list[int] | None,
                    generated: list[int] | None) -> torch.Tensor:
    if history and p.repetition_penalty and p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(history)), device=logits.device)
        seen = logits[ids]
        logits[ids] = torch.where(seen < 0, seen * p.repetition_penalty, seen / p.repetition_penalty)
    if generated and p.frequency_penalty:
        ids, counts = torch.tensor(generated, device=logits.device).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and typical-p masks (as transformers' warpers do)."""
    if p.temperature and p.temperature != 1.0:
        logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p is not None and p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - p.top_p
        drop[-1] = False  # always keep the most likely token
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


def _generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) % (2**63))
    return g


def sample(logits: torch.Tensor, seqs: list[SeqStep], default_seed: int = 0) -> list[SampledToken]:
    """logits: [len(seqs), vocab] float32 for the sequences that sample this step."""
    out: list[SampledToken] = []
    logits = logits.float()
    raw_logprobs = logits.log_softmax(-1)
    greedy_ids = logits.argmax(-1).tolist()
    for row, s in enumerate(seqs):
        p = s.params or SamplingParams()
        if p.greedy and not p.repetition_penalty and not p.frequency_penalty:
            token, lp = greedy_ids[row], raw_logprobs[row]
        else:
            generated = s.history[len(s.history) - s.num_generated:] if s.history else None
            x = apply_penalties(logits[row].clone(), p, s.history, generated)
            if p.greedy:
                token, lp = int(x.argmax()), x.log_softmax(-1)
            else:
                x = filter_logits(x, p)
                probs = x.softmax(-1)
                seed = p.seed if p.seed is not None else default_seed + s.seq_id
                g = _generator(seed, s.num_generated, logits.device)
                token = int(torch.multinomial(probs, 1, generator=g))
                lp = x.log_softmax(-1)  # the distribution the token was drawn from
        top = []
        if p.top_n_tokens:
            vals, ids = torch.topk(lp, p.top_n_tokens)
            top = list(zip(ids.tolist(), vals.tolist()))
        out.append(SampledToken(s.seq_id, token, float(lp[token]), top))
    return out

"""The model runner's side of the sampler contract: rows in, tokens out, with one
device-to-host copy per step.

The sampler contract (tpserve.layers.sampler): sample(logits, [SampleRow]) -> SampleResult
with token_ids / logprobs / top_ids / top_logprobs on the device and no host sync.
"""

from __future__ import annotations

import torch

from tpserve.engine.request import SamplingParams
from tpserve.engine.step import SampledToken, SeqStep
from tpserve.layers import sampler as _sampler


def sample_tokens(logits: torch.Tensor, seqs: list[SeqStep], default_seed: int
                  ) -> list[SampledToken]:
    """logits [len(seqs), vocab] float32; the sampled token of each sequence."""
    rows = [_sampler.SampleRow(
        params=s.params or SamplingParams(),
        seed=_seed(s, default_seed), step=s.num_generated,
        history=tuple(s.history) if s.history is not None else None,
        num_generated=s.num_generated) for s in seqs]
    res = _sampler.sample(logits, rows)
    # One transfer and one sync: ids (exact in float64 below 2**53) and logprobs together.
    parts = [res.token_ids.double()[:, None], res.logprobs.double()[:, None]]
    k = 0
    if res.top_ids is not None:
        k = res.top_ids.shape[1]
        parts += [res.top_ids.double(), res.top_logprobs.double()]
    host = torch.cat(parts, dim=1).cpu().tolist()
    out = []
    for s, row in zip(seqs, host, strict=True):
        n = (s.params.top_n_tokens if s.params else 0) or 0
        top = [(int(row[2 + j]), row[2 + k + j]) for j in range(min(n, k))]
        out.append(SampledToken(s.seq_id, int(row[0]), row[1], top))
    return out


def _seed(s: SeqStep, default_seed: int) -> int:
    p = s.params
    if p is not None and p.seed is not None:
        return p.seed
    return default_seed + s.seq_id


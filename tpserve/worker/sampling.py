"""The model runner's side of the sampler contract: rows in, tokens out, with one
device-to-host copy per step that the host waits for only when it needs the tokens.

The sampler contract (tpserve.layers.sampler): sample(logits, [SampleRow]) -> SampleResult
with token_ids / logprobs / top_ids / top_logprobs on the device and no host sync. A guided
request's row also carries `allowed`, the grammar's bitmask of the tokens it may take.

With overlapped steps the host launches step n+1 before it reads step n's tokens: the ids
stay on the device (they feed step n+1's inputs there), and one packed copy into pinned host
memory, ordered after the sampler on the device's stream, is waited for by an event when the
engine collects the step.
"""

from __future__ import annotations

import numpy as np
import torch

from tpserve.engine.request import SamplingParams
from tpserve.engine.step import SampledToken, SeqStep
from tpserve.layers import sampler as _sampler


class PendingTokens:
    """Sampled tokens on their way to the host: `ids` stays on the device for the next step;
    `tokens()` waits for the copy (not for the whole device) and decodes it."""

    def __init__(self, seqs: list[SeqStep], ids: torch.Tensor, packed: torch.Tensor,
                 k: int, event: torch.Event | None) -> None:
        self.seqs, self.ids, self.k = seqs, ids, k
        self._packed, self._event = packed, event

    def tokens(self) -> list[SampledToken]:
        if self._event is not None:
            self._event.synchronize()
        # int64 columns: id, float32 bits of log p, then k top ids and k top log p bits.
        rows = self._packed.numpy()
        k, n = self.k, len(self.seqs)
        ids = rows[:, 0].tolist()
        lps = rows[:, 1].astype(np.int32).view(np.float32).astype(np.float64).tolist()
        if k:
            top_ids = rows[:, 2 : 2 + k].tolist()
            top_lps = rows[:, 2 + k :].astype(np.int32).view(np.float32).tolist()
        out = []
        for i in range(n):
            s = self.seqs[i]
            top_n = min((s.params.top_n_tokens if s.params else 0) or 0, k)
            top = list(zip(top_ids[i][:top_n], top_lps[i][:top_n])) if top_n else []
            if top and s.allowed is not None:
                # Fewer tokens than top_n allowed: the rest are forbidden, not alternatives.
                top = [(t, lp) for t, lp in top if lp != float("-inf")]
            out.append(SampledToken(s.seq_id, ids[i], lps[i], top))
        return out


def sample_async(logits: torch.Tensor, seqs: list[SeqStep], default_seed: int) -> PendingTokens:
    """logits [len(seqs), vocab] (any float dtype): sample every row on the device and start the copy
    of the results to the host; nothing here waits for the device."""
    rows = [_sampler.SampleRow(
        params=s.params or SamplingParams(),
        seed=_seed(s, default_seed), step=s.num_generated,
        history=tuple(s.history) if s.history is not None else None,
        num_generated=s.num_generated,
        # Only guided rows name it: a sampler without masks still takes every other row.
        **({"allowed": s.allowed} if s.allowed is not None else {})) for s in seqs]
    res = _sampler.sample(logits, rows)
    # Everything as int64 (log-probabilities as their float32 bits): one exact transfer that
    # needs no float64, which some GPUs lack.
    parts = [res.token_ids[:, None], _bits(res.logprobs)[:, None]]
    k = 0
    if res.top_ids is not None:
        k = res.top_ids.shape[1]
        parts += [res.top_ids, _bits(res.top_logprobs)]
    packed = torch.cat(parts, dim=1)
    event = None
    if packed.device.type != "cpu":
        host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.Event(device=packed.device)
        event.record()
        packed = host
    return PendingTokens(seqs, res.token_ids, packed, k, event)


def sample_tokens(logits: torch.Tensor, seqs: list[SeqStep], default_seed: int
                  ) -> list[SampledToken]:
    """The synchronous form: the sampled token of each sequence."""
    return sample_async(logits, seqs, default_seed).tokens()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32).to(torch.int64)


def _seed(s: SeqStep, default_seed: int) -> int:
    p = s.params
    if p is not None and p.seed is not None:
        return p.seed
    return default_seed + s.seq_id

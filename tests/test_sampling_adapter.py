"""The model runner's side of the batched sampler contract (sample(logits, [SampleRow]) ->
SampleResult on the device): rows carry each sequence's parameters, seed and step, and the
result comes back to the host in one copy as the same SampledTokens the engine reads."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tpserve.engine.request import SamplingParams
from tpserve.engine.step import SeqStep
from tpserve.worker import sampling


@dataclass(frozen=True)
class Row:
    params: SamplingParams
    seed: int
    step: int
    history: tuple[int, ...] | None = None
    num_generated: int = 0


def test_batched_contract_results_reach_the_engine(monkeypatch):
    seen = []

    def sample(logits, rows):  # a greedy reference sampler with top-k alternatives
        seen.extend(rows)
        lp = logits.log_softmax(-1)
        k = max(r.params.top_n_tokens for r in rows)
        top = lp.topk(k, -1) if k else None
        ids = lp.argmax(-1)
        return SimpleNamespace(token_ids=ids, logprobs=lp.gather(1, ids[:, None])[:, 0],
                               top_ids=top.indices if k else None,
                               top_logprobs=top.values if k else None)

    monkeypatch.setattr(sampling, "_sampler", SimpleNamespace(SampleRow=Row, sample=sample))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, 1.0]])
    seqs = [SeqStep(4, [1], 7, [0], True, SamplingParams(top_n_tokens=2), history=[1, 2, 3],
                    num_generated=2),
            SeqStep(9, [1], 3, [0], True, SamplingParams(seed=5, do_sample=True))]
    out = sampling.sample_tokens(logits, seqs, default_seed=100)
    lp = logits.log_softmax(-1)
    assert [(t.seq_id, t.token_id) for t in out] == [(4, 1), (9, 0)]
    assert abs(out[0].logprob - lp[0, 1].item()) < 1e-6
    assert [i for i, _ in out[0].top] == [1, 3] and out[1].top == []
    assert (seen[0].seed, seen[0].step, seen[0].history) == (104, 2, (1, 2, 3))
    assert seen[1].seed == 5


def test_the_device_sampler_through_the_adapter():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.5, 1.5]])
    seqs = [SeqStep(1, [1], 0, [0], True, SamplingParams(top_n_tokens=2)),
            SeqStep(2, [1], 0, [0], True, SamplingParams())]
    out = sampling.sample_tokens(logits, seqs, 0)
    lp = logits.log_softmax(-1)
    assert [t.token_id for t in out] == [1, 0]
    assert abs(out[0].logprob - lp[0, 1].item()) < 1e-6
    assert [i for i, _ in out[0].top] == [1, 2] and out[1].top == []

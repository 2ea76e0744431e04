"""Speculative verification rows on families whose attention the torch backend's short-row
path must get right: GPT-OSS (attention sinks, a window on every other layer), DeepSeek-V3
(latent attention, values padded to the key width) and Llama 4 (chunked attention, layers
without rotary). Their tiny random models rarely repeat themselves, so the proposer here
drafts transformers' own greedy continuation with every third draft run's last token
corrupted: verification must accept the right drafts, reject the wrong ones, and the output
must stay transformers' float32 greedy generate."""

from __future__ import annotations

import pytest
from engine_utils import make_engine
from tiny_models import PROMPTS, family_checkpoint, hf_greedy_ids

import tpserve.engine.core as core_module
from tpserve.config import SpeculativeConfig
from tpserve.engine.request import SamplingParams

SPEC = SpeculativeConfig("ngram", num_tokens=4, ngram_max=3, ngram_min=1, max_batch=64)
N = 24


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek-v3", "llama4"])
def test_verification_rows_match_transformers(models_dir, monkeypatch, name):
    path = family_checkpoint(models_dir, name)
    engine = make_engine(path, 1, local=True, speculative=SPEC)
    try:
        prompts = [engine.tokenize(p) for p in PROMPTS]
        want = hf_greedy_ids(path, prompts, [N] * len(prompts))
        ref = {tuple(p): w for p, w in zip(prompts, want, strict=True)}

        def draft(seq, cfg, budget, packed):
            done = len(seq.output_ids)
            out = list(ref[tuple(seq.prompt_ids)][done : done + budget])
            if out and done % 3 == 0:
                out[-1] = (out[-1] + 1) % 300  # a wrong draft the target must reject
            return out

        monkeypatch.setattr(core_module, "draft", draft)
        seqs = [engine.add_request(p, SamplingParams(max_new_tokens=N, ignore_eos=True))
                for p in prompts]
        while engine.has_work():
            engine.step()
        assert [s.output_ids for s in seqs] == want
        counters = engine.counters()
        assert counters["spec_draft_tokens"] > counters["spec_accepted_tokens"] > 0
    finally:
        engine.shutdown()

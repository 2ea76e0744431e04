"""T5 served by tp = 1, 2, 4 Ray shard actors matches transformers (float32, CPU): a
Flan-style model (gated-gelu, own lm_head) and an original-style one (relu, tied head with
the d_model ** -0.5 output scaling). One engine per (model, tp) serves every test."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_close_rel, make_engine, prefill_logits
from tiny_models import PROMPTS, hf_greedy, save_t5_model, t5_config

from tpserve.engine.request import SamplingParams

MODELS = {"flan": True, "t5": False}
NEW_TOKENS = 32
# The four prompts need 20 cross blocks and at most 4 x 9 decoder blocks of 4 tokens (56);
# 64 blocks hold them together, but not the same prompts twice over (112).
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def t5_dirs(models_dir):
    return {name: save_t5_model(t5_config(flan), models_dir / f"t5-{name}")
            for name, flan in MODELS.items()}


def hf_first_step_logits(path, prompts: list[str]) -> list[torch.Tensor]:
    """transformers' logits for the first decoder token (after decoder_start_token_id)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    start = torch.tensor([[model.config.decoder_start_token_id]])
    out = []
    for p in prompts:
        with torch.no_grad():
            out.append(model(input_ids=tok(p, return_tensors="pt").input_ids,
                             decoder_input_ids=start).logits[0, -1].float())
    return out


@pytest.fixture(scope="module")
def references(t5_dirs):
    return {name: (hf_greedy(path, PROMPTS, NEW_TOKENS), hf_first_step_logits(path, PROMPTS))
            for name, path in t5_dirs.items()}


@pytest.fixture(scope="module", params=[(m, tp) for m in MODELS for tp in (1, 2, 4)],
                ids=lambda p: f"{p[0]}-tp{p[1]}")
def served(request, ray_cluster, t5_dirs):
    name, tp = request.param
    engine = make_engine(t5_dirs[name], tp, block_size=4, num_blocks=NUM_BLOCKS,
                         max_model_len=128)
    try:
        yield name, engine
    finally:
        engine.shutdown()


def run_greedy(engine, prompts: list[str]):
    """Greedy continuations of prompts submitted together; (sequences, final events)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    seqs = [engine.add_request(engine.tokenize(p), params) for p in prompts]
    final = {}
    while len(final) < len(seqs):
        events, _ = engine.step()
        final.update((sid, ev) for sid, ev in events if ev.finished)
    return seqs, [final[s.seq_id] for s in seqs]


def test_prompts_cover_the_cases(served):
    _, engine = served
    lens = [len(engine.tokenize(p)) for p in PROMPTS]
    assert max(lens) > 32 and min(lens) == 1 and len(set(lens)) == len(lens)


def test_first_step_logits_match(served, references):
    name, engine = served
    for got, ref in zip(prefill_logits(engine, PROMPTS), references[name][1], strict=True):
        assert got.shape == ref.shape == (301,)
        assert_close_rel(got, ref, 1e-4)


def test_mixed_batch_matches_transformers(served, references):
    name, engine = served
    seqs, events = run_greedy(engine, PROMPTS)
    assert [s.output_ids for s in seqs] == references[name][0]
    assert all(s.num_preemptions == 0 for s in seqs)
    # The prompt the user sent is the encoder input; that is what prompt_tokens reports.
    assert [ev.prompt_tokens for ev in events] == [len(engine.tokenize(p)) for p in PROMPTS]
    assert engine.scheduler.blocks.num_free == NUM_BLOCKS


def test_preempted_sequences_recompute_encoder_and_match(served, references):
    name, engine = served
    seqs, _ = run_greedy(engine, PROMPTS * 2)
    assert sum(s.num_preemptions for s in seqs) > 0, "the cache was meant to run out"
    assert [s.output_ids for s in seqs] == references[name][0] * 2
    assert engine.scheduler.blocks.num_free == NUM_BLOCKS


def test_continuations_are_not_degenerate(references):
    """Guards the oracle: weights that always emit one token would make equality too easy."""
    for tokens, _ in references.values():
        assert all(len(set(t)) > 3 for t in tokens)
        assert len({tuple(t) for t in tokens}) == len(tokens)

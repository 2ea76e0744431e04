"""Prompt log-probabilities (TGI's decoder_input_details, OpenAI's echo with logprobs: what
lm-eval's log-likelihood requests read) against transformers' log_softmax on the same
checkpoint, when the prompt is not prefilled in one step: chunked to the step's token budget
(a long prompt, or any prompt admitted while others decode), recomputed after a preemption,
under a sliding window; and a prompt of one token."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_engine
from tiny_models import PROMPTS, mistral_config, save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tpserve.engine.request import SamplingParams


@pytest.fixture(scope="module")
def mistral_dir(models_dir):
    """A sliding window of 8: a chunk's first query sees one key further back than the
    window of the last token computed."""
    out = models_dir / "mistral-window"
    return out if (out / "config.json").exists() else save_model(mistral_config(), out)


def _reference(path, prompt: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The prompt's ids, log p of each token after the first, and each position's top 2."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = model(ids).logits[0].log_softmax(-1)[:-1]
    return ids[0].tolist(), logp.gather(1, ids[0, 1:, None])[:, 0], logp.topk(2, -1).values


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("budget,blocks", [(5, 256), (8, 30)], ids=["chunked", "preempted"])
def test_chunked_and_preempted_prompts_score_like_transformers(
        llama_dir, mistral_dir, family, budget, blocks):
    """A chunk reports log p of its tokens after its first; each chunk's first token went
    unscored and every later log-probability landed one place early (46 of 52 tokens, off
    by up to 1.7 nats). 30 blocks of 4 hold the three requests only by preempting one."""
    path = llama_dir if family == "llama" else mistral_dir
    ids, want, top = _reference(path, PROMPTS[2])
    engine = make_engine(path, 1, local=True, max_batch_tokens=budget, num_blocks=blocks)
    params = SamplingParams(max_new_tokens=30, prompt_logprobs=True, top_n_tokens=2,
                            ignore_eos=True)
    try:
        finals = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[2]], params)
    finally:
        engine.shutdown()
    for ev in finals[::2]:
        assert [t.id for t in ev.prefill] == ids
        assert ev.prefill[0].logprob is None
        got = torch.tensor([t.logprob for t in ev.prefill[1:]])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        alts = torch.tensor([[t.logprob for t in a] for a in ev.prefill_top[1:]])
        torch.testing.assert_close(alts, top, rtol=1e-4, atol=1e-4)


def test_a_one_token_prompt_reports_its_token(llama_dir):
    """No step reports a log-probability for a one-token prompt: its prefill was empty,
    so TGI's `prefill` lacked the prompt and OpenAI's echoed `tokens` left out text that
    `text` and `text_offset` count."""
    engine = make_engine(llama_dir, 1, local=True)
    try:
        ev = engine.generate([[5]], SamplingParams(max_new_tokens=2, prompt_logprobs=True,
                                                   top_n_tokens=1))[0]
    finally:
        engine.shutdown()
    assert [(t.id, t.logprob) for t in ev.prefill] == [(5, None)]
    assert ev.prefill_top == [[]]

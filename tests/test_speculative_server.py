"""--speculative ngram through the HTTP server (the real app over an in-process engine): the
TGI and OpenAI clients get transformers' greedy tokens, streamed or not, and /metrics shows
the drafted and accepted token counters."""

from __future__ import annotations

import httpx
import openai
import pytest
import text_generation
from engine_utils import served_engine
from tiny_models import PROMPTS, hf_greedy

from tpserve.config import SpeculativeConfig

N = 32


@pytest.fixture(scope="module")
def url(llama_dir):
    with served_engine(llama_dir, "tiny", max_model_len=256, max_concurrent_requests=8,
                       speculative=SpeculativeConfig("ngram")) as (_, base):
        yield base


@pytest.fixture(scope="module")
def expected(llama_dir):
    return hf_greedy(llama_dir, PROMPTS, N)


def _stat(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'tpserve_engine{{stat="{name}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"/metrics has no tpserve_engine stat {name}")


def test_tgi_client_gets_transformers_tokens_and_metrics_count_drafts(url, expected):
    tgi = text_generation.Client(url, timeout=60)
    drafted, accepted = _stat(url, "spec_draft_tokens"), _stat(url, "spec_accepted_tokens")
    for prompt, want in zip(PROMPTS, expected, strict=True):
        res = tgi.generate(prompt, max_new_tokens=N, decoder_input_details=False)
        assert [t.id for t in res.details.tokens] == want
        streamed = list(tgi.generate_stream(prompt, max_new_tokens=N))
        assert [r.token.id for r in streamed] == want
        assert "".join(r.token.text for r in streamed) == res.generated_text
    assert _stat(url, "spec_draft_tokens") > drafted
    assert _stat(url, "spec_accepted_tokens") > accepted


def test_openai_client_greedy_text(url, expected, llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        res = oai.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0)
        assert res.choices[0].text == tok.decode(want, skip_special_tokens=True)

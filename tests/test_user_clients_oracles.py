"""Generation semantics as clients meet them, against transformers on the same checkpoint
(float32, CPU): Bloom (decoder-only, ALiBi) and T5 (encoder-decoder), each served by the real
engine in-process (tp = 1) and asked through TGI's `text_generation` client, the `openai`
client and plain httpx. Token ids, text, log-probabilities and finish reasons are compared
with transformers' `generate` and `log_softmax`, under the knobs clients set: greedy
spellings, max_new_tokens=1, repetition, frequency and presence penalties, top_k=1, near-zero
temperatures, stop sequences that span tokens, streaming with usage."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from engine_utils import served_engine
from tiny_models import family_checkpoint, save_t5_model, t5_config
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    LogitsProcessor,
)

openai = pytest.importorskip("openai")
text_generation = pytest.importorskip("text_generation")

PROMPT = "The quick brown fox"
NEW = 16


@dataclass
class Served:
    name: str
    url: str
    tok: object
    model: object
    encoder_decoder: bool

    def prompt_ids(self) -> torch.Tensor:
        return self.tok(PROMPT, return_tensors="pt").input_ids

    def generate(self, max_new_tokens: int = NEW, **kw) -> list[int]:
        """transformers' continuation of PROMPT (up to and with its EOS, where the server
        stops too)."""
        ids = self.prompt_ids()
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id, **kw)
        return out[0, 1 if self.encoder_decoder else ids.shape[1]:].tolist()

    def next_logprobs(self, generated: list[int]) -> torch.Tensor:
        """log_softmax of the model's logits at each generated position (teacher-forced)."""
        ids = self.prompt_ids()
        gen = torch.tensor([generated])
        with torch.no_grad():
            if self.encoder_decoder:
                start = torch.tensor([[self.model.config.decoder_start_token_id]])
                logits = self.model(input_ids=ids, decoder_input_ids=torch.cat(
                    [start, gen[:, :-1]], 1)).logits[0]
            else:
                logits = self.model(torch.cat([ids, gen], 1)).logits[0, ids.shape[1] - 1:-1]
        return logits.log_softmax(-1)

    def prompt_logprobs(self) -> torch.Tensor:
        ids = self.prompt_ids()
        with torch.no_grad():
            logp = self.model(ids).logits[0].log_softmax(-1)
        return logp[:-1].gather(1, ids[0, 1:, None])[:, 0]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def _checkpoint(models_dir: Path, name: str) -> Path:
    if name == "bloom":
        return family_checkpoint(models_dir, "bloom")
    out = models_dir / "t5-flan-e2e"  # test_e2e_t5's checkpoint, when it ran first
    return out if (out / "config.json").exists() else save_t5_model(t5_config(flan=True), out)


@pytest.fixture(scope="module", params=["bloom", "t5"])
def served(request, models_dir):
    path = _checkpoint(models_dir, request.param)
    encdec = request.param == "t5"
    auto = AutoModelForSeq2SeqLM if encdec else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with served_engine(path, request.param, max_model_len=128,
                       max_concurrent_requests=8) as (_, url):
        yield Served(request.param, url, tok, model, encdec)


@pytest.fixture(scope="module")
def tgi(served):
    return text_generation.Client(served.url, timeout=60)


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


class GeneratedOnly(LogitsProcessor):
    """OpenAI's frequency and presence penalties: counts of the generated tokens only (not
    the prompt's), subtracted per occurrence and once per distinct token."""

    def __init__(self, start: int, frequency: float, presence: float) -> None:
        self.start, self.frequency, self.presence = start, frequency, presence

    def __call__(self, input_ids, scores):
        for row in range(scores.shape[0]):
            counts = torch.bincount(input_ids[row, self.start:], minlength=scores.shape[1])
            scores[row] -= (self.frequency * counts[:scores.shape[1]]
                            + self.presence * (counts[:scores.shape[1]] > 0)).to(scores.dtype)
        return scores


# (TGI parameters, OpenAI parameters or None, transformers' generate kwargs)
GREEDY_SPELLINGS = [
    ({}, {"temperature": 0}, {}),
    ({"max_new_tokens": 1}, {"temperature": 0, "max_tokens": 1}, {"max_new_tokens": 1}),
    # TGI samples only for a knob off its neutral value: temperature 1.0 alone is greedy.
    ({"temperature": 1.0}, {"top_p": 0}, {}),
    ({"top_k": 1, "temperature": 0.7, "seed": 3}, {"temperature": 1e-4, "seed": 3}, {}),
    ({"repetition_penalty": 1.5}, {"temperature": 0, "extra_body": {"repetition_penalty": 1.5}},
     {"repetition_penalty": 1.5}),
    ({"repetition_penalty": 0.7}, None, {"repetition_penalty": 0.7}),
]


@pytest.mark.parametrize("tgi_kw,oai_kw,hf_kw", GREEDY_SPELLINGS,
                         ids=["greedy", "one-token", "neutral-temperature", "top-k-1",
                              "repetition", "repetition-below-1"])
def test_greedy_spellings_match_transformers(served, tgi, oai, tgi_kw, oai_kw, hf_kw):
    kw = {"max_new_tokens": NEW, **tgi_kw}
    want = served.generate(**{"max_new_tokens": kw["max_new_tokens"], **hf_kw})
    r = tgi.generate(PROMPT, **kw)
    assert [t.id for t in r.details.tokens] == want
    assert r.generated_text == served.text(want)
    assert r.details.finish_reason.value == ("eos_token" if want[-1] == served.tok.eos_token_id
                                             else "length")
    if "seed" not in tgi_kw:  # TGI reports a seed only when it sampled
        assert r.details.seed is None
    if oai_kw is not None:
        c = oai.completions.create(model="m", prompt=PROMPT, **{"max_tokens": NEW, **oai_kw})
        assert c.choices[0].text == served.text(want)
        assert c.usage.completion_tokens == len(want)


@pytest.mark.parametrize("frequency,presence", [(2.0, 0.0), (0.0, 2.0), (1.0, -0.5),
                                                (-1.0, 0.0)])
def test_openai_penalties_count_generated_tokens_only(served, oai, frequency, presence):
    start = 1 if served.encoder_decoder else served.prompt_ids().shape[1]
    want = served.generate(logits_processor=[GeneratedOnly(start, frequency, presence)])
    assert want != served.generate(), "the penalty should change the oracle's text"
    c = oai.completions.create(model="m", prompt=PROMPT, max_tokens=NEW, temperature=0,
                               frequency_penalty=frequency, presence_penalty=presence)
    assert c.choices[0].text == served.text(want)


def test_details_log_probabilities_are_transformers(served, tgi):
    """TGI's details: each token's log p, its top_n_tokens alternatives and (decoder-only)
    the prompt's log-probabilities are log_softmax of transformers' logits."""
    r = tgi.generate(PROMPT, max_new_tokens=NEW, top_n_tokens=3, decoder_input_details=True)
    ids = [t.id for t in r.details.tokens]
    assert ids == served.generate()
    logp = served.next_logprobs(ids)
    got = torch.tensor([t.logprob for t in r.details.tokens])
    torch.testing.assert_close(got, logp.gather(1, torch.tensor(ids)[:, None])[:, 0],
                               rtol=1e-4, atol=1e-4)
    alts = torch.tensor([[t.logprob for t in top] for top in r.details.top_tokens])
    torch.testing.assert_close(alts, logp.topk(3).values, rtol=1e-4, atol=1e-4)
    prefill = r.details.prefill
    assert prefill[0].logprob is None
    if served.encoder_decoder:  # the decoder's input is its start token alone
        assert [t.id for t in prefill] == [served.model.config.decoder_start_token_id]
    else:
        assert [t.id for t in prefill] == served.prompt_ids()[0].tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in prefill[1:]]),
                                   served.prompt_logprobs(), rtol=1e-4, atol=1e-4)


def _legacy_name(tok, i: int) -> str:
    """A token's name in OpenAI's legacy logprobs: its text, or for a piece of a character
    (which reads U+FFFD) its bytes with \\xNN escapes (tpserve.tokenizer.token_bytes)."""
    from tpserve.tokenizer import token_bytes

    text = tok.decode([i])
    return text if "\ufffd" not in text else \
        token_bytes(tok, i, text).decode("utf-8", "backslashreplace")


@pytest.mark.parametrize("kw", [{"temperature": 0.7, "top_p": 0.3, "seed": 5},
                                {"temperature": 0, "presence_penalty": 2.0,
                                 "frequency_penalty": 1.0},
                                {"temperature": 1.5, "seed": 9, "logit_bias": {"7": 5}}],
                         ids=["temperature-top-p", "penalties", "logit-bias"])
def test_openai_logprobs_are_the_models_whatever_the_sampling(served, oai, kw):
    """OpenAI (and vLLM) report the model's log-probabilities: temperature, top_p,
    penalties and biases change the draw, not the numbers. They were those of the
    processed distribution: tempered, or null (-inf) for alternatives top_p had cut."""
    c = oai.completions.create(model="m", prompt=PROMPT, max_tokens=8, logprobs=3, **kw)
    lp = c.choices[0].logprobs
    ids: list[int] = []
    names = [_legacy_name(served.tok, i) for i in range(served.model.config.vocab_size)]
    for text, reported, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                   strict=True):
        # The response names tokens by text only: find the id of that text whose
        # log-probability under transformers, after the ids found so far, it reports.
        logp = served.next_logprobs(ids + [0])[-1]
        named = [i for i in range(logp.shape[0]) if names[i] == text]
        best = min(named, key=lambda i: abs(float(logp[i]) - reported))
        assert reported == pytest.approx(float(logp[best]), abs=1e-4), (text, ids)
        third = float(logp.topk(3).values[-1])
        for alt, v in top.items():  # the 3 likeliest (and the token), texts may collide
            assert v is not None and (v >= third - 1e-4 or alt == text), top
            assert any(abs(float(logp[i]) - v) < 1e-4 for i in range(logp.shape[0])
                       if names[i] == alt or alt == f"token_id:{i}"), (alt, v)
        ids.append(best)
    assert len(ids) >= 4


def test_echoed_prompt_logprobs(served, oai):
    """`echo` + `logprobs` lists the prompt's own tokens first. An encoder-decoder model
    never scores its prompt (the encoder reads it): a 422 that says so, where it listed the
    decoder's start token as if it were the prompt; `echo` alone still works."""
    info = httpx.get(served.url + "/info", timeout=30).json()
    assert info["encoder_decoder"] is served.encoder_decoder
    if served.encoder_decoder:
        with pytest.raises(openai.UnprocessableEntityError) as err:
            oai.completions.create(model="m", prompt=PROMPT, max_tokens=2, logprobs=1,
                                   echo=True)
        assert "encoder-decoder model has none" in err.value.body  # our `error` string
        c = oai.completions.create(model="m", prompt=PROMPT, max_tokens=2, echo=True,
                                   temperature=0)
        assert c.choices[0].text.startswith(PROMPT)
        return
    c = oai.completions.create(model="m", prompt=PROMPT, max_tokens=2, logprobs=1,
                               echo=True, temperature=0)
    lp = c.choices[0].logprobs
    n = len(served.tok(PROMPT)["input_ids"])
    assert "".join(lp.tokens[:n]) == PROMPT and lp.token_logprobs[0] is None
    assert len(lp.tokens) == n + 2


def _stop_across_tokens(served, ids: list[int]) -> str:
    """A stop string that begins inside one generated token and ends inside a later one."""
    texts = [served.tok.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]
    for i in range(2, len(ids) - 2):
        a, b = texts[i - 1], texts[i + 1]
        if len(a) >= 1 and len(b) > len(a) + 1:
            stop = b[len(a) - 1: len(a) + 2]
            if texts[-1].find(stop) == len(a) - 1 and stop.strip():
                return stop
    pytest.skip(f"no stop string across tokens in {texts[-1]!r}")


def _sse(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def test_streams_carry_the_answers_tokens_and_stop_rules(served, tgi):
    """/generate_stream (TGI's client) and OpenAI's stream=true give the same tokens and text
    as the plain answers; TGI keeps a stop string that spans tokens, OpenAI cuts it; the last
    event carries the finish reason and details, and include_usage adds the usage chunk."""
    want = served.generate()
    stop = _stop_across_tokens(served, want)
    full = served.text(want)
    kept = full[: full.index(stop) + len(stop)]
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=NEW, stop_sequences=[stop],
                                      top_n_tokens=2))
    answer = tgi.generate(PROMPT, max_new_tokens=NEW, stop_sequences=[stop], top_n_tokens=2)
    assert [e.token.id for e in events] == [t.id for t in answer.details.tokens]
    assert events[-1].generated_text == answer.generated_text
    assert answer.generated_text.startswith(kept) and kept.endswith(stop)
    assert "".join(e.token.text for e in events) == answer.generated_text
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    last = events[-1].details
    assert (last.finish_reason.value, last.generated_tokens) == ("stop_sequence", len(events))
    assert [[t.id for t in e.top_tokens] for e in events] == \
        [[t.id for t in top] for top in answer.details.top_tokens]

    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stop": stop}
    plain = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
    assert plain["choices"][0]["text"] == full[: full.index(stop)]
    with httpx.stream("POST", served.url + "/v1/completions", timeout=60, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = _sse(r.iter_lines())
    *texts, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in texts) == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in texts][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in texts[:-1])
    assert all(c["usage"] is None for c in texts)
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]

"""huggingface_hub's InferenceClient (the client Hugging Face documents for TGI endpoints)
against the app over a real engine (the embedded default model, tp = 1 in-process): greedy
text and tokens held to transformers', streams to whole answers, and TGI's error types to
the exceptions the client raises from them."""

from __future__ import annotations

import json

import pytest
from engine_utils import served_engine
from tiny_models import hf_greedy
from transformers import AutoTokenizer

from tpserve.weights import DEFAULT_MODEL_DIR

hub = pytest.importorskip("huggingface_hub")

PROMPT = "The default value of"
NEW = 8


@pytest.fixture(scope="module")
def client():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=256,
                       max_concurrent_requests=16, block_size=16, num_blocks=256) as (_, base), \
            pytest.MonkeyPatch.context() as mp:
        # conftest sets HF_HUB_OFFLINE=1 so that nothing reaches the hub, and this client
        # refuses every request then, loopback included; it only talks to the test's server.
        mp.setattr(hub.constants, "HF_HUB_OFFLINE", False)
        yield hub.InferenceClient(base_url=base, timeout=60)


@pytest.fixture(scope="module")
def greedy():
    """transformers' greedy continuation of PROMPT: (ids, text)."""
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    ids = hf_greedy(DEFAULT_MODEL_DIR, [PROMPT], NEW)[0]
    assert len(ids) > 1  # a continuation to compare, not an immediate end
    return ids, tok.decode(ids, skip_special_tokens=True)


def test_text_generation_is_transformers_greedy(client, greedy):
    ids, text = greedy
    assert client.text_generation(PROMPT, max_new_tokens=NEW) == text
    out = client.text_generation(PROMPT, max_new_tokens=NEW, details=True)
    assert out.generated_text == text
    assert [t.id for t in out.details.tokens] == ids
    assert out.details.generated_tokens == len(ids)
    assert out.details.finish_reason in ("length", "eos_token")


def test_text_generation_stream_adds_up_to_the_whole(client, greedy):
    ids, text = greedy
    pieces = list(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True))
    assert "".join(pieces) == text
    events = list(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True,
                                         details=True))
    assert [e.token.id for e in events] == ids
    assert events[-1].generated_text == text
    # TGI's stream details carry `input_length` (the client's type requires it): the
    # prompt's tokens, after `truncate`.
    n_prompt = len(AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)(PROMPT).input_ids)
    assert events[-1].details.input_length == n_prompt
    last = list(client.text_generation(PROMPT, max_new_tokens=2, stream=True, details=True,
                                       truncate=2))[-1]
    assert last.details.input_length == min(2, n_prompt)
    assert events[-1].details.generated_tokens == len(ids)


def test_seeded_sampling_replays(client):
    kw = {"max_new_tokens": NEW, "do_sample": True, "seed": 7, "temperature": 0.8,
          "top_k": 20, "top_p": 0.9}
    assert client.text_generation(PROMPT, **kw) == client.text_generation(PROMPT, **kw)


def test_chat_completion_stream_equals_whole_and_counts_tokens(client):
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat_completion(messages, max_tokens=NEW, temperature=0)
    streamed = list(client.chat_completion(messages, max_tokens=NEW, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens <= NEW
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_grammar_constrains_text_generation(client):
    out = client.text_generation(PROMPT, max_new_tokens=12,
                                 grammar={"type": "regex", "value": "[ab]{5}"})
    assert len(out) == 5 and set(out) <= {"a", "b"}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.text_generation(PROMPT, max_new_tokens=64,
                                 grammar={"type": "json", "value": schema})
    assert isinstance(json.loads(out)["n"], int)


def test_invalid_requests_raise_the_clients_validation_error(client):
    from huggingface_hub.errors import ValidationError

    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.text_generation(PROMPT, max_new_tokens=100_000)
    # The server keeps serving.
    assert client.text_generation(PROMPT, max_new_tokens=2)

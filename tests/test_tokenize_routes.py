"""POST /tokenize (TGI's and vLLM's bodies) and POST /detokenize over the real app and an
in-process engine on the embedded default model; the oracle is transformers' tokenizer of
the same checkpoint, and the count a generation request reports for the same prompt."""

from __future__ import annotations

import httpx
import pytest
from engine_utils import served_engine
from transformers import AutoTokenizer

from tpserve.weights import DEFAULT_MODEL_DIR

TEXT = "Tokenizers split text: héllo wörld, 12345 and   spaces\n\ttabs."


@pytest.fixture(scope="module")
def url():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=256,
                       max_concurrent_requests=8, block_size=16, num_blocks=64) as (_, base):
        yield base


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=60)


def test_tgi_form_gives_ids_and_the_characters_each_covers(url, tok):
    r = post(url, "/tokenize", {"inputs": TEXT})
    assert r.status_code == 200, r.text
    toks = r.json()
    assert [t["id"] for t in toks] == tok(TEXT).input_ids
    for t in toks:
        assert set(t) == {"id", "text", "start", "stop"}
        assert t["text"] == TEXT[t["start"]:t["stop"]]
    # Offsets tile the text: each token starts where the last one stopped, or inside it
    # (byte-level pieces of one character share it), and together they cover all of it.
    covered = set()
    for t in toks:
        covered.update(range(t["start"], t["stop"]))
    assert covered == set(range(len(TEXT)))
    # The count is the one generation charges for the same prompt.
    gen = post(url, "/v1/completions", {"model": "m", "prompt": TEXT, "max_tokens": 1})
    assert gen.json()["usage"]["prompt_tokens"] == len(toks)


def test_tgi_truncate_keeps_the_last_tokens(url, tok):
    ids = tok(TEXT).input_ids
    r = post(url, "/tokenize", {"inputs": TEXT, "parameters": {"truncate": 5}})
    assert [t["id"] for t in r.json()] == ids[-5:]


def test_vllm_form_counts_and_lists(url, tok):
    r = post(url, "/tokenize", {"model": "m", "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok(TEXT).input_ids
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == 256
    bare = post(url, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok(TEXT, add_special_tokens=False).input_ids


def test_vllm_chat_form_counts_what_chat_completions_charges(url):
    """`messages` (and `tools`) rendered as /v1/chat/completions renders them: the count is
    the prompt_tokens a chat request reports for the same conversation."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": TEXT}]
    for tools in (None, [weather]):
        extra = {"tools": tools} if tools else {}
        r = post(url, "/tokenize", {"model": "m", "messages": messages, **extra})
        assert r.status_code == 200, r.text
        chat = post(url, "/v1/chat/completions", {"model": "m", "messages": messages,
                                                  "max_tokens": 1, **extra})
        assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"], tools
    with_tools = post(url, "/tokenize", {"messages": messages, "tools": [weather]}).json()
    plain = post(url, "/tokenize", {"messages": messages}).json()
    assert with_tools["count"] > plain["count"]  # the tools' description is in the prompt


@pytest.mark.parametrize("extra", [
    {"tool_choice": "required"}, {"tool_choice": "none"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_prompt": "You may call these functions, and no others:"}])
def test_vllm_chat_form_counts_the_tool_choice_and_prompt_of_the_chat(url, extra):
    """A chat request's body sent to /tokenize as it is: its `tool_choice` and `tool_prompt`
    change the prompt where tpserve describes the tools (this template has no tools of its
    own), and were ignored: `required` counted 140 tokens for a prompt of 69."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object",
                                              "properties": {"city": {"type": "string"}}}}}
    body = {"model": "m", "messages": [{"role": "user", "content": TEXT}], "tools": [weather],
            **extra}
    r = post(url, "/tokenize", body)
    assert r.status_code == 200, r.text
    chat = post(url, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    assert r.json()["count"] != post(url, "/tokenize", {**body, **dict.fromkeys(extra)}
                                     ).json()["count"]  # the field changes the prompt


def test_detokenize_round_trips(url, tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    r = post(url, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)} and r.json()["prompt"] == TEXT


BAD = [
    ("/tokenize", {"inputs": "a", "prompt": "b"}, "one of the three"),
    ("/tokenize", {"model": "m"}, "one of the three"),
    ("/tokenize", {"prompt": "a", "tools": []}, "go with `messages`"),
    ("/tokenize", {"prompt": "a", "tool_choice": "none"}, "go with `messages`"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "f"},
     "`tool_choice` needs `tools`"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                   "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"inputs": 3}, "inputs"),
    ("/tokenize", {"inputs": "a", "parameters": {"truncate": 0}}, "truncate"),
    ("/detokenize", {"tokens": [1, 2**20]}, "not in the model's vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [2**40]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
]


@pytest.mark.parametrize("route,body,fragment", BAD)
def test_bad_bodies_are_422_and_the_server_keeps_serving(url, route, body, fragment):
    r = post(url, route, body)
    assert r.status_code == 422, r.text
    assert set(r.json()) == {"error", "error_type"}
    assert fragment in r.json()["error"], r.json()["error"]
    assert post(url, "/tokenize", {"inputs": "ok"}).status_code == 200


def test_slow_tokenizer_spans_lie_end_to_end():
    """Without offsets (a Python tokenizer), pieces are laid end to end as decoded."""
    from tpserve.engine.engine import token_spans

    class Slow:
        all_special_ids = [0]

        def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
            if return_offsets_mapping:
                raise NotImplementedError
            ids = [ord(c) for c in text]
            return type("Enc", (), {"input_ids": ([0] if add_special_tokens else []) + ids})()

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    assert token_spans(Slow(), "ab") == [(0, 0, 0), (97, 0, 1), (98, 1, 2)]


def test_the_serve_ingress_tokenizes_as_the_engine(tok):
    """Several replicas behind one address (tpserve/serve/): the ingress holds the tokenizer
    and answers /tokenize itself, the same spans as a single server."""
    from serve_fakes import FakeHandle, FakeReplica

    from tpserve.engine.engine import token_spans
    from tpserve.serve.ingress import ReplicaSetBackend

    backend = ReplicaSetBackend(FakeHandle([FakeReplica("r0")]), tok, replicas=1)
    assert backend.token_spans(TEXT) == token_spans(tok, TEXT)


def test_tpserve_clients_tokenize(url, tok):
    import asyncio

    from tpserve.client import AsyncClient, Client

    with Client(url, timeout=60) as client:
        toks = client.tokenize(TEXT)
        bare = client.tokenize(TEXT, add_special_tokens=False)
    assert [t["id"] for t in toks] == tok(TEXT).input_ids
    assert [t["id"] for t in bare] == tok(TEXT, add_special_tokens=False).input_ids
    assert asyncio.run(AsyncClient(url, timeout=60).tokenize(TEXT)) == toks

"""Structured output through the real clients (text_generation's `grammar`, openai's
`response_format`), streamed and not, over the app and an in-process engine on the embedded
default model; a grammar that does not compile is a 422 and the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from engine_utils import served_engine

from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
text_generation = pytest.importorskip("text_generation")
from text_generation.types import Grammar, GrammarType  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "kind": {"enum": ["module", "class", "function"]},
    },
    "required": ["city", "year", "kind"],
    "additionalProperties": False,
    # No whitespace between tokens (llguidance's option): short answers.
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = r"(yes|no), [0-9]{1,3} items?"


@pytest.fixture(scope="module")
def url():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=256, max_concurrent_requests=16,
                       block_size=16, num_blocks=128) as (_, base):
        yield base


@pytest.fixture(scope="module")
def tgi(url):
    return text_generation.Client(url, timeout=60)


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_tgi_client_json_grammar(tgi):
    for seed, value in ((1, SCHEMA), (2, json.dumps(SCHEMA))):  # an object or JSON text
        res = tgi.generate("The answer in JSON:", max_new_tokens=60, do_sample=True,
                           seed=seed, grammar=Grammar(type=GrammarType.Json, value=value))
        jsonschema.validate(json.loads(res.generated_text), SCHEMA)
        assert res.details.finish_reason == "eos_token"
        assert res.details.tokens[-1].special  # the grammar was complete: EOS ended it


def test_tgi_client_streamed_regex_grammar(tgi):
    grammar = Grammar(type=GrammarType.Regex, value=REGEX)
    events = list(tgi.generate_stream("Are there any?", max_new_tokens=30, do_sample=True,
                                      seed=3, grammar=grammar))
    text = "".join(e.token.text for e in events if not e.token.special)
    assert re.fullmatch(REGEX, text) and events[-1].generated_text == text


def test_tgi3_json_schema_grammar(url):
    """TGI 3's grammar type {"type": "json_schema", "value": {"name", "schema"}}, on /generate
    and as the chat route's response_format (TGI 3 takes its grammar types there too)."""
    value = {"name": "place", "schema": SCHEMA}
    r = httpx.post(url + "/generate", timeout=60, json={"inputs": "JSON:", "parameters": {
        "max_new_tokens": 60, "do_sample": True, "seed": 4,
        "grammar": {"type": "json_schema", "value": value}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "A place?"}], "max_tokens": 60, "seed": 5,
        "response_format": {"type": "json_schema", "value": json.dumps(value)}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


def test_openai_chat_json_schema_and_json_object(oai):
    fmt = {"type": "json_schema",
           "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Where and when? Answer in JSON."}]
    res = oai.chat.completions.create(model="m", messages=messages, max_tokens=60, seed=4,
                                      response_format=fmt, n=2)
    for choice in res.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    res = oai.chat.completions.create(model="m", messages=messages, max_tokens=120,
                                      temperature=0, response_format={"type": "json_object"})
    choice = res.choices[0]
    assert choice.finish_reason == "length" or isinstance(
        json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


def test_openai_streamed_json_schema_with_logprobs(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    stream = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=60,
        seed=5, response_format=fmt, stream=True, logprobs=True, top_logprobs=3)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            for lp in (c.logprobs.content if c.logprobs else None) or []:
                # Over the allowed tokens: a forbidden token (log p -inf, null on the
                # wire) is never listed as an alternative.
                assert lp.logprob <= 0 and lp.top_logprobs
                assert all(t.logprob is not None for t in lp.top_logprobs)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"


def test_openai_completions_take_response_format(oai):
    res = oai.completions.create(model="m", prompt="Yes or no:", max_tokens=20, seed=6,
                                 extra_body={"response_format": {"type": "regex",
                                                                 "value": REGEX}})
    assert re.fullmatch(REGEX, res.choices[0].text)


BAD = {
    "bad_regex": ("/generate", {"inputs": "a", "parameters": {
        "grammar": {"type": "regex", "value": "a(b"}}}, "`parameters.grammar`: the regular "
        "expression does not compile"),
    "bad_schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
        "`response_format.json_schema.schema`: the JSON schema does not compile"),
    "schema_not_json": ("/generate", {"inputs": "a", "parameters": {
        "grammar": {"type": "json", "value": "{oops"}}}, "`grammar.value` is not valid JSON"),
    "json_schema_without_schema": ("/generate", {"inputs": "a", "parameters": {
        "grammar": {"type": "json_schema", "value": {"name": "x", "type": "object"}}}},
        "`grammar.value` of a json_schema grammar must be an object"),
    "unknown_format": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        "`response_format.type` must be text, json_object or json_schema (or TGI's json or "
        "regex"),
    # TGI's forms without their value were told regex and json are not types at all.
    "regex_without_value": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex"}},
        "`response_format.value` of a regex response_format must be a regular expression"),
    "json_with_null_value": ("/v1/completions", {
        "prompt": "x", "response_format": {"type": "json", "value": None}},
        "`response_format.value` of a json response_format must be a JSON schema"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_grammar_is_a_422_and_the_server_keeps_serving(url, case):
    route, body, fragment = BAD[case]
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
    assert fragment in r.json()["error"], r.json()["error"]
    ok = httpx.post(url + "/generate", json={"inputs": "a", "parameters": {
        "max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


def test_tpserve_client_grammar(url):
    from tpserve.client import Client
    from tpserve.errors import ValidationError

    with Client(url, timeout=60) as client:
        for grammar in ({"type": "regex", "value": REGEX},
                        Grammar(type=GrammarType.Regex, value=REGEX)):
            res = client.generate("Any?", max_new_tokens=30, do_sample=True, seed=8,
                                  grammar=grammar)
            assert re.fullmatch(REGEX, res.generated_text)
        with pytest.raises(ValidationError, match="`grammar.value` is not valid JSON"):
            client.generate("Any?", grammar={"type": "json", "value": "{"})  # checked here


@pytest.mark.parametrize("own_options", [False, True], ids=["plain", "own-options"])
def test_sampled_json_ends_within_max_tokens(oai, own_options):
    """Sampled from a random model, JSON under the server's whitespace rule ends (EOS) and
    validates within max_tokens, also for a schema with its own llguidance options, which
    got llguidance's unbounded whitespace and ran out of tokens inside blank space."""
    schema = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}
    if own_options:
        schema["x-guidance"] = {"lenient": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(4):
        c = oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=120,
            temperature=1.0, seed=seed, response_format=fmt).choices[0]
        assert c.finish_reason == "stop", (seed, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)

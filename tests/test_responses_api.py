"""POST /v1/responses through the real `openai` client (its strict mode: every answer and
stream event is validated against the client's own types) over an in-process engine on the
embedded default model. Oracles: the chat-completions route's greedy answer to the same
conversation, and transformers' greedy continuation of the template-rendered prompt.
Errors after a stream started are checked against the fake backend, which fails on cue."""

from __future__ import annotations

import json

import httpx
import pytest
from engine_utils import served_engine
from fake_backend import FakeBackend, serve
from tiny_models import hf_greedy
from transformers import AutoTokenizer

from tpserve.server.app import build_app
from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL_ID = "tpserve/default-model"
INSTRUCTIONS = "Answer briefly."
# The same conversation as Responses input items and as chat messages.
TURNS = [
    {"role": "user", "content": "What is Ray?"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "A framework."}]},
    {"role": "user", "content": [{"type": "input_text", "text": "And tensor "},
                                 {"type": "input_text", "text": "parallelism?"}]},
]
MESSAGES = [{"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": "What is Ray?"},
            {"role": "assistant", "content": "A framework."},
            {"role": "user", "content": "And tensor parallelism?"}]
WEATHER = {"type": "function", "name": "get_weather", "description": "A city's weather",
           "parameters": {"type": "object",
                          "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
                          "required": ["city", "days"], "additionalProperties": False},
           "strict": True}
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
          "required": ["city", "year"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
N = 8


@pytest.fixture(scope="module")
def url():
    with served_engine(DEFAULT_MODEL_DIR, MODEL_ID, max_model_len=512,
                       max_concurrent_requests=8, block_size=16, num_blocks=128) as (_, base):
        yield base


def _client(url: str):
    # Strict: the client validates every answer and event against its pydantic types.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def oai(url):
    return _client(url)


@pytest.fixture(scope="module")
def greedy_answer(oai):
    return oai.responses.create(model="m", instructions=INSTRUCTIONS, input=TURNS,
                                max_output_tokens=N, temperature=0,
                                include=["message.output_text.logprobs"])


def test_greedy_text_matches_chat_completions_and_transformers(oai, greedy_answer):
    r = greedy_answer
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_ID
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.output_tokens == N
    assert r.usage.total_tokens == r.usage.input_tokens + N
    chat = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=N,
                                       temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf_greedy(DEFAULT_MODEL_DIR, [prompt], N)[0]
    logprobs = r.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == [tok.decode([i]) for i in ids]


def test_stream_events_build_the_same_answer(oai, greedy_answer):
    events = list(oai.responses.create(model="m", instructions=INSTRUCTIONS, input=TURNS,
                                       max_output_tokens=N, temperature=0, stream=True,
                                       include=["message.output_text.logprobs"]))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = greedy_answer.output_text
    assert "".join(d.delta for d in deltas) == events[-4].text == text
    assert [lp.token for d in deltas for lp in d.logprobs] == \
        [lp.token for lp in greedy_answer.output[0].content[0].logprobs]
    final = events[-1].response
    assert final.output_text == text and final.status == "incomplete"
    assert final.id == events[0].response.id and final.usage == greedy_answer.usage
    assert {d.item_id for d in deltas} == {final.output[0].id}


def test_json_schema_format_streamed_with_the_helper_and_whole(oai):
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": SCHEMA,
                      "strict": True}}
    with oai.responses.stream(model="m", input="A city and a year, as JSON.", text=fmt,
                              max_output_tokens=60, extra_body={"seed": 3}) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    assert final.text.format.type == "json_schema" and final.text.format.name == "place"
    whole = oai.responses.create(model="m", input="Another one?", text=fmt, temperature=0.8,
                                 max_output_tokens=60, extra_body={"seed": 4})
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    obj = oai.responses.create(model="m", input="JSON please.", max_output_tokens=40,
                               text={"format": {"type": "json_object"}}, temperature=0)
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_call_arguments_follow_the_schema(oai, choice):
    r = oai.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],
                             tool_choice=choice, parallel_tool_calls=False,
                             max_output_tokens=250, extra_body={"seed": 5})
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.output_text == ""
    with oai.responses.stream(model="m", input="Weather in Oslo?", tools=[WEATHER],
                              tool_choice=choice, parallel_tool_calls=False,
                              max_output_tokens=250, extra_body={"seed": 6}) as stream:
        pieces = "".join(e.delta for e in stream
                         if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert final.output[0].arguments == pieces
    jsonschema.validate(json.loads(pieces), WEATHER["parameters"])


def test_function_call_output_turn_renders_as_chat_tool_turns(oai):
    """A function_call and its output in `input` give what chat gives for the assistant's
    tool_calls and the `tool` turn (tpserve's own tool prompt: the model's template has
    none)."""
    args = '{"city": "Paris", "days": 2}'
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 22 C"}]
    r = oai.responses.create(model="m", input=items, tools=[WEATHER], tool_choice="none",
                             max_output_tokens=N, temperature=0)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                  if k != "type"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"}]
    chat = oai.chat.completions.create(model="m", messages=messages, tools=[chat_tool],
                                       tool_choice="none", max_tokens=N, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_auto_tool_choice_text_comes_back_as_a_message_as_in_chat(oai):
    """With tools and `auto`, the answer is read for calls as chat reads it: a random model's
    text is not one, so it is a message with chat's content."""
    r = oai.responses.create(model="m", input="Weather in Lima?", tools=[WEATHER],
                             max_output_tokens=N, temperature=0)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                  if k != "type"}}
    chat = oai.chat.completions.create(model="m", tools=[chat_tool], max_tokens=N,
                                       temperature=0,
                                       messages=[{"role": "user", "content": "Weather in Lima?"}])
    assert [i.type for i in r.output] == ["message"] and r.tool_choice == "auto"
    assert r.output_text == chat.choices[0].message.content


BAD = [
    ({"previous_response_id": "resp_1"}, "`previous_response_id`"),  # not stored
    ({"conversation": "conv_1"}, "`conversation`"),
    ({"background": True}, "`background`"),
    ({"reasoning": {"effort": "high"}}, "`reasoning`"),
    ({"truncation": "auto"}, "`truncation: auto`"),
    ({"tools": [{"type": "web_search"}]}, "`tools[0].type`"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "`tools[0].name`"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "`tools[0].parameters`"),
    ({"tool_choice": {"type": "function", "name": "g"}, "tools": [WEATHER]}, "`tool_choice`"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "`tool_choice`"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
     "`text.format.schema`"),
    ({"text": {"format": {"type": "grammar"}}}, "`text.format.type`"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "`input[0].content[0].type`"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "`input[0].type`"),
    ({"input": [{"role": "tool", "content": "x"}]}, "`input[0].role`"),
    ({"max_output_tokens": 0}, "`max_output_tokens`"),
    ({"max_output_tokens": 10_000}, "`max_output_tokens`"),
    ({"input": "word " * 600}, "`input`"),
    ({"temperature": 3}, "`temperature`"),
    ({"n": 2}, "`n`"),
    ({"input": 5}, "`input`"),
]


@pytest.mark.parametrize("extra,field", BAD, ids=[f for _, f in BAD])
def test_unsupported_fields_and_bad_bodies_are_422_naming_the_field(url, extra, field):
    r = httpx.post(url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 4, **extra},
                   timeout=60)
    assert r.status_code == 422, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == "validation"
    assert field in body["error"], body


def test_accepted_no_op_fields_and_the_server_keeps_serving(oai):
    r = oai.responses.create(model="m", input="Hi", max_output_tokens=2, metadata={"k": "v"},
                             user="u", store=False, truncation="disabled", service_tier="auto",
                             include=["reasoning.encrypted_content"])
    assert r.metadata == {"k": "v"} and r.usage.output_tokens == 2


@pytest.fixture(scope="module")
def fake():
    backend = FakeBackend()
    with serve(build_app(backend)) as base:
        yield backend, base


def test_error_mid_stream_is_an_error_event_then_failed(fake):
    backend, base = fake
    backend.reset().fail_after = 2
    try:
        events = list(_client(base).responses.create(model="m", input="a b c", stream=True,
                                                     max_output_tokens=9))
    finally:
        backend.reset()
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "internal error" in events[-2].message and events[-2].code == "generation"
    assert events[-1].response.status == "failed"
    assert events[-1].response.output_text == " user: a"


def test_client_leaving_a_stream_aborts_the_generation(fake):
    backend, base = fake
    backend.reset().token_delay = 0.05
    try:
        with httpx.stream("POST", base + "/v1/responses", timeout=10, json={
                "input": "a b c d", "stream": True, "max_output_tokens": 100}) as r:
            for line in r.iter_lines():
                if "output_text.delta" in line:
                    break
        assert backend.aborted.wait(5)
    finally:
        backend.reset()

"""Tool calling through the real clients (openai's, text_generation's) against the app over an
in-process engine on the embedded default model, a random tiny model whose template knows no
tools (so tpserve describes them itself).

A random model never calls a tool of its own accord: the forced choices (a named function,
`required`) are checked by their arguments validating against the function's schema; `auto`
is checked on answers steered with a regex `response_format` into a call's text, and on
plain text that must come back as content."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from engine_utils import chat_choice, served_engine

from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
text_generation = pytest.importorskip("text_generation")
from text_generation.types import Message, Tool  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city over some days",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Steers `auto` into a Hermes call after some text (a TGI regex response_format).
STEERED = {"type": "regex", "value": 'Let me check\\. <tool_call>\\n\\{"name": "get_weather", '
           '"arguments": \\{"city": "(Paris|Oslo)", "days": [1-9]\\}\\}\\n</tool_call>'}


@pytest.fixture(scope="module")
def url():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=1024,
                       max_concurrent_requests=8, block_size=16, num_blocks=128) as (_, base):
        yield base


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_choice_returns_that_function_with_valid_arguments(oai):
    res = oai.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=80, seed=1, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, names=("get_time",))


def test_required_choice_calls_listed_functions(oai):
    res = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=250,
                                      seed=2, n=3, tool_choice="required",
                                      parallel_tool_calls=False)
    for choice in res.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


def test_streamed_call_is_rebuilt_by_the_openai_client(oai):
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 250, "temperature": 0,
          "tool_choice": "required", "parallel_tool_calls": False}
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks
              if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 1 and pieces[0].id.startswith("call_")
    assert pieces[0].function.name in SCHEMAS and pieces[0].type == "function"
    assert all(p.id is None and p.function.name is None and p.index == 0 for p in pieces[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with oai.chat.completions.stream(**kw) as stream:  # the client's own accumulation
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0].message
    rebuilt = final.tool_calls
    _check_calls(rebuilt)
    # As the whole answer's: no text (null, not ""), the role once.
    assert (final.content, final.role) == (None, "assistant")
    assert [(c.function.name, c.function.arguments) for c in rebuilt] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_text_generation_client_reads_calls_streamed_and_not(url):
    client = text_generation.Client(url, timeout=60)
    tools = [Tool(**t) for t in TOOLS]
    res = client.chat([Message(role="user", content="Weather?")], tools=tools,
                      tool_choice="get_weather", max_tokens=80, seed=3)
    (call,) = res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "tool_calls" and call["function"]["name"] == \
        "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
    # Read to the end: 0.7.0 parses every `data:` line as JSON, so its streams end without
    # the `[DONE]` that other clients get.
    chunks = list(client.chat([Message(role="user", content="Weather?")], tools=tools,
                              tool_choice="get_weather", max_tokens=80, seed=3, stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert "".join(c.function.arguments for c in calls) == call["function"]["arguments"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_out_of_the_text_and_keeps_the_rest_as_content(oai, stream):
    choice = chat_choice(oai, stream, model="m", messages=ASK, tools=TOOLS, max_tokens=80,
                         seed=4, response_format=STEERED)
    assert choice.message.content == "Let me check. " and choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, names=("get_weather",))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_text_without_a_call_is_content(oai, stream):
    fmt = {"type": "regex", "value": "(Hello|Hi) there, <tool_ok> \\{ \\[ fine"}
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 40, "seed": 5,
          "response_format": fmt, "tool_choice": "auto"}
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    else:
        choice = oai.chat.completions.create(**kw).choices[0]
        text, finish = choice.message.content, choice.finish_reason
        assert choice.message.tool_calls is None
    assert text.endswith(" there, <tool_ok> { [ fine") and finish == "stop"


def test_tool_choice_none_answers_text(oai):
    """Even text in a call's format stays text."""
    choice = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=150,
                                         seed=6, tool_choice="none",
                                         response_format=STEERED).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("Let me check. <tool_call>\n{")
    assert choice.message.content.endswith("}\n</tool_call>")


def test_a_conversation_with_calls_and_results_renders_and_generates(oai, url):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"}]
    res = oai.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=6,
                                      seed=7)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 6
    # Longer than the question alone: the call and its result are in the prompt.
    alone = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1)
    assert res.usage.prompt_tokens > alone.usage.prompt_tokens + 20
    # TGI's client: its Message has no tool_call_id; arguments as TGI 2 answered them.
    client = text_generation.Client(url, timeout=60)
    tgi_history = [Message(role="user", content="Weather?"),
                   Message(role="assistant", tool_calls=[
                       {"id": 0, "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]),
                   Message(role="tool", content="rain", name="get_weather")]
    out = client.chat(tgi_history, tools=[Tool(**t) for t in TOOLS], max_tokens=4, seed=8)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("body,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names the function `nope`, which is not in `tools`"),
    ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
    ({"tools": [WEATHER, WEATHER]}, "`get_weather` is listed twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]},
     "`tools[0].function.parameters` must be a JSON schema"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "`tools.0.type`"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "`response_format` cannot be combined"),
    ({"functions": [WEATHER["function"]]}, "`functions`"),
    # Compiled only when a call is forced: the engine names the parameters at fault.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}}}],
      "tool_choice": "f"}, "`tools[0].function.parameters`"),
])
def test_bad_tool_requests_get_422_naming_the_field(url, body, message):
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and message in r.json()["error"], r.text

@pytest.mark.parametrize("forced", ["named", "required"])
def test_streamed_call_with_logprobs_is_the_whole_answer(oai, forced):
    """With `logprobs`, the framing tokens before a forced call's first piece (`required`'s
    `[`) came in a chunk of their own whose delta was `content: ""`, opened by a chunk with
    `content: ""` too: the openai client's sum read the answer's content as "" where the
    whole answer's is null."""
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 250, "temperature": 0,
          "tool_choice": FORCED[forced][0], "parallel_tool_calls": False, "logprobs": True,
          "top_logprobs": 2, "n": 2}
    whole = oai.chat.completions.create(**kw).choices
    with oai.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices
    for w, s in zip(whole, streamed, strict=True):
        assert w.message.content is None and w.finish_reason == "tool_calls"
        assert (s.message.content, s.finish_reason) == (None, "tool_calls")
        assert [(c.function.name, c.function.arguments) for c in s.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in w.message.tool_calls]
        assert [e.token for e in s.logprobs.content] == [e.token for e in w.logprobs.content]
        assert [e.logprob for e in s.logprobs.content] == \
            pytest.approx([e.logprob for e in w.logprobs.content], abs=1e-4)


# A forced call cut by max_tokens: finish_reason "length" and the arguments as far as they
# were generated (OpenAI's answer), the same whole and streamed, on every API that returns
# calls. The oracle is the generated text itself, read from the chosen tokens' own texts
# (logprobs), not through the tool-call reader.
FORCED = {"named": ({"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "name": "get_weather"}, "get_weather"),
          "required": ("required", "required", "required")}
# `required`'s text: [{"name": ..., "arguments": <the arguments' text> ...
REQUIRED_TEXT = re.compile(r'\s*\[\s*\{\s*"name"\s*:\s*"([\w.\-]+)"\s*,\s*"arguments"\s*:\s*(.*)',
                           re.S)


def _generated(choice) -> str:
    return "".join(e.token for e in choice.logprobs.content)


def _arguments_in(text: str, forced: str) -> tuple[str, str] | None:
    """(name, arguments text) of a forced answer's text, None before its arguments start."""
    if forced == "named":
        return ("get_weather", text.lstrip()) if text.strip() else None
    m = REQUIRED_TEXT.fullmatch(text)
    return (m[1], m[2]) if m and m[2] else None


def _cut_inside_arguments(oai, forced: str) -> tuple[dict, str, str]:
    """Request keywords whose greedy answer ends (length) a few tokens into the call's
    arguments, with the function's name and those arguments as the text has them."""
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": FORCED[forced][0],
          "parallel_tool_calls": False, "temperature": 0}
    whole = oai.chat.completions.create(max_tokens=250, logprobs=True, **kw).choices[0]
    tokens = [e.token for e in whole.logprobs.content]
    start = next(i for i in range(len(tokens) + 1)
                 if _arguments_in("".join(tokens[:i]), forced))
    kw["max_tokens"] = start + 2
    assert kw["max_tokens"] < len(tokens) - 1, "the arguments must be cut"
    name, args = _arguments_in("".join(tokens[:start + 2]), forced)
    return kw, name, args


@pytest.mark.parametrize("forced", sorted(FORCED))
def test_forced_call_cut_by_max_tokens_keeps_its_partial_arguments(oai, forced):
    kw, name, args = _cut_inside_arguments(oai, forced)
    choice = oai.chat.completions.create(logprobs=True, **kw).choices[0]
    assert _arguments_in(_generated(choice), forced) == (name, args)  # same greedy tokens
    with pytest.raises(ValueError):
        json.loads(args)  # cut short
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (name, args)

    chunks = list(oai.chat.completions.create(stream=True, **kw))
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == name
    assert "".join(p.function.arguments or "" for p in pieces) == args
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("forced", sorted(FORCED))
def test_forced_call_cut_by_max_output_tokens_on_the_responses_api(oai, forced):
    kw, name, args = _cut_inside_arguments(oai, forced)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    rkw = {"model": "m", "input": ASK, "tools": tools, "tool_choice": FORCED[forced][1],
           "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": kw["max_tokens"]}
    res = oai.responses.create(**rkw)
    assert res.status == "incomplete"
    assert res.incomplete_details.reason == "max_output_tokens"
    assert [(o.name, o.arguments) for o in res.output if o.type == "function_call"] == \
        [(name, args)]
    events = list(oai.responses.create(stream=True, **rkw))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == args and done == [args]
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("forced", sorted(FORCED))
def test_forced_call_cut_short_through_the_text_generation_client(oai, url, forced):
    kw, name, args = _cut_inside_arguments(oai, forced)
    client = text_generation.Client(url, timeout=60)
    tgi = {"tools": [Tool(**t) for t in TOOLS], "tool_choice": FORCED[forced][2],
           "max_tokens": kw["max_tokens"], "temperature": 0}
    messages = [Message(**m) for m in ASK]
    res = client.chat(messages, **tgi).choices[0]
    assert res.finish_reason == "length"
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in res.message.tool_calls] == [(name, args)]
    chunks = list(client.chat(messages, stream=True, **tgi))  # read to its end: no [DONE]
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0].function.name == name
    assert "".join(c.function.arguments for c in calls) == args
    assert chunks[-1].choices[0].finish_reason == "length"

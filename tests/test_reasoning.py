"""--reasoning-parser: the splitter on texts of each form (streamed in pieces of 1, 2 and 5
characters, which must add up to the whole), and the served routes through the real `openai`
client (strict mode for the Responses API) over an in-process engine on the embedded default
model. A random model writes no `<think>` of its own: its answers are steered with a regex
`response_format` into `<think>...</think>answer` (and tool calls after it), as
tests/test_tool_calls.py steers its calls."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from engine_utils import chat_choice, served_engine
from reasoning_split import split_streamed

from tpserve.config import ServerConfig
from tpserve.engine.request import GuidedSpec
from tpserve.server.choice_reader import ChoiceReader
from tpserve.server.reasoning import (
    FORMATS,
    Reasoning,
    ReasoningSplitter,
    prompt_opens_reasoning,
    split_reasoning,
)
from tpserve.server.tool_stream import CallDelta
from tpserve.server.tools import Tool, plan_tools
from tpserve.weights import DEFAULT_MODEL_DIR

openai = pytest.importorskip("openai")

# (answer, whether the prompt opened the reasoning, reasoning, content)
CASES = [
    ("<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", False, "Let me see: 2 + 2.", "It is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("\nLet me see.\n</think>\n\nIt is 4.", True, "Let me see.", "It is 4."),
    ("Let me see. </think>", True, "Let me see.", ""),
    ("<think>cut short by the length lim", False, "cut short by the length lim", ""),
    ("<think>almost done </thi", False, "almost done </thi", ""),
    ("<think>\n\n</think>\n\nNo thinking.", False, "", "No thinking."),
    ("It is 4.", False, None, "It is 4."),
    ("  It is 4. </think> x", False, None, "  It is 4. </think> x"),
    ("<thin", False, None, "<thin"),
    ("  ", False, None, "  "),
    ("<think>a <b> </thinker> c</think>d </think> e", False, "a <b> </thinker> c",
     "d </think> e"),
    ("", True, "", ""),
]


THINK = FORMATS["think"]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_splitter_streamed_in_pieces_equals_whole(text, inside, reasoning, content):
    assert split_reasoning(text, THINK, inside) == (reasoning, content)
    for size in (1, 2, 5):
        assert split_streamed(text, THINK, inside, size) == (reasoning, content), size


def test_splitter_holds_only_what_may_be_a_tag():
    s = ReasoningSplitter(THINK, inside=False)
    assert s.feed("<th") == [] and s.feed("ink>\nab") == [Reasoning("ab")]
    assert s.feed("c \n</th") == [Reasoning("c")]  # the space may end the reasoning
    assert s.feed("ink>\n\n") == [] and s.feed("Hi") == ["Hi"]
    plain = ReasoningSplitter(THINK, inside=False)
    assert plain.feed("Hi <") == ["Hi <"]  # a plain answer streams at once


def test_prompt_that_ends_inside_the_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not prompt_opens_reasoning("assistant:", THINK)


def test_calls_are_read_after_the_reasoning_only():
    plan = plan_tools([Tool.model_validate({"type": "function", "function": {"name": "f"}})],
                      "auto", None, None)
    text = ('<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call></think>\n'
            'Calling. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    for size in (1, 2, 5, len(text)):
        reader = ChoiceReader(plan, "auto", ReasoningSplitter(THINK, inside=False))
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        out = [d for piece in pieces[:-1] for d in reader.feed(piece)]
        found, reason = reader.finish(pieces[-1], "stop")
        out += found
        assert "".join(d.text for d in out if isinstance(d, Reasoning)) == \
            'maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>'
        assert "".join(d for d in out if isinstance(d, str)) == "Calling. "
        calls = [d for d in out if isinstance(d, CallDelta)]
        assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
        assert reason == "tool_calls"


def test_flag_reaches_the_server_config():
    from tpserve.cli import apply_preset, build_parser, server_config
    from tpserve.server.reasoning import PARSERS

    def config(*argv: str) -> ServerConfig:
        return server_config(apply_preset(build_parser(), ["launch", *argv]))

    assert config().reasoning_parser == "none" == ServerConfig().reasoning_parser
    assert config("--reasoning-parser", "think").reasoning_parser == "think"
    launch = build_parser()._subparsers._group_actions[0].choices["launch"]  # noqa: SLF001
    (flag,) = [a for a in launch._actions if "--reasoning-parser" in a.option_strings]  # noqa: SLF001
    assert tuple(flag.choices) == PARSERS  # the flag offers what the module reads


# --- served -----------------------------------------------------------------------------------
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
# Steers the random model into a reasoning block, then an answer.
THINKING = {"type": "regex", "value": "<think>\\nI add (two|2) and (two|2)\\.\\n</think>\\n\\n"
            "It is (4|four)\\."}
STEERED_CALL = {"type": "regex", "value": '<think>I should check\\.</think>\\nLet me check\\. '
                '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Oslo)"'
                '\\}\\}\\n</tool_call>'}
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served():
    with served_engine(DEFAULT_MODEL_DIR, "tpserve/default-model", max_model_len=512,
                       max_concurrent_requests=8, block_size=16, num_blocks=128,
                       server=ServerConfig(reasoning_parser="think")) as (backend, base):
        yield backend, base


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0,
                         timeout=60, _strict_response_validation=True)


def _check_thinking(reasoning: str | None, content: str | None) -> None:
    assert reasoning is not None and reasoning.startswith("I add ") and reasoning.endswith(".")
    assert content in ("It is 4.", "It is four.")


def test_chat_returns_reasoning_apart_from_content(oai):
    res = oai.chat.completions.create(model="m", messages=ASK, max_tokens=60, seed=1, n=2,
                                      response_format=THINKING, logprobs=True)
    for choice in res.choices:
        msg = choice.message
        _check_thinking(msg.reasoning_content, msg.content)
        assert msg.reasoning == msg.reasoning_content  # both spellings clients read
        assert choice.finish_reason == "stop"
        # log-probabilities cover every generated token, the reasoning's too
        tokens = "".join(t.token for t in choice.logprobs.content)
        assert tokens.startswith("<think>") and tokens.endswith(msg.content)


def test_chat_stream_sends_reasoning_deltas_then_content(oai):
    kw = {"model": "m", "messages": ASK, "max_tokens": 60, "seed": 1,
          "response_format": THINKING}
    whole = oai.chat.completions.create(**kw).choices[0].message
    chunks = list(oai.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # Reasoning pieces carry both spellings; content pieces are as without the parser.
    thoughts = [getattr(d, "reasoning_content", None) for d in deltas]
    assert thoughts == [getattr(d, "reasoning", None) for d in deltas]
    kinds = ["r" if t else "c" for t, d in zip(thoughts, deltas, strict=True) if t or d.content]
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds
    assert "".join(t or "" for t in thoughts) == whole.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.content
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage is not None


def test_answer_without_reasoning_is_content_and_stop_strings_still_cut(oai):
    plain = {"type": "regex", "value": "It is (4|four)\\. Done\\."}
    res = oai.chat.completions.create(model="m", messages=ASK, max_tokens=30, seed=2,
                                      response_format=plain, stop=[" Done"])
    msg = res.choices[0].message
    assert msg.content in ("It is 4.", "It is four.") and msg.reasoning_content is None
    res = oai.chat.completions.create(model="m", messages=ASK, max_tokens=60, seed=2,
                                      response_format=THINKING, stop=["\n</think>"])
    msg = res.choices[0].message  # the stop string cut the answer inside the reasoning
    assert msg.reasoning_content.startswith("I add ") and msg.content is None


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_after_reasoning(oai, stream):
    choice = chat_choice(oai, stream, model="m", messages=ASK, tools=[WEATHER], max_tokens=80,
                         seed=3, response_format=STEERED_CALL)
    assert choice.message.content == "Let me check. " and choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "I should check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_template_that_opens_the_reasoning(served, oai, monkeypatch):
    """A prompt ending with `<think>` (DeepSeek-R1's and Qwen3-Thinking's templates): the
    answer starts inside the reasoning and only `</think>` comes."""
    backend, _ = served
    render = backend.apply_chat_template
    monkeypatch.setattr(backend, "apply_chat_template",
                        lambda *a, **kw: render(*a, **kw) + "<think>\n")
    inside = {"type": "regex", "value": "I add (two|2) and (two|2)\\.\\n</think>\\n\\n"
              "It is (4|four)\\."}
    msg = oai.chat.completions.create(model="m", messages=ASK, max_tokens=60, seed=4,
                                      response_format=inside).choices[0].message
    _check_thinking(msg.reasoning_content, msg.content)
    # A JSON-constrained answer has no room for reasoning: it is content.
    msg = oai.chat.completions.create(model="m", messages=ASK, max_tokens=60, seed=4,
                                      response_format={"type": "json_object"}
                                      ).choices[0].message
    assert msg.reasoning_content is None and msg.content.lstrip().startswith("{")


def test_completions_and_tgi_routes_keep_the_raw_text(served):
    _, url = served
    params = {"grammar": THINKING, "max_new_tokens": 60, "seed": 5, "do_sample": True}
    text = httpx.post(url + "/generate", json={"inputs": "2 + 2?", "parameters": params},
                      timeout=60).json()["generated_text"]
    assert text.startswith("<think>\nI add ") and "</think>" in text


@pytest.fixture
def steered(served, monkeypatch):
    """The Responses API takes no regex format: its requests are steered into THINKING here,
    as a regex response_format steers chat's."""
    backend, _ = served
    generate = backend.generate

    def steer(prompt, params, **kw):
        regex = GuidedSpec("regex", THINKING["value"], "response_format")
        return generate(prompt, dataclasses.replace(params, guided=regex), **kw)

    monkeypatch.setattr(backend, "generate", steer)


RESPONSE = {"model": "m", "input": "What is 2 + 2?", "max_output_tokens": 60,
            "extra_body": {"seed": 6}}


def test_responses_api_returns_a_reasoning_item(oai, steered):
    r = oai.responses.create(**RESPONSE, include=["message.output_text.logprobs"])
    assert r.status == "completed" and [i.type for i in r.output] == ["reasoning", "message"]
    thought, message = r.output
    assert thought.id.startswith("rs_") and thought.summary == [] and len(thought.content) == 1
    assert thought.content[0].type == "reasoning_text"
    _check_thinking(thought.content[0].text, r.output_text)
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    # The answer's log-probabilities are its own tokens' (the closing tag's may lead them).
    assert "".join(lp.token for lp in message.content[0].logprobs).endswith(r.output_text)
    # The output goes back as the next turn's input, reasoning item included.
    history = [{"role": "user", "content": "What is 2 + 2?"},
               *[item.model_dump(exclude_none=True) for item in r.output],
               {"role": "user", "content": "And 3 + 3?"}]
    again = oai.responses.create(model="m", input=history, max_output_tokens=60)
    assert again.status == "completed"


def test_responses_stream_events_build_the_same_answer(oai, steered):
    whole = oai.responses.create(**RESPONSE)
    events = list(oai.responses.create(**RESPONSE, stream=True))
    runs = [t for i, t in enumerate(e.type for e in events)
            if i == 0 or events[i - 1].type != t]  # each run of deltas once
    assert runs == ["response.created", "response.in_progress",
                    "response.output_item.added", "response.content_part.added",
                    "response.reasoning_text.delta", "response.reasoning_text.done",
                    "response.content_part.done", "response.output_item.done",
                    "response.output_item.added", "response.content_part.added",
                    "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.output_item.done",
                    "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == whole.output[0].content[0].text
    assert next(e for e in events if e.type == "response.reasoning_text.done").text == thought
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == whole.output_text
    assert final.usage == whole.usage
    with oai.responses.stream(**RESPONSE) as stream:  # the client's own accumulation
        for _ in stream:
            pass
        helped = stream.get_final_response()
    assert [i.type for i in helped.output] == ["reasoning", "message"]
    assert helped.output_text == whole.output_text

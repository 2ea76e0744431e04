"""Tool calling without a model: the request checks (server/tools.py), the formats of `auto`
answers (server/tool_parsers.py), the forced calls' scanner and the streamed/whole
equivalence (server/tool_stream.py), and the prompt a real tokenizer's template renders
(server/tool_prompt.py)."""

from __future__ import annotations

import json

import pytest

from tpserve.errors import ValidationError
from tpserve.server.tool_parsers import ParsedCall, parse_tool_calls
from tpserve.server.tool_prompt import render_chat
from tpserve.server.tool_stream import ChoiceTools, message_of
from tpserve.server.tools import Tool, ToolCallIn, plan_tools

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object",
                                            "properties": {"tz": {"type": "string"}}}}
NAMES = {"get_weather", "get_time"}
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')


def _tools(*fns: dict) -> list[Tool]:
    return [Tool(function=f) for f in fns]


# --- auto: the formats ---------------------------------------------------------------------

@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [PARIS]),
    ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me look. \n", [PARIS, ParsedCall("get_time", "{}")]),
    # Cut short before </tool_call> (a stop sequence, or the token was special).
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC"}}',
     None, [PARIS, ParsedCall("get_time", '{"tz": "UTC"}')]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),  # mark dropped
    # Mistral's newer form (tokenizer v11+): name[ARGS]{...} per call.
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [PARIS]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [PARIS, ParsedCall("get_time", "{}")]),
    # ... and the same with both special tokens left out of the text.
    ('get_weather{"city": "Paris"}', None, [PARIS]),
    ('get_weather {"city": "Paris"}get_time{}', None, [PARIS, ParsedCall("get_time", "{}")]),
    # Llama 3.2's pythonic list: keyword arguments, Python literals.
    ('[get_weather(city="Paris")]', None, [PARIS]),
    ("[get_weather(city='Paris'), get_time()]", None, [PARIS, ParsedCall("get_time", "{}")]),
    ('[get_time(tz=None, opts={"a": [1, 2.5, True]})]', None,
     [ParsedCall("get_time", '{"tz": null, "opts": {"a": [1, 2.5, true]}}')]),
    # Arguments written as JSON text are read as the object they hold.
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [PARIS]),
])
def test_auto_reads_each_format(text, content, calls):
    assert parse_tool_calls(text, NAMES) == (content, calls)


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"name": "delete_everything", "arguments": {}}',  # not one of the request's tools
    '{"answer": 42}',  # JSON, but not a call
    '{"name": "get_weather", "arguments": [1]}',  # arguments that are not an object
    '<tool_call>not json</tool_call> and then some text',
    'Here is JSON: {"name": "get_weather", "arguments": {}}',  # a call only at the start
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
    "<tool_c",  # a held-back partial marker that never completed
    "[get_weather(city=input())]",  # a value that is not a literal is never run
    "[get_weather('Paris')]",  # positional arguments: no names to give them
    "[os.system(cmd='ls')]",  # not a tool's bare name
    "[get_weather(city={1, 2})]",  # a set: no JSON for it
    "[delete_everything(now=True)]",  # not one of the request's tools
    "[TOOL_CALLS]get_weather[ARGS]not json",
    'get_weather{"city": "Paris"} is what I would call.',  # more than calls
    "get_weather is a tool I could use.",
    "",
])
def test_text_that_is_no_call_comes_back_whole_as_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_bad_block_stays_content_next_to_a_good_one():
    text = ('<tool_call>oops</tool_call><tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}</tool_call>')
    assert parse_tool_calls(text, NAMES) == ("<tool_call>oops</tool_call>", [PARIS])


def test_a_parser_reads_only_its_format():
    hermes = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    llama = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_tool_calls(hermes, NAMES, "llama3_json") == (hermes, [])
    assert parse_tool_calls(llama, NAMES, "hermes") == (llama, [])
    assert parse_tool_calls(llama, NAMES, "mistral") == (llama, [])  # mistral: an array
    assert parse_tool_calls(llama, NAMES, "llama3_json") == (None, [PARIS])
    pythonic = '[get_weather(city="Paris")]'
    assert parse_tool_calls(pythonic, NAMES, "pythonic") == (None, [PARIS])
    assert parse_tool_calls(pythonic, NAMES, "mistral") == (pythonic, [])
    assert parse_tool_calls(llama, NAMES, "pythonic") == (llama, [])


AUTO_TEXTS = [
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris"}}\n</tool_call>',
    '  {"name": "get_weather", "parameters": {"city": "Paris"}}',
    "Plain words with a < and a [ and <tool in them.",
    "[not a call] but text",
    '[get_weather(city="Paris")]',
    'get_weather{"city": "Paris"}',
    "get_weather is held until it is known not to be a call.",
]


@pytest.mark.parametrize("text", AUTO_TEXTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_auto_streamed_in_pieces_gives_the_whole_answer(text, step):
    plan = plan_tools(_tools(WEATHER), "auto", None, None)
    whole, whole_reason = ChoiceTools(plan, "auto").finish(text, "stop")
    out = ChoiceTools(plan, "auto")
    deltas = [d for i in range(0, len(text), step) for d in out.feed(text[i:i + step])]
    last, reason = out.finish("", "stop")
    streamed = message_of(deltas + last)
    expected = message_of(whole)
    assert streamed[0] == expected[0] and reason == whole_reason
    assert [c["function"] for c in streamed[1]] == [c["function"] for c in expected[1]]
    content, calls = parse_tool_calls(text, {"get_weather"})
    assert (expected[0], [c["function"]["name"] for c in expected[1]]) == \
        (content, [c.name for c in calls])


def test_auto_content_is_released_before_the_call_and_the_marker_held():
    out = ChoiceTools(plan_tools(_tools(WEATHER), "auto", None, None), "auto")
    assert out.feed("Hi <tool") == ["Hi "]  # `<tool` may open a call: held
    assert out.feed("_call>{") == []
    deltas, reason = out.finish('"name": "get_weather", "arguments": {}}</tool_call>', "stop")
    (call,) = deltas
    assert (call.name, call.arguments, reason) == ("get_weather", "{}", "tool_calls")
    assert call.id.startswith("call_")


# --- forced calls ----------------------------------------------------------------------------

REQUIRED = ('[{"name": "get_weather", "arguments": {"city": "P\\"a}r[is"}},\n'
            ' {"name":"get_time","arguments":{"tz":"UTC"}}]')


@pytest.mark.parametrize("step", [1, 3, 8, len(REQUIRED)])
def test_required_calls_stream_name_first_then_arguments(step):
    plan = plan_tools(_tools(WEATHER, TIME), "required", None, None)
    out = ChoiceTools(plan, "auto")
    deltas = [d for i in range(0, len(REQUIRED), step) for d in out.feed(REQUIRED[i:i + step])]
    last, reason = out.finish("", "stop")
    deltas += last
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in firsts] == [(0, "get_weather"), (1, "get_time")]
    assert all(d.name is None for d in deltas if d.id is None)
    content, calls = message_of(deltas)
    assert content is None and reason == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == \
        [{"city": 'P"a}r[is'}, {"tz": "UTC"}]


def test_a_forced_call_cut_short_keeps_what_it_has():
    plan = plan_tools(_tools(WEATHER, TIME), "required", None, None)
    cut = '[{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = message_of(ChoiceTools(plan, "auto").finish(cut, "length")[0])
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Pa'
    before_name = '[{"name": "get_w'
    deltas, reason = ChoiceTools(plan, "auto").finish(before_name, "length")
    assert message_of(deltas) == (before_name, []) and reason == "length"


def test_named_call_is_its_arguments_text():
    plan = plan_tools(_tools(WEATHER, TIME), {"type": "function",
                                              "function": {"name": "get_time"}}, None, None)
    out = ChoiceTools(plan, "auto")
    deltas = out.feed(" \n") + out.feed('{"tz"') + out.finish(': "UTC"}', "stop")[0]
    (call,) = message_of(deltas)[1]
    assert call["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}


def test_forced_plans_constrain_to_the_schemas():
    plan = plan_tools(_tools(WEATHER, TIME), "get_weather", None, None)  # TGI: a bare name
    assert plan.mode == "named" and json.loads(plan.guided.value) == \
        {**WEATHER["parameters"], "type": "object"}
    plan = plan_tools(_tools(WEATHER, TIME), "required", False, None)
    schema = json.loads(plan.guided.value)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == \
        [{"const": "get_weather"}, {"const": "get_time"}]
    assert plan_tools(_tools(WEATHER), "auto", None, None).guided is None
    assert plan_tools(_tools(WEATHER), None, None, None).mode == "auto"
    assert plan_tools(None, "none", None, None) is None


@pytest.mark.parametrize("tools,choice,message", [
    ([], "required", "`tool_choice` needs `tools`"),
    ([WEATHER], "get_time", "`get_time`, which is not in `tools` (functions: get_weather)"),
    ([WEATHER], {"type": "function", "function": {"name": "x"}}, "not in `tools`"),
    ([WEATHER], {"type": "allowed_tools"}, "`tool_choice` must be"),
    ([WEATHER], 3, "`tool_choice` must be"),
    ([WEATHER, WEATHER], "auto", "`tools[1].function.name`: `get_weather` is listed twice"),
    ([{"name": "a b"}], "auto", "`tools[0].function.name` must be 1 to 64 letters"),
    ([{"name": "f", "parameters": "a string"}], "auto",
     "`tools[0].function.parameters` must be a JSON schema"),
    ([{"name": "f", "parameters": {"type": "array"}}], "auto", "must describe a JSON object"),
    ([{"name": "f", "parameters": {"properties": {"a": {"type": "text"}}}}], "auto",
     "`tools[0].function.parameters.properties.a.type` must be one of"),
    ([{"name": "f", "parameters": {"properties": [1]}}], "auto", ".properties` must map"),
    ([{"name": "f", "parameters": {"required": "a"}}], "auto", ".required` must be a list"),
])
def test_bad_tool_requests_are_refused_naming_the_field(tools, choice, message):
    with pytest.raises(ValidationError) as err:
        plan_tools(_tools(*tools), choice, None, None)
    assert message in str(err.value)


def test_assistant_calls_reach_templates_with_object_arguments():
    call = ToolCallIn(id=3, function={"name": "f", "arguments": '{"a": 1}'})
    assert call.for_template() == {"type": "function", "id": "3",
                                   "function": {"name": "f", "arguments": {"a": 1}}}
    odd = ToolCallIn(function={"name": "f", "arguments": "not json"})
    assert odd.for_template()["function"]["arguments"] == "not json"


# --- the prompt ------------------------------------------------------------------------------

# A Hermes-style template that renders tools and tool turns itself.
HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}<|assistant|>")
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}"
             "{{ raise_exception('System role not supported') }}{% endif %}"
             "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [ToolCallIn(
        id="call_1", function={"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ).for_template()]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tpserve.weights import DEFAULT_MODEL_DIR

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def _renderer(tokenizer, template: str):
    def render(messages, tools=None):  # as AsyncEngine.apply_chat_template calls it
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True,
                                                 chat_template=template)
        except Exception as exc:
            raise ValidationError(f"chat template failed: {exc}") from exc
    return render


def test_a_template_with_tools_renders_them_itself(tokenizer):
    plan = plan_tools(_tools(WEATHER), "auto", None, None)
    prompt = render_chat(_renderer(tokenizer, HERMES), CONVERSATION, plan)
    assert prompt.startswith("<tools>get_weather;</tools>")
    assert '<tool_call>{"city": "Paris"}</tool_call>' in prompt  # an object, written once
    assert "<|tool|>sunny" in prompt and "<tool_response>" not in prompt


def test_a_template_without_tools_gets_them_in_a_system_turn(tokenizer):
    plan = plan_tools(_tools(WEATHER), "auto", None, None)
    prompt = render_chat(_renderer(tokenizer, tokenizer.chat_template), CONVERSATION, plan)
    assert prompt.startswith("system: You can call the functions")
    assert json.dumps(WEATHER["parameters"]) in prompt and "<tool_call>" in prompt
    # The history as text: the call in the assistant's turn, both results in one user turn.
    assert 'assistant: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'\
        in prompt
    assert "user: <tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C" in prompt
    custom = render_chat(_renderer(tokenizer, tokenizer.chat_template), CONVERSATION[:1],
                         plan, "TOOLS:")
    assert custom.startswith("system: TOOLS:\n<tools>")
    forced = render_chat(_renderer(tokenizer, tokenizer.chat_template), CONVERSATION[:1],
                         plan_tools(_tools(WEATHER), "required", None, None))
    assert "<tools>" in forced and "<tool_call>" not in forced  # constrained: no format
    none = render_chat(_renderer(tokenizer, tokenizer.chat_template), CONVERSATION[:1],
                       plan_tools(_tools(WEATHER), "none", None, None))
    assert none == "user: Weather in Paris?\nassistant:"


def test_a_template_refusing_system_turns_gets_the_tools_in_the_first_user_turn(tokenizer):
    plan = plan_tools(_tools(WEATHER), "auto", None, None)
    prompt = render_chat(_renderer(tokenizer, NO_SYSTEM), CONVERSATION[:1], plan)
    assert prompt.startswith("user: You can call the functions") and "Weather in Paris?" in prompt


# Mistral's templates check call ids: 9 letters and digits, or they raise.
NINE_IDS = ("{% for m in messages %}"
            "{% for c in m.tool_calls or [] %}{% if c.id | length != 9 %}"
            "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
            "{% endif %}[CALL {{ c.id }}]{% endfor %}"
            "{% if m.tool_call_id %}[RESULT {{ m.tool_call_id }}]{% endif %}"
            "{{ m.content }}\n{% endfor %}{% if tools %}[TOOLS]{% endif %}")


def test_call_ids_are_shortened_for_a_template_that_checks_them(tokenizer):
    plan = plan_tools(_tools(WEATHER), "auto", None, None)
    prompt = render_chat(_renderer(tokenizer, NINE_IDS), CONVERSATION, plan)
    call = prompt.split("[CALL ")[1][:9]
    assert len(call) == 9 and call.isalnum()
    assert prompt.count(f"[RESULT {call}]") == 2  # the results still name their call
    assert prompt.endswith("[TOOLS]")  # the template's own tool rendering, not the stand-in
    # The same id maps to the same short id every turn (a prefix the cache can reuse).
    assert render_chat(_renderer(tokenizer, NINE_IDS), CONVERSATION, plan) == prompt
    # Ids a template accepts are sent as they are.
    loose = NINE_IDS.replace("c.id | length != 9", "false")
    assert "[CALL call_1]" in render_chat(_renderer(tokenizer, loose), CONVERSATION, plan)

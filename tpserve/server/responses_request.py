"""The request body of POST /v1/responses (OpenAI's Responses API), checked and translated
into the chat request that /v1/chat/completions serves (server/openai.py), so both routes
share rendering, sampling, structured output and tool calling.

The translation: `instructions` becomes a first system message; input messages keep their
role (`developer` is read as `system`, which is what it means to OpenAI's models and what
chat templates know); `function_call` items become the `tool_calls` of an assistant turn
(joined to the assistant message right before them: one turn that wrote text, then
called), `function_call_output` items `tool` turns. Flat function tools
({"type": "function", "name", ...}) become chat's nested ones; `text.format` becomes
`response_format`.

A field whose meaning tpserve cannot honour is refused with a 422 that names it; unknown
fields too (the openai client sends only what it is given, so an unknown field is one a
user asked for). Fields that change nothing about the answer (`metadata`, `user`, `store`,
`service_tier`, ...) are accepted.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tpserve.errors import ValidationError
from tpserve.fields import (
    FailFast,
    FrequencyPenalty,
    Int,
    LogitBiasMap,
    NonEmptyText,
    NullableFlag,
    OpenAISeed,
    OpenAITemperature,
    OpenAITopP,
    RepetitionPenalty,
    StopText,
    Text,
    TokenCount,
    unsupported,
)
from tpserve.server.openai import ChatMessage, ChatRequest
from tpserve.server.tools import FunctionCallIn, FunctionDef, Tool, ToolCallIn
from tpserve.structured import response_format_spec

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def in_responses_terms(message: str) -> str:
    """A message of the chat machinery in this API's field names."""
    message = re.sub(r"`tools\[(\d+)\]\.function\.", r"`tools[\1].", message)
    for chat, ours in (("`tool_choice.function.name`", "`tool_choice.name`"),
                       ("`response_format.json_schema.schema", "`text.format.schema"),
                       ("`response_format", "`text.format"), ("`messages`", "`input`"),
                       ("`max_completion_tokens`", "`max_output_tokens`")):
        message = message.replace(chat, ours)
    return message


def chat_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` ({"type": "json_schema", "name", "schema", "strict"} is flat here) as
    chat's `response_format`."""
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        for key in ("name", "schema"):  # required by OpenAI, and by its client's echo
            if key not in fmt:
                raise ValueError(f"`text.format.{key}` is required with type json_schema")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise ValueError(f"`text.format.type` must be text, json_object or json_schema "
                     f"(got {fmt.get('type')!r})")


def _checked_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    try:
        response_format_spec(chat_format(fmt))
    except ValueError as exc:
        raise ValueError(in_responses_terms(str(exc))) from None
    return fmt


class TextConfig(BaseModel):
    format: Annotated[dict[str, Any] | None, AfterValidator(_checked_format)] = None
    # A hint to OpenAI's own models; the default is the only one tpserve can keep.
    verbosity: Annotated[Literal["low", "medium", "high"] | None, unsupported(
        "`text.verbosity` other than medium (it steers the length of OpenAI's own models' "
        "answers; ask for brevity in `instructions`)", allowed="medium")] = None


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are served (checked in to_chat)."""

    model_config = ConfigDict(extra="ignore")  # annotations, logprobs of earlier outputs
    type: Text
    text: Text | None = None
    refusal: Text | None = None


Content = Text | Annotated[list[ContentPart], FailFast]


class InputItem(BaseModel):
    """One item of `input`: a message (the default type), a `function_call` the model made
    earlier, or a `function_call_output` answering it. Ids and statuses of earlier output
    items are accepted and not needed."""

    model_config = ConfigDict(extra="ignore")
    type: Text = "message"
    role: Text | None = None
    content: Content | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Content | None = None


class FunctionTool(BaseModel):
    """A Responses function tool (flat); other types are built-in tools, refused in to_chat."""

    model_config = ConfigDict(extra="ignore")
    type: Text
    name: Text | None = None
    description: Text | None = None
    parameters: Any = None
    strict: bool | None = None


def _no_reasoning(v: Any) -> Any:
    if isinstance(v, dict) and v.get("effort") in (None, "none") and not v.get("summary"):
        return v
    if v is None:
        return v
    raise ValueError("`reasoning` (effort or summaries) is not supported by tpserve: its "
                     "models answer without a reasoning budget; drop `reasoning`")


def _unstored(field: str) -> Any:
    return unsupported(f"`{field}` (tpserve stores no responses or conversations: send the "
                       "whole conversation in `input`)")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    model: Text | None = None
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1, fail_fast=True)]
    instructions: Text | None = None
    max_output_tokens: TokenCount | None = None
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    stream: NullableFlag = False
    stream_options: dict[str, bool | None] | None = None  # include_obfuscation: no padding sent
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], FailFast] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    include: Annotated[list[Text], FailFast] | None = None
    metadata: Annotated[dict[Text, Text], Field(max_length=16)] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None  # tpserve's prefix cache needs no key
    store: bool | None = None  # nothing is stored either way
    service_tier: Text | None = None
    max_tool_calls: Annotated[Int, Field(ge=1)] | None = None  # counts built-in tools only
    truncation: Annotated[Literal["auto", "disabled"] | None, unsupported(
        "`truncation: auto` (dropping the start of the conversation to fit the context)",
        allowed="disabled")] = None
    reasoning: Annotated[dict[str, Any] | None, AfterValidator(_no_reasoning)] = None
    previous_response_id: Annotated[Text | None, _unstored("previous_response_id")] = None
    conversation: Annotated[Any, _unstored("conversation")] = None
    background: Annotated[bool | None, unsupported(
        "`background` (run the request in the background and poll; stream instead)")] = None
    prompt: Annotated[Any, unsupported(
        "`prompt` (stored prompt templates; send the text in `instructions` and `input`)")
    ] = None
    # tpserve's extensions, as on /v1/chat/completions (the openai client sends them in
    # `extra_body`).
    seed: OpenAISeed | None = None
    stop: StopText | Annotated[list[StopText], FailFast] | None = None
    frequency_penalty: FrequencyPenalty | None = None
    presence_penalty: FrequencyPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBiasMap | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(f"`{str(unknown[0])[:64]}` is not a field that tpserve's "
                                 "Responses API serves (its documentation lists them): "
                                 "remove it")
        return data

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def text_format(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        return fmt or {"type": "text"}

    def to_chat(self) -> ChatRequest:
        """The chat request that serves this one; ValidationError (422) for input it
        cannot carry (images, files, built-in tools, reasoning items)."""
        messages = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        items = ([InputItem(role="user", content=self.input)] if isinstance(self.input, str)
                 else self.input)
        for i, item in enumerate(items):
            _add_item(messages, item, f"input[{i}]")
        return ChatRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            user=self.user, response_format=chat_format(self.text_format()),
            tools=_chat_tools(self.tools), tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls, logprobs=self.wants_logprobs(),
            top_logprobs=self.top_logprobs)


def _text(content: Content | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            texts.append(part.text or "")
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        else:
            raise ValidationError(f"`{where}[{j}].type` is {part.type[:40]!r}: tpserve serves "
                                  "text models and takes only text parts (input_text, "
                                  "output_text)")
    return "".join(texts)


def _add_item(messages: list[ChatMessage], item: InputItem, where: str) -> None:
    if item.type == "message":
        role = _ROLES.get(item.role or "")
        if role is None:
            raise ValidationError(f"`{where}.role` must be user, assistant, system or "
                                  f"developer (got {item.role!r})")
        messages.append(ChatMessage(role=role, content=_text(item.content, f"{where}.content")))
    elif item.type == "function_call":
        if item.call_id is None or item.name is None:
            raise ValidationError(f"`{where}`: a function_call needs `call_id` and `name`")
        call = ToolCallIn(id=item.call_id, function=FunctionCallIn(
            name=item.name, arguments=item.arguments or "{}"))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":  # the same turn: text, then calls
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif item.type == "function_call_output":
        if item.call_id is None:
            raise ValidationError(f"`{where}.call_id` is required: the call this output "
                                  "answers")
        messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                    content=_text(item.output, f"{where}.output")))
    else:
        raise ValidationError(f"`{where}.type` {item.type[:40]!r} is not supported by tpserve: "
                              "input items are messages, function_call and "
                              "function_call_output (it makes no reasoning items and runs no "
                              "built-in tools; item references need stored responses)")


def _chat_tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ValidationError(f"`tools[{i}].type` {tool.type[:40]!r} is not supported: "
                                  "tpserve runs no built-in tools; describe a function tool "
                                  "and run it in your code")
        if tool.name is None:
            raise ValidationError(f"`tools[{i}].name` is required (function tools are flat "
                                  'here: {"type": "function", "name", "parameters"}, not '
                                  "nested under `function` as in chat completions)")
        out.append(Tool(function=FunctionDef(name=tool.name, description=tool.description,
                                             parameters=tool.parameters, strict=tool.strict)))
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """`tool_choice` in chat's spelling: {"type": "function", "name": f} is flat here."""
    if choice is None or isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise ValidationError('`tool_choice` must be "none", "auto", "required" or {"type": '
                          '"function", "name": ...}' + (f" (tool choice type {kind!r} is not "
                                                        "supported)" if kind else ""))

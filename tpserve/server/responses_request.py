"""The request body of POST /v1/responses (OpenAI's Responses API), checked and translated
into the chat request that /v1/chat/completions serves (server/openai.py), so both routes
share rendering, sampling, structured output and tool calling.

The translation: `instructions` becomes a first system message, the input items chat
turns (server/responses_items.py), flat function tools chat's nested ones, and
`text.format` chat's `response_format`.

A field whose meaning tpserve cannot honour is refused with a 422 that names it; unknown
fields too (the openai client sends only what it is given, so an unknown field is one a
user asked for). Fields that change nothing about the answer (`metadata`, `user`,
`service_tier`, ...) are accepted. `store` and `previous_response_id` are served by the
response store (server/responses_store.py), in server/responses.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

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
from tpserve.server.openai import ChatMessage, ChatRequest, check_stream_options
from tpserve.server.responses_items import (
    FunctionTool,
    InputItem,
    add_item,
    chat_tool_choice,
    chat_tools,
)
from tpserve.structured import response_format_spec

LOGPROBS_INCLUDE = "message.output_text.logprobs"


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


def _no_reasoning(v: Any) -> Any:
    if isinstance(v, dict) and v.get("effort") in (None, "none") and not v.get("summary"):
        return v
    if v is None:
        return v
    raise ValueError("`reasoning` (effort or summaries) is not supported by tpserve: its "
                     "models answer without a reasoning budget; drop `reasoning`")


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
    # None: stored, OpenAI's default (server/responses_store.py keeps it in memory).
    store: bool | None = None
    service_tier: Text | None = None
    max_tool_calls: Annotated[Int, Field(ge=1)] | None = None  # counts built-in tools only
    truncation: Annotated[Literal["auto", "disabled"] | None, unsupported(
        "`truncation: auto` (dropping the start of the conversation to fit the context)",
        allowed="disabled")] = None
    reasoning: Annotated[dict[str, Any] | None, AfterValidator(_no_reasoning)] = None
    previous_response_id: Text | None = None  # looked up in the store (server/responses.py)
    conversation: Annotated[Any, unsupported(
        "`conversation` (OpenAI's Conversations API; continue a stored response with "
        "`previous_response_id`, or send the whole conversation in `input`)")] = None
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

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> ResponsesRequest:
        # As on /v1/chat/completions: options of a stream sent without one were ignored.
        check_stream_options(self.stream_options, self.stream)
        return self

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def text_format(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        return fmt or {"type": "text"}

    def input_items(self) -> list[InputItem]:
        """`input` as items: a string is one user message."""
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return self.input

    def to_chat(self, reasoning_items: bool = False,
                earlier: Sequence[InputItem] = ()) -> ChatRequest:
        """The chat request that serves this one, after the `earlier` items of a stored
        conversation (`previous_response_id`; its instructions are not carried over, as in
        OpenAI's API). ValidationError (422) for input it cannot carry (images, files,
        built-in tools, and reasoning items unless `reasoning_items`: this server makes
        them, and they are dropped)."""
        messages = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        for i, item in enumerate(earlier):
            add_item(messages, item, f"previous_response_id's input[{i}]", reasoning_items)
        for i, item in enumerate(self.input_items()):
            add_item(messages, item, f"input[{i}]", reasoning_items)
        return ChatRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            user=self.user, response_format=chat_format(self.text_format()),
            tools=chat_tools(self.tools), tool_choice=chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls, logprobs=self.wants_logprobs(),
            top_logprobs=self.top_logprobs)

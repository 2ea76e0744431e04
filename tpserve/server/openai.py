"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

`n` choices per prompt (and a list of prompts for completions) run as that many engine
requests side by side; completions' `best_of` runs that many candidates per prompt and
answers the n best (server/best_of.py); `logprobs` come in OpenAI's two formats
(server/openai_logprobs.py).
Errors keep TGI's body shape
(`{"error", "error_type"}`, 422 for validation) so one client error path serves both APIs.
Chunks also carry the keys text_generation's chat types require (system_fingerprint,
delta.role, delta.tool_calls), so TGI's client can read them. Tool calling (`tools`,
`tool_choice`) is planned in server/tools.py, rendered in server/tool_prompt.py and read
back out of the text in server/tool_stream.py; with --reasoning-parser, a thinking model's
reasoning is split from the answer first (server/reasoning.py, server/choice_reader.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal, NamedTuple

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams, TokenInfo
from tpserve.errors import NotReadyError, ValidationError
from tpserve.fields import (
    I32_MAX,
    U64_MAX,
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
    TokenId,
    unsupported,
)
from tpserve.lora_config import select_adapter
from tpserve.server.backend import EngineBackend, not_ready_message
from tpserve.server.best_of import best_of_each, candidate_jobs, completion_candidates
from tpserve.server.choice_reader import ChoiceReader, reasoning_of
from tpserve.server.errors import error_body
from tpserve.server.fanout import check_fanout, open_all
from tpserve.server.metrics import Metrics, TrackedStream
from tpserve.server.openai_logprobs import CompletionLogprobs, chat_logprobs
from tpserve.server.prompt_only import PromptOnly, prompt_only_params
from tpserve.server.reasoning import ReasoningSplitter, prompt_opens_reasoning
from tpserve.server.reasoning_format import ReasoningFormat, ReasoningParser
from tpserve.server.streaming import (
    AnswerResponse,
    EventStreamResponse,
    collect_all_or_abort,
    final_text,
    merged,
    sse,
)
from tpserve.server.tool_prompt import render_chat
from tpserve.server.tool_stream import message_of, wire_delta
from tpserve.server.tools import Tool, ToolCallIn, ToolPlan, plan_tools
from tpserve.structured import response_format_spec

_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
# Conversations longer than this (characters) are rendered off the event loop.
INLINE_RENDER_CHARS = 8192


class StreamOptions(BaseModel):
    include_usage: bool = False


def _checked_format(v: dict[str, Any] | None) -> dict[str, Any] | None:
    response_format_spec(v)  # a ValueError naming the field is a 422
    return v


def check_stream_options(stream_options: object, stream: bool | None) -> None:
    """ValueError (a 422) for stream options sent without a stream."""
    if stream_options is not None and not stream:
        raise ValueError("`stream_options` needs `stream: true`: it shapes a streamed "
                         "answer only. Set `stream` to true or leave `stream_options` out")


class _Sampling(BaseModel):
    """Fields shared by both endpoints, with OpenAI's ranges."""

    model_config = ConfigDict(allow_inf_nan=False)

    model: Text | None = None
    max_tokens: TokenCount | None = None
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    seed: OpenAISeed | None = None
    stop: StopText | Annotated[list[StopText], FailFast] | None = None
    stream: NullableFlag = False
    stream_options: StreamOptions | None = None
    # Choices per prompt: each is its own engine request (seeded ones get seed + i).
    n: Annotated[Int, Field(ge=1)] | None = None
    frequency_penalty: FrequencyPenalty | None = None
    presence_penalty: FrequencyPenalty | None = None  # OpenAI's range, -2 to 2
    # TGI's extension, sent by text_generation.Client.chat.
    repetition_penalty: RepetitionPenalty | None = None
    # {"token id": bias}; the engine checks the ids against the model's vocabulary.
    logit_bias: LogitBiasMap | None = None
    user: Text | None = None
    # Structured output: json_object, json_schema (tpserve/structured.py); text or null:
    # free text.
    response_format: Annotated[dict[str, Any] | None, AfterValidator(_checked_format)] = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _Sampling:
        # OpenAI and vLLM refuse them too: include_usage asks for a chunk that a plain
        # answer never sends, and a client expecting it would wait for nothing.
        check_stream_options(self.stream_options, self.stream)
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def choices(self) -> int:
        return self.n or 1

    def adapter(self, info: ModelInfo) -> str | None:
        """The LoRA adapter `model` names (None: the base model)."""
        try:
            return select_adapter(self.model, info.model_id, info.adapters)
        except ValueError as exc:
            raise ValidationError(f"`model`: {exc}") from None

    def sampling_params(self, info: ModelInfo, max_new_tokens: int, top_n: int = 0,
                        prompt_logprobs: bool = False) -> SamplingParams:
        stop = self.stop_list()
        if len(stop) > info.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {info.max_stop_sequences} sequences (got {len(stop)})"
            )
        common = {
            "max_new_tokens": max_new_tokens,
            "seed": None if self.seed is None else self.seed % (U64_MAX + 1),
            "stop": tuple(stop),
            "frequency_penalty": self.frequency_penalty or None,
            "presence_penalty": self.presence_penalty or None,
            "logit_bias": tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()
                                if v),
            "repetition_penalty": self.repetition_penalty,
            # OpenAI never returns the stop sequence; the engine's output processor cuts it
            # (and holds back streamed text that could be its start).
            "include_stop_str_in_output": False,
            "top_n_tokens": top_n,
            "prompt_logprobs": prompt_logprobs,
            # OpenAI's log-probabilities (and vLLM's) are the model's, whatever the
            # temperature, top_p, penalties or biases: the same numbers as at temperature 0.
            "raw_logprobs": True,
            "guided": response_format_spec(self.response_format),
            "adapter": self.adapter(info),
        }
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        # OpenAI's spellings of greedy decoding: temperature 0, or top_p 0 (only the likeliest
        # token is kept).
        if temperature == 0 or self.top_p == 0:
            return SamplingParams(do_sample=False, **common)
        # top_p == 1 keeps every token, which the engine spells as "no top_p".
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else None
        return SamplingParams(do_sample=True, temperature=temperature, top_p=top_p, **common)


TokenIds = Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]


class CompletionRequest(_Sampling):
    # A string, a token-id list (used as it is: nothing is added, as lm-eval's requests
    # expect), or a list of either (one set of choices each).
    prompt: (NonEmptyText | TokenIds
             | Annotated[list[NonEmptyText], Field(min_length=1, fail_fast=True)]
             | Annotated[list[TokenIds], Field(min_length=1, fail_fast=True)])
    # 0 only with `echo`: the prompt alone (server/prompt_only.py).
    max_tokens: Annotated[Int, Field(ge=0, le=I32_MAX)] | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: NullableFlag = False
    # The k likeliest alternatives per token (and the chosen one) in the legacy format.
    logprobs: Annotated[Int, Field(ge=0)] | None = None
    # Candidates per prompt, of which the `n` best are answered (server/best_of.py).
    best_of: Annotated[Int, Field(ge=1)] | None = None
    suffix: Annotated[Text | None, unsupported("`suffix` (insertion)")] = None

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text | None = None


def _text_parts_only(content: Any) -> Any:
    """Refuses a content part that is not text (image_url, input_audio, file) by its type,
    before pydantic tries the union and reports only "Input should be 'text'"."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"has a part of type {kind[:40]!r} (content[{j}]): tpserve serves text "
                    "in, text out, also for a vision-language model; images, audio and files "
                    "are not served. Send the content as a string or as parts of type \"text\"")
    return content


class ChatMessage(BaseModel):
    role: Text
    content: Annotated[Text | Annotated[list[ContentPart], FailFast] | None,
                       BeforeValidator(_text_parts_only)] = None
    name: Text | None = None
    # An assistant turn's calls (content may be null) and a `tool` turn's answer to one.
    tool_calls: Annotated[list[ToolCallIn], FailFast] | None = None
    tool_call_id: Text | None = None

    def as_template_input(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            content = "".join(part.text or "" for part in self.content)
        else:
            content = self.content or ""
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


def _completions_only(best_of: int) -> int:
    if best_of > 1:
        raise ValueError("ranks candidates on /v1/completions only: on /v1/chat/completions "
                         "send `n` for several choices, or leave `best_of` out")
    return best_of


# Every field text_generation 0.7.0's ChatRequest writes: its client sends them all, nulls
# included, and no other client does by default. Its stream parser wants `delta.tool_calls`
# as one object (TGI 2's format), where OpenAI's clients want a list.
TGI_CLIENT_FIELDS = frozenset({
    "model", "messages", "repetition_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "max_tokens", "n", "presence_penalty", "stream", "seed", "temperature",
    "top_p", "tools", "tool_choice"})


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=20)] | None = None
    # Function calling (server/tools.py): OpenAI's tool objects; tool_choice "none", "auto",
    # "required", {"type": "function", "function": {"name": ...}} or TGI's bare name.
    tools: Annotated[list[Tool], FailFast] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # TGI's: the text before the tool list where tpserve describes the tools itself.
    tool_prompt: Text | None = None
    functions: Annotated[Any, unsupported(
        "`functions` (OpenAI's deprecated form of `tools`; send `tools`)")] = None
    function_call: Annotated[Any, unsupported(
        "`function_call` (OpenAI's deprecated form of `tool_choice`; send `tool_choice`)")] = None
    # A completions field, which chat clients (vLLM's extra body) sometimes send: ignored,
    # it would answer one plain sample where the client asked for the best of several.
    best_of: Annotated[Int, Field(ge=1), AfterValidator(_completions_only)] | None = None

    def from_tgi_client(self) -> bool:
        return TGI_CLIENT_FIELDS <= self.model_fields_set


def last_piece(final: GenerationEvent, streamed: str) -> str:
    """What the final chunk carries so that the streamed pieces add up to the final text."""
    text = final.generated_text
    if text is not None and text.startswith(streamed):
        return text[len(streamed):]
    return "" if final.token.special else final.token.text


def _usage(finals: Sequence[GenerationEvent], n: int) -> dict[str, int]:
    """Usage of a request's sequences (n per prompt, prompts in order): each prompt counted
    once, every sequence's tokens (every `best_of` candidate's, as OpenAI bills them)."""
    prompt = sum(f.prompt_tokens for f in finals[::n])
    completion = sum(f.generated_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _check_top(what: str, k: int | None, info: ModelInfo) -> int:
    if k is not None and k > info.max_top_n_tokens:
        raise ValidationError(f"`{what}` must be <= {info.max_top_n_tokens} (got {k}): the "
                              "most alternatives this server ranks per token")
    return k or 0


def _check_choices(prompts: int, per_prompt: int, field: str, info: ModelInfo) -> None:
    check_fanout(prompts * per_prompt, f"{prompts} prompt(s) x `{field}` = {per_prompt}",
                 "sequences", info)


def _check_token_prompts(prompts: Sequence[str | list[int]], info: ModelInfo) -> None:
    """Token-id prompts too long for the model, refused before they are decoded for `echo`
    or queued (a 4 MB body holds 1.9 million ids); text prompts are counted by the engine."""
    for p in prompts:
        if not isinstance(p, str) and len(p) > info.max_input_tokens:
            raise ValidationError(f"`prompt` must have at most {info.max_input_tokens} tokens. "
                                  f"Given: {len(p)}. Shorten the prompt.")


def _in_openai_terms(exc: BaseException, prompt: str, max_tokens: str) -> BaseException:
    """The engine words its length errors in TGI's fields (`inputs`, `max_new_tokens`, "or
    set `truncate`"), which an OpenAI client never sent: name the request's own fields."""
    if not isinstance(exc, ValidationError):
        return exc
    msg = str(exc)
    new = (msg.replace(" or set `truncate`", "").replace("`inputs`", f"`{prompt}`")
           .replace("`max_new_tokens`", f"`{max_tokens}`"))
    return exc if new == msg else ValidationError(new)


def _data(payload: dict | str) -> str:
    return sse(payload, space=True)  # OpenAI writes `data: `, and ends with [DONE]


# (choice index, text, finish reason or None, the events this chunk carries) -> the choice,
# or a list of them (one chunk each; none: no chunk)
ChunkMaker = Callable[[int, str, str | None, list[GenerationEvent]], dict | list[dict]]


class OpenedChat(NamedTuple):
    """A chat request's started choices, with what reading their text needs."""

    plan: ToolPlan | None
    streams: list[TrackedStream]
    k: int  # alternatives per token
    # None: the text is not split into reasoning and answer (--reasoning-parser none, or an
    # answer constrained to JSON, whose grammar leaves no room for reasoning); else whether
    # the prompt opened the reasoning (server/reasoning.py).
    inside: bool | None
    reasoning: ReasoningFormat | None  # --reasoning-parser's format; None: never split


class OpenAIRoutes:
    def __init__(self, backend: EngineBackend, metrics: Metrics,
                 tool_call_parser: str = "auto",
                 reasoning: ReasoningParser | None = None, max_best_of: int = 1) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_best_of = max_best_of  # --max-best-of (1: completions' best_of > n refused)
        self.tool_call_parser = tool_call_parser  # server/tool_parsers.py: PARSERS
        self.reasoning = reasoning  # None: --reasoning-parser none
        self.created = int(time.time())

    def reader(self, opened: OpenedChat) -> ChoiceReader:
        """A choice's reader: reasoning, then content and tool calls."""
        splitter = None if opened.inside is None else \
            ReasoningSplitter(opened.reasoning.tags, opened.inside)
        return ChoiceReader(opened.plan, self.tool_call_parser, splitter)

    def reasoning_format(self) -> ReasoningFormat | None:
        """How answers are split (None: not at all); once the backend is ready."""
        return self.reasoning.format() if self.reasoning is not None else None

    def _info(self) -> ModelInfo:
        if not self.backend.ready():
            raise NotReadyError(not_ready_message(self.backend))
        return self.backend.info()

    @staticmethod
    def _envelope(id_prefix: str, obj: str, info: ModelInfo) -> dict[str, Any]:
        """The keys every OpenAI response and chunk starts with."""
        return {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": info.model_id,
            "system_fingerprint": f"tpserve-{info.version}",
        }

    def _card(self) -> dict[str, Any]:
        return {"id": self.backend.info().model_id, "object": "model",
                "created": self.created, "owned_by": "tpserve"}

    def _cards(self) -> list[dict[str, Any]]:
        """The base model's card, then each LoRA adapter's (its `parent` the base model)."""
        base = self._card()
        return [base] + [{**base, "id": name, "parent": base["id"]}
                         for name in self.backend.info().adapters]

    async def models(self) -> dict:
        return {"object": "list", "data": self._cards()}

    async def model(self, model_id: str) -> dict:
        """GET /v1/models/{model} (openai's `models.retrieve`): a served model's card."""
        cards = {card["id"]: card for card in self._cards()}
        if model_id not in cards:
            raise HTTPException(404, f"model `{model_id}` is not served here (this server "
                                     f"serves {', '.join(f'`{c}`' for c in cards)})")
        return cards[model_id]

    async def _open_all(self, prompts: Sequence[str | list[int]], params: SamplingParams,
                        n: int, terms: tuple[str, str],
                        add_special_tokens: bool = True) -> list[TrackedStream]:
        """n engine requests per prompt (choices or best_of candidates, each with its own
        seed), started side by side; a refusal is raised in the request's `terms` (its
        prompt and max-tokens field names)."""
        jobs = [job for p in prompts for job in candidate_jobs(p, params, n)]
        try:
            return await open_all(self.metrics, self.backend, jobs,
                                  add_special_tokens=add_special_tokens)
        except Exception as exc:
            renamed = _in_openai_terms(exc, *terms)
            if renamed is exc:
                raise
            raise renamed from None

    def token_text(self, tok: TokenInfo) -> str:
        """A generated token's own text, for log-probabilities: decoded from its id as the
        engine names its alternatives (tok.text is the piece of text released with it)."""
        decode = getattr(self.backend, "decode", None)
        return tok.text if decode is None else decode([tok.id])

    def token_bytes(self, tok: TokenInfo, text: str) -> list[int]:
        """The bytes a token stands for (OpenAI's `bytes`), `text` being its own text: also
        those of a piece of a multi-byte character, whose text reads U+FFFD."""
        of = getattr(self.backend, "token_bytes", None)
        return list(text.encode("utf-8") if of is None else of(tok.id, text))

    def _echo(self, prompt: str | list[int]) -> str:
        """What `echo` puts before a choice's text: the prompt, as text."""
        if isinstance(prompt, str):
            return prompt
        decode = getattr(self.backend, "decode", None)
        if decode is None:
            raise ValidationError("`echo` of a token-id prompt is not supported by this server")
        return decode(prompt)

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        info = self._info()
        prompts, n = req.prompts, req.choices()
        _check_token_prompts(prompts, info)
        k = _check_top("logprobs", req.logprobs, info)
        want_lp = req.logprobs is not None
        if want_lp and req.echo and info.encoder_decoder:
            raise ValidationError("`echo` with `logprobs` asks for the prompt's log-"
                                  "probabilities, and this encoder-decoder model has none (its "
                                  "encoder reads the prompt; nothing predicts it): drop `echo` "
                                  "or `logprobs`")
        if want_lp and req.echo and req.stream:
            raise ValidationError("`echo` with `logprobs` is not supported when streaming "
                                  "(the prompt's log-probabilities come with the last token)")
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise ValidationError("`max_tokens` must be at least 1 (0 is allowed with `echo`: "
                                  "the prompt back, with its log-probabilities when `logprobs` "
                                  "is set, and nothing generated)")
        params = req.sampling_params(info, req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
                                     top_n=k, prompt_logprobs=want_lp and req.echo)
        if prompt_only:
            params = prompt_only_params(params)
        per_prompt = completion_candidates(req.best_of, n, req.stream, params.greedy,
                                           self.max_best_of)
        _check_choices(len(prompts), per_prompt, "best_of" if per_prompt > n else "n", info)
        echoed = [self._echo(p) if req.echo else "" for p in prompts]
        streams = await self._open_all(prompts, params, per_prompt, ("prompt", "max_tokens"))
        if prompt_only:
            streams = [PromptOnly(s) for s in streams]
        base = self._envelope("cmpl", "text_completion", info)
        prefixes = [e for e in echoed for _ in range(n)]

        if req.stream:
            logs = ([CompletionLogprobs(k, len(p), self.token_text, self.token_bytes)
                     for p in prefixes] if want_lp else None)

            def choice(i: int, text: str, finish: str | None, events: list) -> dict:
                lp = None
                if logs is not None:
                    for e in events:
                        logs[i].add(e.token, e.top_tokens)
                    lp = logs[i].take()
                return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

            return self._stream(req, streams, base, choice, prefixes, want_lp)
        results = await collect_all_or_abort(request, streams)
        if isinstance(results, Response):
            return results
        choices = []
        for i, events in enumerate(best_of_each(results, per_prompt, n)):
            final, prefix = events[-1], prefixes[i]
            lp = None
            if want_lp:
                log = CompletionLogprobs(k, len(prefix), self.token_text, self.token_bytes)
                if req.echo:
                    log.add_prompt(final.prefill, prefix, final.prefill_top)
                for e in events:
                    log.add(e.token, e.top_tokens)
                lp = log.body()
            choices.append({"index": i, "text": prefix + final_text(events), "logprobs": lp,
                            "finish_reason": _FINISH[final.finish_reason]})
        usage = _usage([e[-1] for e in results], per_prompt)
        return AnswerResponse({**base, "choices": choices, "usage": usage})

    async def _render_chat(self, req: ChatRequest, info: ModelInfo,
                           plan: ToolPlan | None) -> tuple[str, int]:
        """The prompt and max new tokens of a chat request. A long conversation is rendered
        and counted on a worker thread: a tokenizer takes seconds over megabytes, and on the
        event loop every other client of the server would wait for it."""
        messages = [m.as_template_input() for m in req.messages]
        max_new = req.max_completion_tokens or req.max_tokens

        def render() -> tuple[str, int]:
            prompt = render_chat(self.backend.apply_chat_template, messages, plan,
                                 req.tool_prompt)
            if max_new is None:  # OpenAI's chat default: whatever the context window leaves
                # Counted as it is submitted: the template already holds its special tokens
                # (a BOS counted twice left the answer one token short of the window).
                used = self.backend.count_tokens(prompt, add_special_tokens=False)
                return prompt, max(1, info.max_total_tokens - used)
            return prompt, max_new

        size = sum(len(str(v)) for m in messages for v in m.values())
        size += sum(len(str(t)) for t in plan.template_tools()) if plan else 0
        if size <= INLINE_RENDER_CHARS:
            return render()
        return await asyncio.to_thread(render)

    async def open_chat(self, req: ChatRequest, info: ModelInfo,
                        terms: tuple[str, str] | None = None) -> OpenedChat:
        """A chat request's tool plan, its choices' started engine streams, the number of
        alternatives per token and how its reasoning is read. /v1/responses
        (server/responses.py) starts its requests here too, naming its own fields (`terms`:
        prompt, max tokens) in length errors."""
        _check_choices(1, req.choices(), "n", info)
        if req.top_logprobs and not req.logprobs:
            raise ValidationError("`top_logprobs` needs `logprobs`: true")
        k = _check_top("top_logprobs", req.top_logprobs, info) if req.logprobs else 0
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                              response_format_spec(req.response_format))
        except ValueError as exc:  # a response_format error is checked when it is parsed
            raise ValidationError(str(exc)) from None
        prompt, max_new = await self._render_chat(req, info, plan)
        params = req.sampling_params(info, max_new, top_n=k)
        if plan is not None and plan.guided is not None:  # a forced call: its JSON schema
            params = dataclasses.replace(params, guided=plan.guided)
        fmt = self.reasoning_format()
        if fmt is not None and fmt.keep_ids:  # special-token tags stay in the text
            params = dataclasses.replace(params, keep_special_ids=fmt.keep_ids)
        if terms is None:
            max_field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            terms = ("messages", max_field)
        # The chat template already contains the BOS/special tokens it wants.
        streams = await self._open_all([prompt], params, req.choices(), terms,
                                       add_special_tokens=False)
        json_only = params.guided is not None and params.guided.kind == "json_schema"
        inside = None if fmt is None or json_only else prompt_opens_reasoning(prompt, fmt.tags)
        return OpenedChat(plan, streams, k, inside, fmt)

    async def chat(self, req: ChatRequest, request: Request) -> Response:
        info = self._info()
        n = req.choices()
        opened = await self.open_chat(req, info)
        plan, streams, k = opened.plan, opened.streams, opened.k
        want_lp = bool(req.logprobs)
        if (plan is not None and plan.returns_calls) or opened.reasoning is not None:
            return await self._chat_read(req, request, info, opened)

        if req.stream:

            def delta(i: int, text: str, finish: str | None, events: list) -> dict:
                msg = {"role": "assistant", "content": text, "tool_calls": None}
                lp = (chat_logprobs(events, k, self.token_text, self.token_bytes)
                      if want_lp and events else None)
                return {"index": i, "delta": msg, "logprobs": lp, "finish_reason": finish}

            chunk = self._envelope("chatcmpl", "chat.completion.chunk", info)
            return self._stream(req, streams, chunk, delta, [""] * n, want_lp)
        results = await collect_all_or_abort(request, streams)
        if isinstance(results, Response):
            return results
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": final_text(events)},
            "logprobs": (chat_logprobs(events, k, self.token_text, self.token_bytes)
                         if want_lp else None),
            "finish_reason": _FINISH[events[-1].finish_reason],
        } for i, events in enumerate(results)]
        body = {
            **self._envelope("chatcmpl", "chat.completion", info),
            "choices": choices,
            "usage": _usage([e[-1] for e in results], n),
        }
        return AnswerResponse(body)

    async def _chat_read(self, req: ChatRequest, request: Request, info: ModelInfo,
                         opened: OpenedChat) -> Response:
        """A chat answer whose text is read for tool calls (server/tool_stream.py) and/or a
        reasoning (server/reasoning.py)."""
        n, want_lp, streams, k = req.choices(), bool(req.logprobs), opened.streams, opened.k
        outs = [self.reader(opened) for _ in range(n)]
        if req.stream:
            tgi = req.from_tgi_client()

            started: set[int] = set()

            def deltas(i: int, text: str, finish: str | None, events: list) -> list[dict]:
                found, reason = (outs[i].feed(text), None) if finish is None else \
                    outs[i].finish(text, finish)
                lp = (chat_logprobs(events, k, self.token_text, self.token_bytes)
                      if want_lp and events else None)
                made = [{"index": i, "delta": wire_delta(d, tgi), "logprobs": None,
                         "finish_reason": None} for d in found]
                if not made and (reason is not None or lp is not None):
                    # Nothing new to say: OpenAI's delta is empty ({}), which keeps the
                    # content a client adds up null before and after a tool call ("" made
                    # it ""). Only an answer that ends with nothing said opens with "".
                    opens_empty = i not in started and reason is not None
                    empty = wire_delta("", tgi) if tgi or opens_empty else {}
                    made = [{"index": i, "delta": empty, "logprobs": None,
                             "finish_reason": None}]
                if made:
                    started.add(i)
                    made[0]["logprobs"], made[-1]["finish_reason"] = lp, reason
                return made

            chunk = self._envelope("chatcmpl", "chat.completion.chunk", info)
            return self._stream(req, streams, chunk, deltas, [""] * n, want_lp)
        results = await collect_all_or_abort(request, streams)
        if isinstance(results, Response):
            return results
        choices = []
        for i, events in enumerate(results):
            found, reason = outs[i].finish(final_text(events), _FINISH[events[-1].finish_reason])
            content, calls = message_of(found)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if opened.reasoning is not None:
                reasoning = reasoning_of(found)
                # An answer cut short inside its reasoning has no content: null, as vLLM's.
                if reasoning is not None and not content:
                    message["content"] = None
                # Both spellings: vLLM's and DeepSeek's reasoning_content, and reasoning,
                # which newer vLLM and huggingface_hub's ChatCompletionOutputMessage read.
                message.update(reasoning_content=reasoning, reasoning=reasoning)
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": chat_logprobs(events, k, self.token_text, self.token_bytes)
                            if want_lp else None})
        body = {**self._envelope("chatcmpl", "chat.completion", info), "choices": choices,
                "usage": _usage([e[-1] for e in results], n)}
        return AnswerResponse(body)

    def _stream(
        self,
        req: _Sampling,
        streams: list[TrackedStream],
        chunk: dict,
        choice: ChunkMaker,
        prefixes: list[str],
        every_token: bool = False,
    ) -> EventStreamResponse:
        """SSE chunks of one or more choices as their tokens come. every_token: a chunk for
        each generated token even where no text is released yet (the part of the text that
        could still start a stop sequence is held back), so that its log-probability is
        reported."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        n = req.choices()
        # text_generation 0.7.0's chat stream parses every `data:` line as JSON, so the
        # closing `[DONE]` (which TGI 2 sends too) raised JSONDecodeError after the last
        # chunk: its stream ends cleanly at the end of the response instead.
        tgi_client = isinstance(req, ChatRequest) and req.from_tgi_client()
        # OpenAI opens each chat choice with a chunk of its own naming the role, `content`
        # "" and no log-probabilities, and names the role nowhere else. The openai SDK's
        # stream helper (chat.completions.stream) relies on both: it adds up every string
        # of the deltas (a role in each chunk read back as "assistantassistant..."), and it
        # counted the log-probabilities of a later choice's first chunk twice.
        # text_generation's chunk type requires the role in every delta (TGI sends it so).
        opened_choices: set[int] = set()

        def with_role(c: dict) -> list[dict]:
            delta = c.get("delta")
            if tgi_client or delta is None:
                return [c]
            c = {**c, "delta": {k: v for k, v in delta.items() if k != "role"}}
            if c["index"] in opened_choices:
                return [c]
            opened_choices.add(c["index"])
            # `content` "" opens a text answer, null one that starts with a tool call or a
            # reasoning (OpenAI's form of each), so that the SDK's sum keeps content null.
            content = "" if isinstance(c["delta"].get("content"), str) else None
            return [{"index": c["index"], "delta": {"role": "assistant", "content": content},
                     "logprobs": None, "finish_reason": None}, c]

        async def events() -> AsyncIterator[str]:
            streamed = [""] * len(streams)
            finals: list[GenerationEvent | None] = [None] * len(streams)
            for i, prefix in enumerate(prefixes):
                if prefix:
                    for c in with_role(choice(i, prefix, None, [])):
                        yield _data({**chunk, **extra, "choices": [c]})
            try:
                async for i, event in merged(streams):
                    if event.finished:
                        finals[i] = event
                        text = last_piece(event, streamed[i])
                        made = choice(i, text, _FINISH[event.finish_reason], [event])
                    elif not event.token.special and (event.token.text or every_token):
                        streamed[i] += event.token.text
                        made = choice(i, event.token.text, None, [event])
                    else:
                        continue
                    for made_one in made if isinstance(made, list) else [made]:
                        for c in with_role(made_one):
                            yield _data({**chunk, **extra, "choices": [c]})
                if include_usage:
                    usage = _usage([f for f in finals if f is not None], n)
                    yield _data({**chunk, "choices": [], "usage": usage})
            except Exception as exc:  # headers are sent: report in-band, then stop
                yield _data(error_body(exc))
                return
            if not tgi_client:  # its client parses every `data:` line as JSON
                yield _data("[DONE]")

        async def close_all() -> None:
            for tracked in streams:
                await tracked.aclose()

        return EventStreamResponse(events(), on_close=close_all)


def openai_router(backend: EngineBackend, metrics: Metrics, tool_call_parser: str = "auto",
                  reasoning: ReasoningParser | None = None, max_best_of: int = 1) -> APIRouter:
    routes = OpenAIRoutes(backend, metrics, tool_call_parser, reasoning, max_best_of)
    router = APIRouter(prefix="/v1", tags=["openai"])
    router.add_api_route("/models", routes.models, methods=["GET"])
    # Hub ids have a slash: `org/name`.
    router.add_api_route("/models/{model_id:path}", routes.model, methods=["GET"])
    router.add_api_route("/completions", routes.completions, methods=["POST"])
    router.add_api_route("/chat/completions", routes.chat, methods=["POST"])
    return router

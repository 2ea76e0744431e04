"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Only one choice per request (n=1) and no logprobs. Errors keep TGI's body shape
(`{"error", "error_type"}`, 422 for validation) so one client error path serves both APIs.
Chunks also carry the keys text_generation's chat types require (system_fingerprint,
delta.role, delta.tool_calls), so TGI's client can read them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import NotReadyError, ValidationError
from tpserve.fields import (
    FrequencyPenalty,
    NonEmptyText,
    OpenAITemperature,
    OpenAITopP,
    RepetitionPenalty,
    Seed,
    StopText,
    Text,
    TokenCount,
    unsupported,
)
from tpserve.server.backend import EngineBackend, not_ready_message
from tpserve.server.errors import error_body
from tpserve.server.metrics import Metrics, TrackedStream
from tpserve.server.streaming import (
    AnswerResponse,
    EventStreamResponse,
    collect_or_abort,
    final_text,
    sse,
)

_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints, with OpenAI's ranges."""

    model_config = ConfigDict(allow_inf_nan=False)

    model: Text | None = None
    max_tokens: TokenCount | None = None
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    seed: Seed | None = None
    stop: StopText | list[StopText] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[
        Annotated[int, Field(ge=1)] | None,
        unsupported("`n` > 1 (tpserve returns one choice per request)", 1),
    ] = None
    frequency_penalty: FrequencyPenalty | None = None
    presence_penalty: Annotated[
        float | None, unsupported("`presence_penalty` (use 0 or omit it)", 0)
    ] = None
    # TGI's extension, sent by text_generation.Client.chat.
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: Annotated[
        dict[str, float] | list[float] | None, unsupported("`logit_bias`")
    ] = None
    user: Text | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, info: ModelInfo, max_new_tokens: int) -> SamplingParams:
        stop = self.stop_list()
        if len(stop) > info.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {info.max_stop_sequences} sequences (got {len(stop)})"
            )
        common = {
            "max_new_tokens": max_new_tokens,
            "seed": self.seed,
            "stop": tuple(stop),
            "frequency_penalty": self.frequency_penalty or None,
            "repetition_penalty": self.repetition_penalty,
            # OpenAI never returns the stop sequence; the engine's output processor cuts it
            # (and holds back streamed text that could be its start).
            "include_stop_str_in_output": False,
        }
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        if temperature == 0:  # OpenAI's spelling of greedy decoding; top_p is moot then
            return SamplingParams(do_sample=False, **common)
        # top_p == 1 keeps every token, which the engine spells as "no top_p".
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else None
        return SamplingParams(do_sample=True, temperature=temperature, top_p=top_p, **common)


def _one_prompt(v: str | list[str]) -> str | list[str]:
    if isinstance(v, list) and len(v) != 1:
        raise ValueError(f"`prompt` must be a string or a list of one string (got {len(v)})")
    return v


class CompletionRequest(_Sampling):
    prompt: Annotated[NonEmptyText | list[NonEmptyText], AfterValidator(_one_prompt)]
    max_tokens: TokenCount | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: Annotated[int | None, unsupported("`logprobs`", None)] = None
    best_of: Annotated[
        Annotated[int, Field(ge=1)] | None, unsupported("`best_of` > 1", 1)
    ] = None
    suffix: Annotated[Text | None, unsupported("`suffix` (insertion)")] = None

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text | None = None


class ChatMessage(BaseModel):
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    def as_template_input(self) -> dict[str, str]:
        if isinstance(self.content, list):
            content = "".join(part.text or "" for part in self.content)
        else:
            content = self.content or ""
        msg = {"role": self.role, "content": content}
        if self.name:
            msg["name"] = self.name
        return msg


def _text_format(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v and v.get("type", "text") != "text":
        raise ValueError("`response_format` other than text is not supported by tpserve")
    return v


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: Annotated[bool | None, unsupported("`logprobs`")] = None
    top_logprobs: Annotated[int | None, unsupported("`top_logprobs`")] = None
    tools: Annotated[list[Any] | None, unsupported("`tools` (function calling)")] = None
    tool_choice: Any = None
    response_format: Annotated[dict[str, Any] | None, AfterValidator(_text_format)] = None


def _last_piece(final: GenerationEvent, streamed: str) -> str:
    """What the final chunk carries so that the streamed pieces add up to the final text."""
    text = final.generated_text
    if text is not None and text.startswith(streamed):
        return text[len(streamed):]
    return "" if final.token.special else final.token.text


def _usage(final: GenerationEvent) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.generated_tokens,
        "total_tokens": final.prompt_tokens + final.generated_tokens,
    }


def _data(payload: dict | str) -> str:
    return sse(payload, space=True)  # OpenAI writes `data: `, and ends with [DONE]


ChunkMaker = Callable[[str, str | None], dict]


class OpenAIRoutes:
    def __init__(self, backend: EngineBackend, metrics: Metrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self.created = int(time.time())

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

    async def models(self) -> dict:
        info = self.backend.info()
        card = {
            "id": info.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "tpserve",
        }
        return {"object": "list", "data": [card]}

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        info = self._info()
        params = req.sampling_params(info, req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
        tracked = await self.metrics.open_stream(self.backend, req.text, params)
        base = self._envelope("cmpl", "text_completion", info)
        prefix = req.text if req.echo else ""

        def choice(text: str, finish: str | None) -> dict:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if req.stream:
            return self._stream(req, tracked, base, choice, prefix)
        events = await collect_or_abort(request, tracked)
        if isinstance(events, Response):
            return events
        final = events[-1]
        text = prefix + final_text(events)
        body = {
            **base,
            "choices": [choice(text, _FINISH[final.finish_reason])],
            "usage": _usage(final),
        }
        return AnswerResponse(body)

    async def chat(self, req: ChatRequest, request: Request) -> Response:
        info = self._info()
        prompt = self.backend.apply_chat_template([m.as_template_input() for m in req.messages])
        max_new = req.max_completion_tokens or req.max_tokens
        if max_new is None:  # OpenAI's chat default: whatever the context window leaves
            max_new = max(1, info.max_total_tokens - self.backend.count_tokens(prompt))
        params = req.sampling_params(info, max_new)
        # The chat template already contains the BOS/special tokens it wants.
        tracked = await self.metrics.open_stream(
            self.backend, prompt, params, add_special_tokens=False
        )

        if req.stream:

            def delta(text: str, finish: str | None) -> dict:
                msg = {"role": "assistant", "content": text, "tool_calls": None}
                return {"index": 0, "delta": msg, "logprobs": None, "finish_reason": finish}

            chunk = self._envelope("chatcmpl", "chat.completion.chunk", info)
            return self._stream(req, tracked, chunk, delta, "")
        events = await collect_or_abort(request, tracked)
        if isinstance(events, Response):
            return events
        final = events[-1]
        text = final_text(events)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": _FINISH[final.finish_reason],
        }
        body = {
            **self._envelope("chatcmpl", "chat.completion", info),
            "choices": [choice],
            "usage": _usage(final),
        }
        return AnswerResponse(body)

    def _stream(
        self,
        req: _Sampling,
        tracked: TrackedStream,
        chunk: dict,
        choice: ChunkMaker,
        prefix: str,
    ) -> EventStreamResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        async def events() -> AsyncIterator[str]:
            streamed = ""
            if prefix:
                yield _data({**chunk, **extra, "choices": [choice(prefix, None)]})
            try:
                async for event in tracked:
                    if event.finished:
                        text = _last_piece(event, streamed)
                        finish = _FINISH[event.finish_reason]
                        yield _data({**chunk, **extra, "choices": [choice(text, finish)]})
                        if include_usage:
                            yield _data({**chunk, "choices": [], "usage": _usage(event)})
                    elif not event.token.special and event.token.text:
                        streamed += event.token.text
                        yield _data({**chunk, **extra, "choices": [choice(event.token.text, None)]})
            except Exception as exc:  # headers are sent: report in-band, then stop
                yield _data(error_body(exc))
                return
            yield _data("[DONE]")

        return EventStreamResponse(events(), on_close=tracked.aclose)


def openai_router(backend: EngineBackend, metrics: Metrics) -> APIRouter:
    routes = OpenAIRoutes(backend, metrics)
    router = APIRouter(prefix="/v1", tags=["openai"])
    router.add_api_route("/models", routes.models, methods=["GET"])
    router.add_api_route("/completions", routes.completions, methods=["POST"])
    router.add_api_route("/chat/completions", routes.chat, methods=["POST"])
    return router

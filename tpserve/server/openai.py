"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Only one choice per request (n=1) and no logprobs. Errors keep TGI's body shape
(`{"error", "error_type"}`, 422 for validation) so one client error path serves both APIs.
Chunks also carry the keys text_generation's chat types require (system_fingerprint,
delta.role, delta.tool_calls), so TGI's client can read them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator

from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import NotReadyError, ValidationError
from tpserve.server.app import CLIENT_CLOSED_STATUS, EventStreamResponse, drain, final_text
from tpserve.server.backend import EngineBackend, ModelInfo, not_ready_message
from tpserve.server.errors import error_body
from tpserve.server.metrics import Metrics, TrackedStream

_FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints, with OpenAI's ranges."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # TGI's extension, sent by text_generation.Client.chat.
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | list[float] | None = None
    user: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"`max_tokens` must be >= 1 (got {v})")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 2:
            raise ValueError(f"`temperature` must be between 0 and 2 (got {v})")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"`top_p` must be > 0 and <= 1 (got {v})")
        return v

    @field_validator("frequency_penalty")
    @classmethod
    def _frequency_penalty(cls, v: float | None) -> float | None:
        if v is not None and not -2 <= v <= 2:
            raise ValueError(f"`frequency_penalty` must be between -2 and 2 (got {v})")
        return v

    @field_validator("presence_penalty")
    @classmethod
    def _presence_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("`presence_penalty` is not supported by tpserve (use 0 or omit it)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(f"`repetition_penalty` must be strictly positive (got {v})")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"`n` must be 1: tpserve returns one choice per request (got {v})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: Any) -> Any:
        if v:
            raise ValueError("`logit_bias` is not supported by tpserve")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"`seed` must be >= 0 (got {v})")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(s == "" for s in stops):
            raise ValueError("`stop` sequences must be non-empty strings")
        return v

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
        }
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        if temperature == 0:  # OpenAI's spelling of greedy decoding; top_p is moot then
            return SamplingParams(do_sample=False, **common)
        # top_p == 1 keeps every token, which the engine spells as "no top_p".
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else None
        return SamplingParams(do_sample=True, temperature=temperature, top_p=top_p, **common)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError(
                f"`prompt` must be a string or a list of one string (got {len(v)} prompts)"
            )
        if not (v if isinstance(v, str) else v[0]):
            raise ValueError("`prompt` cannot be empty")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("`logprobs` is not supported by tpserve")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"`best_of` must be 1 (got {v})")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("`suffix` (insertion) is not supported by tpserve")
        return v

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ContentPart(BaseModel):
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v != "text":
            raise ValueError(f"only `text` content parts are supported (got `{v}`)")
        return v


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        if isinstance(self.content, list):
            content = "".join(part.text or "" for part in self.content)
        else:
            content = self.content or ""
        msg = {"role": self.role, "content": content}
        if self.name:
            msg["name"] = self.name
        return msg


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"`max_completion_tokens` must be >= 1 (got {v})")
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _logprobs(cls, v: Any, info: Any) -> Any:
        if v:
            raise ValueError(f"`{info.field_name}` is not supported by tpserve")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("`tools` (function calling) is not supported by tpserve")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("type", "text") != "text":
            raise ValueError("`response_format` other than text is not supported by tpserve")
        return v


class StopTrimmer:
    """OpenAI never returns the stop sequence; the engine (like TGI) includes it.

    While streaming, text that could be the start of a stop sequence is held back until
    the next token shows whether it is one, so streamed text equals the final text.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.seen = ""
        self.sent = 0

    def feed(self, text: str) -> str:
        self.seen += text
        hold = max((_overlap(self.seen, s) for s in self.stops), default=0)
        safe = len(self.seen) - hold
        out, self.sent = self.seen[self.sent : safe], max(self.sent, safe)
        return out

    def finish(self, final: str) -> str:
        final = self.trim(final)
        return final[self.sent :]

    def trim(self, text: str) -> str:
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[: min(cuts)] if cuts else text


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a prefix of `stop` (or all of it)."""
    if stop in text:
        return len(text) - text.find(stop)
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def _final_text(final: GenerationEvent, streamed: str) -> str:
    if final.generated_text is not None:
        return final.generated_text
    return streamed + ("" if final.token.special else final.token.text)


def _usage(final: GenerationEvent) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.generated_tokens,
        "total_tokens": final.prompt_tokens + final.generated_tokens,
    }


def _sse(payload: dict | str) -> str:
    # OpenAI writes `data: ` with a space, and ends with the literal [DONE].
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


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
        events = await drain(request, tracked)
        if events is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        final = events[-1]
        text = prefix + StopTrimmer(req.stop_list()).trim(final_text(events))
        body = {
            **base,
            "choices": [choice(text, _FINISH[final.finish_reason])],
            "usage": _usage(final),
        }
        return JSONResponse(body)

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
        events = await drain(request, tracked)
        if events is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        final = events[-1]
        text = StopTrimmer(req.stop_list()).trim(final_text(events))
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
        return JSONResponse(body)

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
            trimmer = StopTrimmer(req.stop_list())
            if prefix:
                yield _sse({**chunk, **extra, "choices": [choice(prefix, None)]})
            try:
                async for event in tracked:
                    if event.finished:
                        text = trimmer.finish(_final_text(event, trimmer.seen))
                        finish = _FINISH[event.finish_reason]
                        yield _sse({**chunk, **extra, "choices": [choice(text, finish)]})
                        if include_usage:
                            yield _sse({**chunk, "choices": [], "usage": _usage(event)})
                    elif not event.token.special:
                        text = trimmer.feed(event.token.text)
                        if text:
                            yield _sse({**chunk, **extra, "choices": [choice(text, None)]})
            except Exception as exc:  # headers are sent: report in-band, then stop
                yield _sse(error_body(exc))
                return
            yield _sse("[DONE]")

        return EventStreamResponse(events(), on_close=tracked.aclose)


def openai_router(backend: EngineBackend, metrics: Metrics) -> APIRouter:
    routes = OpenAIRoutes(backend, metrics)
    router = APIRouter(prefix="/v1", tags=["openai"])
    router.add_api_route("/models", routes.models, methods=["GET"])
    router.add_api_route("/completions", routes.completions, methods=["POST"])
    router.add_api_route("/chat/completions", routes.chat, methods=["POST"])
    return router

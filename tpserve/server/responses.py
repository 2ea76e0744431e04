"""POST /v1/responses: OpenAI's Responses API over the chat machinery.

The request is translated into a chat request (server/responses_request.py) and started by
the chat route's own code (OpenAIRoutes.open_chat: template, sampling, structured output,
tool plans, limits); the generated text is read for tool calls as chat reads it
(server/tool_stream.py), its reasoning split off first with --reasoning-parser (a `reasoning`
item before the answer's), and laid out as Response output items
(server/responses_output.py).

Streams follow OpenAI's: `event: <type>` and `data: <event>` per event, numbered by
`sequence_number`, from `response.created` to `response.completed` (or
`response.incomplete` when `max_output_tokens` cut the answer), with no `[DONE]`. An error
after the stream started is an `error` event then `response.failed`.

Finished responses (completed, or incomplete: cut by `max_output_tokens`) are kept in the
app's ResponseStore unless `store` is false, with the input items that made them, for
`previous_response_id` and GET / DELETE /v1/responses/{id} (and its input_items). Failed
and aborted ones are not: there is nothing to continue.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent
from tpserve.errors import ValidationError
from tpserve.server.backend import EngineBackend
from tpserve.server.choice_reader import ChoiceReader
from tpserve.server.errors import error_body
from tpserve.server.metrics import Metrics, TrackedStream
from tpserve.server.openai import OpenAIRoutes, last_piece
from tpserve.server.openai_logprobs import chat_logprobs
from tpserve.server.reasoning_format import ReasoningParser
from tpserve.server.responses_history import as_input
from tpserve.server.responses_output import ItemStatus, OutputBuilder, new_id
from tpserve.server.responses_request import ResponsesRequest, in_responses_terms
from tpserve.server.responses_store import ResponseStore
from tpserve.server.responses_stored import Keeper, StoredResponses
from tpserve.server.streaming import (
    AnswerResponse,
    EventStreamResponse,
    collect_all_or_abort,
    final_text,
    sse,
)
from tpserve.server.tool_stream import Delta


def _finish(reader: ChoiceReader, piece: str, final: GenerationEvent) -> list[Delta]:
    # Chat's finish reason, which only decides chat's "tool_calls" (unused here).
    reason = "length" if final.finish_reason == "length" else "stop"
    return reader.finish(piece, reason)[0]


def _status(final: GenerationEvent) -> ItemStatus:
    return "incomplete" if final.finish_reason == "length" else "completed"


def _usage(final: GenerationEvent, reasoning_tokens: int) -> dict[str, Any]:
    # Prefix-cache hits are not reported per request: 0, as the client's model requires.
    return {"input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": final.generated_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": final.prompt_tokens + final.generated_tokens}


class _Envelope:
    """The Response object around an answer's output: its id, and the request echoed."""

    def __init__(self, req: ResponsesRequest, info: ModelInfo, stored: bool) -> None:
        self.id = new_id("resp")  # uuid4: unguessable, as it is the key to a stored one
        self.created_at = int(time.time())
        self.echo = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": info.model_id,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "background": False, "service_tier": "default", "store": stored,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": req.text_format(), "verbosity": "medium"},
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": [t.model_dump() for t in req.tools or []],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "user": req.user,
        }

    def body(self, status: str, output: list[dict] | None = None,
             final: GenerationEvent | None = None, error: dict | None = None,
             reasoning_tokens: int = 0) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "incomplete_details": incomplete,
                "completed_at": int(time.time()) if status == "completed" else None,
                "output": output or [],
                "usage": _usage(final, reasoning_tokens) if final else None,
                **self.echo}
        # Only a failed response says `error` (optional in OpenAI's schema): tpserve's error
        # bodies are the ones with an `error` key, and clients test for it.
        return {**body, "error": error} if error is not None else body


def _event(payload: dict) -> str:
    return f"event: {payload['type']}\n" + sse(payload, space=True)


class ResponsesRoutes:
    def __init__(self, chat: OpenAIRoutes, stored: StoredResponses) -> None:
        self.chat = chat
        self.stored = stored

    def _logprobs(self, events: list[GenerationEvent], k: int) -> list[dict] | None:
        return chat_logprobs(events, k, self.chat.token_text,
                             self.chat.token_bytes)["content"] if events else None

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        info = self.chat._info()
        earlier = self.stored.earlier(req, request)
        try:
            # Earlier answers' reasoning items are taken (and left out of the prompt, as
            # thinking models' templates leave it) when this server makes them.
            reasoning = self.chat.reasoning_format() is not None
            chat = req.to_chat(reasoning_items=reasoning,
                               earlier=as_input(earlier.conversation) if earlier else ())
            opened = await self.chat.open_chat(chat, info, ("input", "max_output_tokens"))
        except ValidationError as exc:
            raise ValidationError(in_responses_terms(str(exc))) from None
        keeper = self.stored.keeper(req, earlier, request)
        envelope, reader = _Envelope(req, info, keeper is not None), self.chat.reader(opened)
        k = opened.k if req.wants_logprobs() else None
        if req.stream:
            return self._stream(opened.streams[0], envelope, reader, k, keeper)
        results = await collect_all_or_abort(request, opened.streams)
        if isinstance(results, Response):
            return results
        events, final = results[0], results[0][-1]
        out = OutputBuilder()
        if opened.inside is None:
            out.feed(_finish(reader, final_text(events), final),
                     self._logprobs(events, k) if k is not None else None)
        else:  # token by token, as a stream reads it: the reasoning's tokens are counted,
            # and their log-probabilities kept apart from the answer's
            streamed = ""
            for e in events[:-1]:
                if not e.token.special:
                    streamed += e.token.text
                    lp = self._logprobs([e], k) if k is not None else None
                    out.feed(reader.feed(e.token.text), lp)
            out.feed(_finish(reader, last_piece(final, streamed), final),
                     self._logprobs([final], k) if k is not None else None)
        out.finish(_status(final))
        body = envelope.body(_status(final), out.output(), final,
                             reasoning_tokens=reader.reasoning_tokens)
        return AnswerResponse(keeper.keep(body) if keeper else body)

    def _stream(self, tracked: TrackedStream, envelope: _Envelope, reader: ChoiceReader,
                k: int | None, keeper: Keeper | None) -> EventStreamResponse:
        """k: alternatives per token when log-probabilities are asked for, else None.
        keeper: stores the response when it finishes (before its last event is sent, so
        a client that read it can find it)."""
        seq = itertools.count()

        def send(payload: dict) -> str:
            return _event({**payload, "sequence_number": next(seq)})

        async def events() -> AsyncIterator[str]:
            yield send({"type": "response.created", "response": envelope.body("in_progress")})
            yield send({"type": "response.in_progress",
                        "response": envelope.body("in_progress")})
            out, streamed = OutputBuilder(), ""
            try:
                async for event in tracked:
                    lp = self._logprobs([event], k) if k is not None else None
                    if event.finished:
                        deltas = _finish(reader, last_piece(event, streamed), event)
                        made = out.feed(deltas, lp) + out.finish(_status(event))
                        status = _status(event)
                        body = envelope.body(status, out.output(), event,
                                             reasoning_tokens=reader.reasoning_tokens)
                        made.append({"type": f"response.{status}",
                                     "response": keeper.keep(body) if keeper else body})
                    elif not event.token.special and (event.token.text or lp):
                        streamed += event.token.text
                        made = out.feed(reader.feed(event.token.text), lp)
                    else:
                        continue
                    for payload in made:
                        yield send(payload)
            except Exception as exc:  # headers are sent: report in-band, then stop
                err = error_body(exc)
                yield send({"type": "error", "code": err["error_type"],
                            "message": err["error"], "param": None})
                failed = {"code": "server_error", "message": err["error"]}
                yield send({"type": "response.failed", "response": envelope.body(
                    "failed", out.output(), error=failed)})

        return EventStreamResponse(events(), on_close=tracked.aclose)


def responses_router(backend: EngineBackend, metrics: Metrics, store: ResponseStore,
                     tool_call_parser: str = "auto", reasoning: ReasoningParser | None = None
                     ) -> APIRouter:
    stored = StoredResponses(store)
    routes = ResponsesRoutes(OpenAIRoutes(backend, metrics, tool_call_parser, reasoning),
                             stored)
    router = APIRouter(prefix="/v1", tags=["openai"])
    router.add_api_route("/responses", routes.create, methods=["POST"])
    router.add_api_route("/responses/{response_id}", stored.retrieve, methods=["GET"])
    router.add_api_route("/responses/{response_id}", stored.delete, methods=["DELETE"])
    router.add_api_route("/responses/{response_id}/input_items", stored.input_items,
                         methods=["GET"])
    return router

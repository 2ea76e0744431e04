"""The HTTP front end: TGI's routes (this file) and OpenAI's (openai.py) over an EngineBackend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tpserve import protocol as wire
from tpserve.engine.request import GenerationEvent, TokenInfo
from tpserve.errors import NotReadyError
from tpserve.server.backend import EngineBackend, ModelInfo
from tpserve.server.errors import error_body, install_error_handlers
from tpserve.server.metrics import Metrics, MetricsMiddleware, TrackedStream

# nginx's "client closed request": never seen by the client, but visible in metrics.
CLIENT_CLOSED_STATUS = 499


class EventStreamResponse(StreamingResponse):
    """SSE response that always closes its generation, however the response ends.

    Starlette only cancels the body iterator on disconnect (and, for ASGI spec >= 2.4,
    does not even do that), so the generator may be left suspended; closing it and the
    tracked stream here is what makes the engine abort a request nobody reads.
    """

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()


def sse(data: str) -> str:
    # TGI writes `data:` with no space; SSE parsers accept both.
    return f"data:{data}\n\n"


async def drain(request: Request, tracked: TrackedStream) -> list[GenerationEvent] | None:
    """Collect a whole generation, or abort it and return None if the client leaves first."""

    async def collect() -> list[GenerationEvent]:
        return [event async for event in tracked]

    async def client_gone() -> None:
        # The body was already read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, work):
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(watch, return_exceptions=True)
            if not work.done():
                await asyncio.gather(work, return_exceptions=True)
            await tracked.aclose()
    if work.cancelled():
        return None
    return work.result()


def token(info: TokenInfo) -> wire.Token:
    return wire.Token(id=info.id, text=info.text, logprob=info.logprob, special=info.special)


def final_text(events: list[GenerationEvent]) -> str:
    final = events[-1]
    if final.generated_text is not None:
        return final.generated_text
    return "".join(e.token.text for e in events if not e.token.special)


def info_body(info: ModelInfo) -> dict:
    body = {
        "model_id": info.model_id,
        "model_sha": None,
        "model_dtype": info.model_dtype,
        "model_device_type": info.model_device_type,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": info.max_concurrent_requests,
        "max_best_of": info.max_best_of,
        "max_stop_sequences": info.max_stop_sequences,
        "max_input_tokens": info.max_input_tokens,
        "max_total_tokens": info.max_total_tokens,
        "max_batch_total_tokens": info.max_batch_total_tokens,
        "validation_workers": 1,  # validation runs in the API process
        "version": info.version,
        "tp_size": info.tp_size,
        "attention_backend": info.attention_backend,
        "max_top_n_tokens": info.max_top_n_tokens,
    }
    body.update(info.extra)
    return body


class TGIRoutes:
    """Handlers for TGI's routes; one instance per app."""

    def __init__(self, backend: EngineBackend, metrics: Metrics) -> None:
        self.backend = backend
        self.metrics = metrics

    async def start(self, req: wire.GenerateRequest, stream: bool) -> TrackedStream:
        if not self.backend.ready():
            raise NotReadyError("the model is still loading")
        wire.check_limits(req.parameters, self.backend.info())
        if stream:
            wire.check_streamable(req.parameters)
        return await self.metrics.open_stream(
            self.backend,
            req.inputs,
            wire.to_sampling_params(req.parameters),
            truncate=req.parameters.truncate,
        )

    async def generate(self, req: wire.GenerateRequest, request: Request) -> Response:
        events = await drain(request, await self.start(req, stream=False))
        if events is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return JSONResponse(self.response(req, events).model_dump(mode="json"))

    async def generate_stream(self, req: wire.GenerateRequest) -> EventStreamResponse:
        tracked = await self.start(req, stream=True)
        return EventStreamResponse(self._events(req, tracked), on_close=tracked.aclose)

    async def compat(self, req: wire.GenerateRequest, request: Request) -> Response:
        if req.stream:
            return await self.generate_stream(req)
        events = await drain(request, await self.start(req, stream=False))
        if events is None:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        # TGI's compat route answers a list, which text_generation.Client expects.
        return JSONResponse([self.response(req, events).model_dump(mode="json")])

    async def _events(
        self, req: wire.GenerateRequest, tracked: TrackedStream
    ) -> AsyncIterator[str]:
        try:
            async for event in tracked:
                yield sse(self.stream_event(req, event).model_dump_json())
        except Exception as exc:  # headers are sent: report the failure in-band, like TGI
            yield sse(wire.ErrorResponse(**error_body(exc)).model_dump_json())

    @staticmethod
    def response(req: wire.GenerateRequest, events: list[GenerationEvent]) -> wire.Response:
        p = req.parameters
        final = events[-1]
        text = final_text(events)
        if p.return_full_text:
            text = req.inputs + text
        if not p.details:
            return wire.Response(generated_text=text)
        prefill = [wire.InputToken(id=t.id, text=t.text, logprob=t.logprob) for t in final.prefill]
        top = [[token(t) for t in e.top_tokens or []] for e in events] if p.top_n_tokens else None
        details = wire.Details(
            finish_reason=final.finish_reason,
            generated_tokens=final.generated_tokens,
            seed=final.seed,
            prefill=prefill if p.decoder_input_details else [],
            tokens=[token(e.token) for e in events],
            top_tokens=top,
        )
        return wire.Response(generated_text=text, details=details)

    @staticmethod
    def stream_event(req: wire.GenerateRequest, event: GenerationEvent) -> wire.StreamResponse:
        out = wire.StreamResponse(
            token=token(event.token), top_tokens=[token(t) for t in event.top_tokens or []]
        )
        if event.finished:
            text = event.generated_text or ""
            out.generated_text = req.inputs + text if req.parameters.return_full_text else text
            if req.parameters.details:
                out.details = wire.StreamDetails(
                    finish_reason=event.finish_reason,
                    generated_tokens=event.generated_tokens,
                    seed=event.seed,
                )
        return out


def build_app(backend: EngineBackend) -> FastAPI:
    """The ASGI app serving TGI's and OpenAI's HTTP APIs over `backend`."""
    # Imported here: openai.py reuses this module's SSE/drain helpers.
    from tpserve.server.openai import openai_router

    metrics = Metrics()
    tgi = TGIRoutes(backend, metrics)
    app = FastAPI(title="tpserve", summary="TGI- and OpenAI-compatible text generation")
    app.state.backend = backend
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    stream_doc = {"description": "Server-Sent Events, one StreamResponse per token"}
    app.add_api_route("/generate", tgi.generate, methods=["POST"], response_model=wire.Response)
    app.add_api_route(
        "/generate_stream",
        tgi.generate_stream,
        methods=["POST"],
        response_class=EventStreamResponse,
        status_code=200,  # EventStreamResponse's __init__ has none for FastAPI to find
        responses={200: stream_doc},
    )
    app.add_api_route("/", tgi.compat, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        try:
            ready = backend.ready()
        except Exception:  # a backend that cannot answer is not healthy
            ready = False
        if not ready:
            raise NotReadyError("the model is not ready")
        return Response(status_code=200)

    @app.get("/info")
    async def info() -> dict:
        body = info_body(backend.info())
        replicas = getattr(backend, "replicas", None)
        if replicas is not None:  # several replicas behind this address (tpserve/serve/)
            body["replicas"] = replicas()
        return body

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = getattr(backend, "stats", None)
        if stats is not None:  # engine gauges are read at scrape time
            metrics.set_engine_stats(stats())
        replica_stats = getattr(backend, "replica_stats", None)
        if replica_stats is not None:
            metrics.set_replica_stats(replica_stats())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router(backend, metrics))
    return app

"""The HTTP front end: TGI's routes (this file) and OpenAI's (openai.py) over an EngineBackend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tpserve import protocol as wire
from tpserve.config import ServerConfig
from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, TokenInfo
from tpserve.errors import NotReadyError
from tpserve.server.backend import EngineBackend, not_ready_message
from tpserve.server.best_of import best_index, candidate_jobs
from tpserve.server.errors import error_body, install_error_handlers
from tpserve.server.fanout import check_fanout, open_all
from tpserve.server.head import HeadAsGetMiddleware
from tpserve.server.metrics import Metrics, MetricsMiddleware, TrackedStream
from tpserve.server.openai import openai_router
from tpserve.server.paths import TrailingSlashMiddleware
from tpserve.server.reasoning_format import ReasoningParser
from tpserve.server.responses import responses_router
from tpserve.server.responses_store import ResponseStore
from tpserve.server.security import (
    ALWAYS_PUBLIC,
    APIKeyMiddleware,
    BodyBudget,
    BodyLimitMiddleware,
    HostCheckMiddleware,
)
from tpserve.server.streaming import (
    AnswerResponse,
    EventStreamResponse,
    collect_all_or_abort,
    final_text,
    sse,
)
from tpserve.server.tokenize import tokenize_router


def token(info: TokenInfo) -> wire.Token:
    return wire.Token(id=info.id, text=info.text, logprob=info.logprob, special=info.special)


def token_body(info: TokenInfo) -> dict:
    """wire.Token's JSON form, as plain data."""
    return {"id": info.id, "text": info.text, "logprob": info.logprob, "special": info.special}


def info_body(info: ModelInfo, max_best_of: int) -> dict:
    body = {
        "model_id": info.model_id,
        "model_sha": None,
        "model_dtype": info.model_dtype,
        "model_device_type": info.model_device_type,
        # The hub's tag: T5-like models are text2text-generation there.
        "model_pipeline_tag": ("text2text-generation" if info.encoder_decoder
                               else "text-generation"),
        "max_concurrent_requests": info.max_concurrent_requests,
        "max_best_of": max_best_of,  # the HTTP front end's --max-best-of
        "max_stop_sequences": info.max_stop_sequences,
        "max_input_tokens": info.max_input_tokens,
        "max_total_tokens": info.max_total_tokens,
        "max_batch_total_tokens": info.max_batch_total_tokens,
        "validation_workers": 1,  # validation runs in the API process
        # TGI's bound on the prompts of one request; here the sequences a request may fan
        # out to (prompts x n or best_of) are bounded by what runs at once (fanout.py).
        "max_client_batch_size": info.max_concurrent_requests,
        "router": "tpserve",  # TGI answers "text-generation-router": who serves the routes
        "version": info.version,
        "tp_size": info.tp_size,
        "attention_backend": info.attention_backend,
        "max_top_n_tokens": info.max_top_n_tokens,
        "encoder_decoder": info.encoder_decoder,
    }
    body.update(info.extra)
    return body


class TGIRoutes:
    """Handlers for TGI's routes; one instance per app."""

    def __init__(self, backend: EngineBackend, metrics: Metrics, max_best_of: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_best_of = max_best_of

    async def start(self, req: wire.GenerateRequest, stream: bool) -> list[TrackedStream]:
        """The request's started engine streams: one, or `best_of` candidates."""
        if not self.backend.ready():
            raise NotReadyError(not_ready_message(self.backend))
        p = req.parameters
        info = self.backend.info()
        wire.check_limits(p, info)
        if stream:
            wire.check_streamable(p)
        n = wire.check_best_of(p, self.max_best_of)
        params = wire.to_sampling_params(p, info)
        if n == 1:  # the common case: no task per stream
            return [await self.metrics.open_stream(self.backend, req.inputs, params,
                                                   truncate=p.truncate)]
        check_fanout(n, f"`best_of` = {n}", "candidates", info)
        return await open_all(self.metrics, self.backend,
                              candidate_jobs(req.inputs, params, n), truncate=p.truncate)

    async def generate(self, req: wire.GenerateRequest, request: Request) -> Response:
        answer = await self._answer(req, request)
        return answer if isinstance(answer, Response) else AnswerResponse(answer)

    async def generate_stream(self, req: wire.GenerateRequest) -> EventStreamResponse:
        [tracked] = await self.start(req, stream=True)
        return EventStreamResponse(self._events(req, tracked), on_close=tracked.aclose)

    async def compat(self, req: wire.GenerateRequest, request: Request) -> Response:
        if req.stream:
            return await self.generate_stream(req)
        answer = await self._answer(req, request)
        # TGI's compat route answers a list, which text_generation.Client expects.
        return answer if isinstance(answer, Response) else AnswerResponse([answer])

    async def _answer(self, req: wire.GenerateRequest, request: Request) -> dict | Response:
        """The whole answer's body, or a 499 response if the client left first (every
        candidate is aborted then)."""
        candidates = await collect_all_or_abort(request, await self.start(req, stream=False))
        if isinstance(candidates, Response):
            return candidates
        if len(candidates) == 1:
            return self.response(req, candidates[0])
        best = best_index(candidates)
        others = [c for i, c in enumerate(candidates) if i != best]
        return self.response(req, candidates[best], others)

    async def _events(
        self, req: wire.GenerateRequest, tracked: TrackedStream
    ) -> AsyncIterator[str]:
        try:
            async for event in tracked:
                yield sse(self.stream_event(req, event).model_dump_json())
        except Exception as exc:  # headers are sent: report the failure in-band, like TGI
            yield sse(wire.ErrorResponse(**error_body(exc)).model_dump_json())

    @staticmethod
    def response(req: wire.GenerateRequest, events: list[GenerationEvent],
                 others: Sequence[list[GenerationEvent]] = ()) -> dict:
        """The body of a /generate answer for AnswerResponse: wire.Response's JSON form,
        built as plain data and TokenInfo dataclasses (pydantic models cost four times as
        much with one Token per generated token, and every request of a burst finishes at
        about the same time; tests hold the encoded body to the wire model's shape).
        `others`: the `best_of` candidates not answered, listed in the details."""
        text = TGIRoutes._text(req, events)
        # As TGI: decoder_input_details alone asks for the details too (it lives in them).
        if not (req.parameters.details or req.parameters.decoder_input_details):
            return {"generated_text": text}
        details = TGIRoutes._details(req, events)
        if others:
            details["best_of_sequences"] = [
                {"generated_text": TGIRoutes._text(req, c), **TGIRoutes._details(req, c)}
                for c in others]
        return {"generated_text": text, "details": details}

    @staticmethod
    def _text(req: wire.GenerateRequest, events: list[GenerationEvent]) -> str:
        text = final_text(events)
        return req.inputs + text if req.parameters.return_full_text else text

    @staticmethod
    def _details(req: wire.GenerateRequest, events: list[GenerationEvent]) -> dict:
        """One sequence's details (wire.Details' fields but best_of_sequences)."""
        p = req.parameters
        final = events[-1]
        details = {
            "finish_reason": final.finish_reason,
            "generated_tokens": final.generated_tokens,
            "seed": final.seed,
            "prefill": [{"id": t.id, "text": t.text, "logprob": t.logprob}
                        for t in final.prefill] if p.decoder_input_details else [],
            # TokenInfo as it is: a dataclass with wire.Token's fields in order, which
            # orjson writes itself (AnswerResponse) at a third of the cost of a dict per
            # token built here, and every request of a burst is answered in its last steps.
            "tokens": [e.token for e in events],
        }
        if p.top_n_tokens:
            details["top_tokens"] = [e.top_tokens or [] for e in events]
        return details

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
                    input_length=event.prompt_tokens,
                )
        return out


def build_app(backend: EngineBackend, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving TGI's and OpenAI's HTTP APIs over `backend`."""
    config = config or ServerConfig()
    metrics = Metrics(request_timeout_s=config.request_timeout_s)
    tgi = TGIRoutes(backend, metrics, config.max_best_of)
    app = FastAPI(title="tpserve", summary="TGI- and OpenAI-compatible text generation")
    app.state.backend = backend
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(HeadAsGetMiddleware)  # innermost: metrics and logs see HEAD
    # Added last = outermost: keys are checked first, then the body limits, then metrics.
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    budget = BodyBudget(config.body_budget_bytes)
    metrics.body_bytes.set_function(lambda: budget.held)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, budget=budget)
    public = ALWAYS_PUBLIC | ({"/metrics"} if config.metrics_public else set())
    app.add_middleware(APIKeyMiddleware, keys=config.api_keys, public=frozenset(public))
    if not config.api_keys:  # an open server: guard it against DNS rebinding
        app.add_middleware(HostCheckMiddleware.from_env)
    app.add_middleware(TrailingSlashMiddleware)  # outermost: every check sees the routed path

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

    # HEAD too, as on every GET route (server/head.py): uptime monitors probe with it.
    @app.get("/health")
    async def health() -> Response:
        replica_health = getattr(backend, "replica_health", None)
        if replica_health is not None:  # several replicas (tpserve/serve/): with the counts
            body = replica_health()
            return JSONResponse(body, status_code=503 if "error" in body else 200)
        try:
            ready = backend.ready()
        except Exception:  # a backend that cannot answer is not healthy
            ready = False
        if not ready:  # with why: loading, draining, rebuilding a lost shard, given up
            raise NotReadyError(not_ready_message(backend))
        return Response(status_code=200)

    @app.get("/info")
    async def info() -> dict:
        body = info_body(backend.info(), config.max_best_of)
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

    # One per app: `auto` reads the vocabulary once for chat and the Responses API.
    reasoning = None if config.reasoning_parser == "none" else \
        ReasoningParser(config.reasoning_parser, backend)
    app.include_router(openai_router(backend, metrics, config.tool_call_parser, reasoning,
                                     config.max_best_of))
    # One store per app: with replicas on Ray Serve, the one ingress process holds it.
    store = ResponseStore(config.responses_store_size, config.responses_store_mb * 2**20,
                          config.responses_store_ttl_s)
    app.state.responses_store = store
    app.include_router(responses_router(backend, metrics, store, config.tool_call_parser,
                                        reasoning))
    app.include_router(tokenize_router(backend))
    return app

"""Prometheus metrics, and the instrumented path every route takes into the backend.

Each app gets its own CollectorRegistry so several apps (tests, multi-model hosts) can
live in one process without "duplicated timeseries" errors.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import GenerationError, RequestTimeoutError
from tpserve.server.backend import EngineBackend
from tpserve.server.errors import as_tpserve_error

T = TypeVar("T")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The app's Prometheus metrics; `open_stream` is every route's way into the backend,
    where the per-request deadline (`request_timeout_s`, counted from the hand-over to the
    backend, queueing included) is enforced."""

    def __init__(self, request_timeout_s: float | None = None) -> None:
        self.request_timeout_s = request_timeout_s
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tpserve_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "tpserve_http_request_duration_seconds",
            "Time from request to the last byte of the response, streams included",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "tpserve_requests_inflight",
            "Requests handed to the backend (queued or running), not finished",
            registry=r,
        )
        self.body_bytes = Gauge(
            "tpserve_http_request_body_bytes",
            "Bytes of request bodies held at once, received or arriving "
            "(429 past --max-body-bytes-in-flight)",
            registry=r,
        )
        self.generated_tokens = Counter(
            "tpserve_generated_tokens", "Tokens generated and sent to clients", registry=r
        )
        self.prompt_tokens = Counter(
            "tpserve_prompt_tokens", "Prompt tokens of finished generations", registry=r
        )
        self.ttft = Histogram(
            "tpserve_time_to_first_token_seconds",
            "Time from handing a request to the backend to its first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )

        self.engine = Gauge(
            "tpserve_engine",
            "Engine state at scrape time: running/waiting sequences, KV blocks, steps",
            ["stat"],
            registry=r,
        )

        self.replica = Gauge(
            "tpserve_replica",
            "Per-replica state at scrape time (several replicas on Ray Serve): requests, "
            "tokens/s, KV blocks, prefix-cache hits",
            ["replica", "stat"],
            registry=r,
        )

    def set_engine_stats(self, stats: dict[str, float]) -> None:
        for name, value in stats.items():
            self.engine.labels(stat=name).set(value)

    def set_replica_stats(self, per_replica: dict[str, dict[str, float]]) -> None:
        """Replace the per-replica gauges: a replica that is gone disappears from /metrics."""
        self.replica.clear()
        for replica, stats in per_replica.items():
            for name, value in stats.items():
                self.replica.labels(replica=replica, stat=name).set(value)

    async def open_stream(
        self,
        backend: EngineBackend,
        prompt: str,
        params: SamplingParams,
        truncate: int | None = None,
        add_special_tokens: bool = True,
    ) -> TrackedStream:
        """Start a generation and wait for its first event.

        Waiting here, before any response byte is sent, lets validation/overload errors
        (raised by the backend at the call or at the first event) become real HTTP
        statuses instead of SSE error events.
        """
        start = time.perf_counter()
        deadline = Deadline(self.request_timeout_s)
        stream: AsyncIterator[GenerationEvent] | None = None
        self.inflight.inc()  # queued requests count too; TrackedStream.aclose() undoes it
        try:
            stream = backend.generate(
                prompt, params, truncate=truncate, add_special_tokens=add_special_tokens
            )
            if inspect.isawaitable(stream):  # tolerate an `async def` returning the iterator
                stream = await stream
            first = await deadline.run(anext(stream))
        except BaseException as exc:  # includes cancellation while queued
            self.inflight.dec()
            if stream is not None:
                await _close(stream)  # the backend must drop the request
            if isinstance(exc, StopAsyncIteration):
                raise GenerationError("the engine finished the request without an event") from None
            if isinstance(exc, Exception):
                raise as_tpserve_error(exc) from exc
            raise
        self.ttft.observe(time.perf_counter() - start)
        return TrackedStream(self, stream, first, deadline)


class TrackedStream:
    """A started generation: iterate for events (first included), always `aclose()`."""

    def __init__(
        self,
        metrics: Metrics,
        stream: AsyncIterator[GenerationEvent],
        first: GenerationEvent,
        deadline: Deadline | None = None,
    ) -> None:
        self._metrics = metrics
        self._deadline = deadline or Deadline(None)
        self._stream = stream
        self._first: GenerationEvent | None = first
        self._closed = False
        # False where the tokens are not sent (prompt_only's dropped token): the counter
        # says "sent to clients".
        self.counts_tokens = True

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[GenerationEvent]:
        event, self._first = self._first, None
        while event is not None:
            if self.counts_tokens:
                self._metrics.generated_tokens.inc()
            if event.finished:
                self._metrics.prompt_tokens.inc(event.prompt_tokens)
                yield event
                return
            yield event
            try:
                event = await self._deadline.run(anext(self._stream))
            except StopAsyncIteration:
                raise GenerationError("the engine ended the stream without a final event") from None
            except Exception as exc:
                raise as_tpserve_error(exc) from exc

    async def collect(self) -> list[GenerationEvent]:
        """Every event, the first included, in one list (a non-streamed answer). A backend
        stream with `rest()` (tpserve.engine.async_engine.EngineStream) hands over the
        remainder at once, waking this task once instead of once per token."""
        rest = getattr(self._stream, "rest", None)
        if rest is None:
            return [event async for event in self]
        first, self._first = self._first, None
        if first is None:
            raise GenerationError("the stream was already read")
        events = [first]
        if not first.finished:
            try:
                events += await self._deadline.run(rest())
            except Exception as exc:
                raise as_tpserve_error(exc) from exc
            if not events[-1].finished:
                raise GenerationError("the engine ended the stream without a final event")
        if self.counts_tokens:
            self._metrics.generated_tokens.inc(len(events))
        self._metrics.prompt_tokens.inc(events[-1].prompt_tokens)
        return events

    async def aclose(self) -> None:
        """Idempotent; closing the backend iterator early is how the engine aborts."""
        if self._closed:
            return
        self._closed = True
        self._metrics.inflight.dec()
        await _close(self._stream)


_timeout_at = getattr(asyncio, "timeout_at", None)


class Deadline:
    """A request's time limit, started when it is handed to the backend; `run` awaits within
    what is left of it."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    async def run(self, step: Awaitable[T]) -> T:
        if self.at is None:
            return await step
        left = max(0.0, self.at - time.monotonic())
        try:
            # Cancelling the backend's iterator on expiry is what aborts the request.
            if _timeout_at is None:  # Python 3.10
                return await asyncio.wait_for(step, left)
            # One timer per call, no task: this runs once per generated token.
            async with _timeout_at(asyncio.get_running_loop().time() + left):
                return await step
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            raise RequestTimeoutError(
                f"the request did not finish within the server's limit of {self.seconds:g} s "
                "(--request-timeout) and was aborted"
            ) from None


async def _close(stream: AsyncIterator[GenerationEvent]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    # Shielded: we often get here because the request task is being cancelled, and the
    # abort must still reach the engine.
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except RuntimeError:  # "already running": the running owner will finish it
            pass


class MetricsMiddleware:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which buffers and breaks disconnects).

    Counts requests by route template and status, and times them to the end of the body.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            # The router stores the matched route in the shared scope; using its template
            # (not the raw path) keeps label cardinality bounded.
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route=route, status=str(status)).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - start)

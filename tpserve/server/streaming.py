"""Response helpers shared by the TGI and OpenAI routes: SSE framing, the SSE response that
always aborts an unread generation, "collect the whole generation (or several, side by side)
or abort with 499", and several streams read as one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tpserve.engine.request import GenerationEvent
from tpserve.server.metrics import TrackedStream

try:  # a dependency; the standard library's encoder stands in if it is missing
    import orjson
except ImportError:  # tests/test_answer_response.py runs this path too
    orjson = None

# nginx's "client closed request": never seen by the client, but visible in metrics.
CLIENT_CLOSED_STATUS = 499


class AnswerResponse(JSONResponse):
    """A whole generation's JSON answer, encoded by orjson. With details on, a /generate
    answer holds a dict per token; json.dumps took ~0.2 ms for 256 of them (on this project's
    CPU machine; the H200 host's CPU is slower), and every request of a burst is
    answered within the last ~17 steps, so the encoding sat on the burst's critical path
    (the last response came 0.2-0.3 s after the last step on one H200). orjson writes the
    same JSON ~10x faster; a NaN or infinite log-probability becomes null (JSON has
    neither; the standard encoder, as Starlette calls it, refused them with an error).
    numpy scalars and other int/float subclasses are written as their values, as the
    standard encoder did for numpy.float64."""

    def render(self, content) -> bytes:
        if orjson is None:
            return super().render(_finite_or_none(content))
        return orjson.dumps(content, default=_plain, option=orjson.OPT_SERIALIZE_NUMPY)


def _plain(obj):
    """What orjson does not take itself: int and float subclasses as plain numbers."""
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _finite_or_none(obj):
    """obj with every NaN or infinite float replaced by None (what orjson writes for it),
    and dataclass instances as dicts of their fields (as orjson writes them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _finite_or_none(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def sse(payload: dict | str, space: bool = False) -> str:
    """One SSE event. TGI writes `data:` with no space, OpenAI `data: `; parsers accept both.
    A NaN or infinite number (a log-probability of a filtered token) is written as null, as
    in whole answers: json.dumps would write -Infinity, which is not JSON. A JSON string given
    as it is gets U+2028, U+2029 and U+0085 escaped: JSON allows them raw, but clients that
    read the stream with str.splitlines() or httpx's iter_lines() end a line at each."""
    if isinstance(payload, str):
        data = (payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
                .replace("\x85", "\\u0085"))
    else:  # json.dumps escapes every non-ASCII character
        data = json.dumps(_finite_or_none(payload), separators=(",", ":"))
    return f"data: {data}\n\n" if space else f"data:{data}\n\n"


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


async def collect_all_or_abort(
    request: Request, streams: Sequence[TrackedStream]
) -> list[list[GenerationEvent]] | Response:
    """Every stream's events, collected side by side (the choices of one OpenAI request, the
    `best_of` candidates of a TGI one), or a 499 response if the client leaves first. A
    failing stream fails the request and aborts the others; every stream is closed on the
    way out."""

    async def collect(tracked: TrackedStream) -> list[GenerationEvent]:
        return await tracked.collect()

    async def collect_all() -> list[list[GenerationEvent]]:
        if len(streams) == 1:  # the common case: no task per stream
            return [await collect(streams[0])]
        tasks = [asyncio.ensure_future(collect(t)) for t in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed or we were cancelled: stop the rest before closing them
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def client_gone() -> None:
        # The body was already read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect_all())
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
            for tracked in streams:
                await tracked.aclose()
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return work.result()


async def merged(streams: Sequence[TrackedStream]
                 ) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """(index, event) from several streams as they come (the choices of one streamed OpenAI
    request); the first error ends it. One stream is read directly."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, tracked: TrackedStream) -> None:
        try:
            async for event in tracked:
                await queue.put((i, event))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which re-raises
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:  # stop the readers before the caller closes the streams
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def final_text(events: list[GenerationEvent]) -> str:
    final = events[-1]
    if final.generated_text is not None:
        return final.generated_text
    return "".join(e.token.text for e in events if not e.token.special)

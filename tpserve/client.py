"""Python clients for tpserve's (and TGI's) /generate API, mirroring text_generation.Client.

Parameters are validated locally with the same pydantic models the server uses, so a
bad argument fails before any network round trip with the server's wording. Every failure is
a tpserve.errors.TPServeError: the server's answers as in docs/http_api.md, and no answer at
all as ServerUnreachableError or ClientTimeoutError below.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pydantic

from tpserve import protocol as wire
from tpserve.errors import (
    GenerationError,
    NotReadyError,
    OverloadedError,
    RequestTimeoutError,
    ShardLostError,
    TPServeError,
    UnauthorizedError,
    ValidationError,
)


class ServerUnreachableError(TPServeError, ConnectionError):
    """No connection to the server (refused, unknown host, connect timeout), or the
    connection was lost before the answer ended. Nothing came back from tpserve itself."""

    error_type = "unreachable"


class ClientTimeoutError(RequestTimeoutError, TimeoutError):
    """The server sent nothing for `timeout` seconds (Client(timeout=...)); the client gave
    up and closed the connection, which aborts the request on the server."""

_ERRORS: dict[str, type[TPServeError]] = {
    "validation": ValidationError,
    "overloaded": OverloadedError,
    "unhealthy": NotReadyError,
    "unauthorized": UnauthorizedError,
    "timeout": RequestTimeoutError,
    "shard_lost": ShardLostError,
}
_STATUS_ERRORS: dict[int, type[TPServeError]] = {
    401: UnauthorizedError,
    413: ValidationError,
    422: ValidationError,
    429: OverloadedError,
    503: NotReadyError,
}


def _error_from(status: int, payload: Any, fallback_text: str = "") -> TPServeError:
    """Turn a server error body into the matching tpserve.errors instance."""
    if isinstance(payload, dict) and "error" in payload:
        cls = _ERRORS.get(payload.get("error_type", ""), _STATUS_ERRORS.get(status))
        return (cls or GenerationError)(str(payload["error"]))
    # Not one of ours (e.g. a proxy's HTML page): keep the start of it for the message.
    detail = fallback_text.strip()[:500]
    cls = _STATUS_ERRORS.get(status, GenerationError)
    return cls(f"HTTP {status}: {detail}" if detail else f"HTTP {status}")


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code == 200:
        return
    try:
        payload = resp.json()
    except ValueError:
        payload = None
    exc = _error_from(resp.status_code, payload, resp.text)
    # The answer's own status and Retry-After, not the class's defaults: a 413 is a
    # ValidationError too, and a proxy in front may ask for a longer wait.
    exc.status_code = resp.status_code
    exc.retry_after = _retry_after_seconds(resp.headers.get("retry-after", ""))
    raise exc


def _retry_after_seconds(value: str) -> int | None:
    """Retry-After as whole seconds from now: delay-seconds, or an HTTP-date (RFC 9110
    10.2.3; what proxies and load balancers in front of a server often send), rounded up;
    None when absent or unreadable."""
    value = value.strip()
    if value.isdigit():
        return int(value)
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0, math.ceil(when.timestamp() - time.time()))


class _LineSplitter:
    """SSE lines from text chunks, ended by \\n (a \\r before it dropped) only: a TGI server
    writes U+2028, U+2029 and U+0085 raw inside its JSON, where str.splitlines() and
    httpx's iter_lines() would end a line."""

    def __init__(self) -> None:
        self._rest = ""

    def feed(self, chunk: str) -> list[str]:
        *lines, self._rest = (self._rest + chunk).split("\n")
        return [line.removesuffix("\r") for line in lines]

    def end(self) -> list[str]:
        rest, self._rest = self._rest, ""
        return [rest.removesuffix("\r")] if rest else []


@contextmanager
def _transport_errors(base_url: str, timeout: float | None) -> Iterator[None]:
    """httpx's transport errors as tpserve errors that name the server and what to do."""
    try:
        yield
    except httpx.TransportError as exc:
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            raise ClientTimeoutError(
                f"{base_url} sent nothing for {timeout} s (Client timeout={timeout}): the "
                "request was abandoned; give a longer timeout (None waits forever) or ask for "
                "fewer tokens") from exc
        if isinstance(exc, httpx.ConnectTimeout):
            why = (f"could not connect to {base_url} within {timeout} s: check the address "
                   "and that the server's host is reachable")
        elif isinstance(exc, httpx.ConnectError):
            why = (f"cannot connect to {base_url} ({exc}): is `tpserve launch` running "
                   "there? It prints the address it serves on once ready")
        else:
            why = (f"the connection to {base_url} failed before the answer ended "
                   f"({type(exc).__name__}: {exc})")
        raise ServerUnreachableError(why) from exc


def _lines(chunks: Iterator[str]) -> Iterator[str]:
    split = _LineSplitter()
    for chunk in chunks:
        yield from split.feed(chunk)
    yield from split.end()


async def _alines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    split = _LineSplitter()
    async for chunk in chunks:
        for line in split.feed(chunk):
            yield line
    for line in split.end():
        yield line


def _parse_event(line: str) -> wire.StreamResponse | None:
    """One SSE line -> StreamResponse; raises the server's in-band error events."""
    if not line.startswith("data:"):
        return None  # blank separators, comments, other SSE fields
    text = line[len("data:") :]
    try:
        payload = json.loads(text)
    except ValueError:
        raise _not_ours("an event", text) from None
    if isinstance(payload, dict) and "error" in payload:
        raise _error_from(200, payload)
    return _validated(wire.StreamResponse, payload, "an event", text)


def _answer(resp: httpx.Response, model: type[pydantic.BaseModel] | None = None) -> Any:
    """A 200 answer's JSON (as `model`). Not one of tpserve's (a proxy's or captive portal's
    page, another server at the address) is a GenerationError, as the module promises, not
    a JSONDecodeError or pydantic's ValidationError."""
    _raise_for(resp)
    try:
        payload = resp.json()
    except ValueError:
        raise _not_ours("an answer", resp.text) from None
    return payload if model is None else _validated(model, payload, "an answer", resp.text)


def _validated(model: type[pydantic.BaseModel], payload: Any, what: str, text: str):
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError:
        raise _not_ours(what, text) from None


def _not_ours(what: str, text: str) -> GenerationError:
    return GenerationError(f"the server sent {what} that is not tpserve's (or TGI's): "
                           f"{' '.join(text.split())[:200]!r}; check that the address is "
                           "tpserve's, not a proxy's or another server's")


def _body(prompt: str, stream: bool, **params: Any) -> dict[str, Any]:
    stop = params.pop("stop_sequences", None)
    try:
        request = wire.GenerateRequest(
            inputs=prompt,
            stream=stream,
            parameters=wire.GenerateParameters(details=True, stop=stop or [], **params),
        )
    except pydantic.ValidationError as exc:
        raise ValidationError(wire.describe_errors(exc.errors())) from None
    # exclude_none keeps the body small and lets the server apply its own defaults.
    return request.model_dump(mode="json", exclude_none=True)


def _tokenize_body(prompt: str, add_special_tokens: bool) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"add_special_tokens": add_special_tokens}}


class _Base:
    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        cookies: dict[str, str] | None = None,
        timeout: float | None = 10,
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, as in "
                             f"'http://{base_url}' (got {base_url!r})")
        self.base_url = base_url.rstrip("/")
        if api_key is not None:  # the server's --api-key / TPSERVE_API_KEY
            headers = {**(headers or {}), "Authorization": f"Bearer {api_key}"}
        self.headers = headers
        self.cookies = cookies
        self.timeout = timeout

    def _client_kwargs(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "headers": self.headers,
            "cookies": self.cookies,
            "timeout": self.timeout,
        }


class Client(_Base):
    """Synchronous client. Keeps one connection pool; use as a context manager or close().

    base_url: the server's address (`http://HOST:PORT`). timeout: seconds to wait for the
    connection and for each piece of the answer (a non-streamed answer comes whole, so it
    bounds the whole generation); None waits forever. api_key: sent as `Authorization:
    Bearer KEY` (the server's --api-key).
    """

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        cookies: dict[str, str] | None = None,
        timeout: float | None = 10,
        api_key: str | None = None,
    ) -> None:
        super().__init__(base_url, headers, cookies, timeout, api_key)
        self._http = httpx.Client(**self._client_kwargs())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def health(self) -> bool:
        """True when the server answers /health with 200 (model loaded)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def info(self) -> dict[str, Any]:
        """GET /info: the model, its limits and the deployment (tp_size, device...)."""
        with _transport_errors(self.base_url, self.timeout):
            resp = self._http.get("/info")
        return _answer(resp)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[dict[str, Any]]:
        """POST /tokenize: the prompt's tokens as generation counts them, each
        {"id", "text", "start", "stop"} (character offsets into `prompt`)."""
        with _transport_errors(self.base_url, self.timeout):
            resp = self._http.post("/tokenize", json=_tokenize_body(prompt, add_special_tokens))
        return _answer(resp)

    def generate(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        best_of: int | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        decoder_input_details: bool = False,
        top_n_tokens: int | None = None,
        grammar: Any = None,
        adapter_id: str | None = None,
    ) -> wire.Response:
        """Generate a completion of `prompt`; the result always carries `details`. adapter_id:
        a LoRA adapter the server serves (`tpserve launch --lora-modules`), None: the model.

        Raises tpserve.errors.ValidationError (bad arguments, checked here first, or 422),
        OverloadedError (429), NotReadyError (503) and the others of docs/http_api.md with
        the server's message, the answer's status (exc.status_code) and its Retry-After
        seconds (exc.retry_after); ServerUnreachableError / ClientTimeoutError without an
        answer.
        """
        body = _body(prompt, False, **_params(locals()))
        with _transport_errors(self.base_url, self.timeout):
            resp = self._http.post("/generate", json=body)
        return _answer(resp, wire.Response)

    def generate_stream(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        top_n_tokens: int | None = None,
        grammar: Any = None,
        adapter_id: str | None = None,
    ) -> Iterator[wire.StreamResponse]:
        """Yield one StreamResponse per token; the last has generated_text and details.

        Stopping the iteration early closes the connection, which aborts the request. Errors
        as generate(); one the server reports mid-stream raises where it arrives.
        """
        body = _body(prompt, True, **_params(locals()))
        with (
            _transport_errors(self.base_url, self.timeout),
            self._http.stream("POST", "/generate_stream", json=body) as resp,
        ):
            if resp.status_code != 200:
                resp.read()
                _raise_for(resp)
            for line in _lines(resp.iter_text()):
                event = _parse_event(line)
                if event is not None:
                    yield event


class AsyncClient(_Base):
    """Asynchronous client with the same methods as Client (awaitable / async-iterable).

    Each call opens its own httpx.AsyncClient, like text_generation.AsyncClient: a pool
    would be bound to the event loop of its first use and break under a second
    asyncio.run().
    """

    async def health(self) -> bool:
        """True when the server answers /health with 200 (model loaded)."""
        try:
            async with httpx.AsyncClient(**self._client_kwargs()) as http:
                return (await http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def info(self) -> dict[str, Any]:
        """GET /info: the model, its limits and the deployment (tp_size, device...)."""
        with _transport_errors(self.base_url, self.timeout):
            async with httpx.AsyncClient(**self._client_kwargs()) as http:
                resp = await http.get("/info")
        return _answer(resp)

    async def tokenize(self, prompt: str, add_special_tokens: bool = True
                       ) -> list[dict[str, Any]]:
        """POST /tokenize: the prompt's tokens as generation counts them, each
        {"id", "text", "start", "stop"} (character offsets into `prompt`)."""
        with _transport_errors(self.base_url, self.timeout):
            async with httpx.AsyncClient(**self._client_kwargs()) as http:
                resp = await http.post("/tokenize",
                                       json=_tokenize_body(prompt, add_special_tokens))
        return _answer(resp)

    async def generate(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        best_of: int | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        decoder_input_details: bool = False,
        top_n_tokens: int | None = None,
        grammar: Any = None,
        adapter_id: str | None = None,
    ) -> wire.Response:
        """As Client.generate."""
        body = _body(prompt, False, **_params(locals()))
        with _transport_errors(self.base_url, self.timeout):
            async with httpx.AsyncClient(**self._client_kwargs()) as http:
                resp = await http.post("/generate", json=body)
        return _answer(resp, wire.Response)

    async def generate_stream(
        self,
        prompt: str,
        do_sample: bool = False,
        max_new_tokens: int = 20,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        top_n_tokens: int | None = None,
        grammar: Any = None,
        adapter_id: str | None = None,
    ) -> AsyncIterator[wire.StreamResponse]:
        """As Client.generate_stream."""
        body = _body(prompt, True, **_params(locals()))
        with _transport_errors(self.base_url, self.timeout):
            async with (
                httpx.AsyncClient(**self._client_kwargs()) as http,
                http.stream("POST", "/generate_stream", json=body) as resp,
            ):
                if resp.status_code != 200:
                    await resp.aread()
                    _raise_for(resp)
                async for line in _alines(resp.aiter_text()):
                    event = _parse_event(line)
                    if event is not None:
                        yield event


def _params(arguments: dict[str, Any]) -> dict[str, Any]:
    """A method's keyword arguments, minus `self` and the prompt. `grammar` may be a dict,
    tpserve.structured.Grammar or text_generation's Grammar (its type and value are read)."""
    out = {k: v for k, v in arguments.items() if k not in ("self", "prompt")}
    g = out.get("grammar")
    if g is not None and not isinstance(g, dict):
        kind = getattr(g, "type", None)
        out["grammar"] = {"type": getattr(kind, "value", kind), "value": getattr(g, "value", None)}
    return out

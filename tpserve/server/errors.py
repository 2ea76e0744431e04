"""Map every failure to TGI's error body `{"error": ..., "error_type": ...}`.

TGI clients (text_generation.Client, tpserve.Client) dispatch on `error_type`, so all
routes, including FastAPI's own request validation and 404s, use this one shape.

Bodies never carry internals: a failure that is not one of ours is "internal error" with
an id that the server log repeats next to the traceback, and every message is scrubbed of
tracebacks, local paths, addresses, pids and terminal colour codes before it is sent.
"""

from __future__ import annotations

import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tpserve.errors import (
    GenerationError,
    NotReadyError,
    OverloadedError,
    RequestTimeoutError,
    ShardLostError,
    TPServeError,
)
from tpserve.protocol import describe_errors

logger = logging.getLogger("tpserve.server")

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-@~+]+){2,}[\\/]?")
_IPV4 = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")
_IPV6 = re.compile(r"\b(?:[0-9a-fA-F]{1,4}:){2,7}[0-9a-fA-F]{0,4}\b")
_PID = re.compile(r"\b(pid)[=: ]+\d+", re.IGNORECASE)
# Ray actor / node / task ids: hex with a letter, so that a decimal number in a 422 (the seed's
# bound 18446744073709551615, a logit_bias key) is not one.
_HEX_ID = re.compile(r"\b(?=[0-9]*[a-f])[0-9a-f]{16,}\b")
_MAX_MESSAGE = 2000
_EXPLAINED = (NotReadyError, RequestTimeoutError, ShardLostError)


def _unless_route(match: re.Match) -> str:
    # The server's own routes are named in messages ("use /v1/completions or /generate").
    return match.group(0) if match.group(0).startswith("/v1/") else "<path>"


def public_message(text: str, internal: bool) -> str:
    """What may be shown to a client of `text`. `internal` (5xx) keeps only the first line,
    since exception messages of other libraries often embed a remote traceback."""
    text = _ANSI.sub("", text)
    if internal:
        text = text.split("Traceback (most recent call last)")[0].strip()
        text = text.splitlines()[0] if text else ""
    text = _PATH.sub(_unless_route, text)
    text = _IPV4.sub("<address>", text)
    text = _IPV6.sub("<address>", text)
    text = _PID.sub(r"\1 <n>", text)
    text = _HEX_ID.sub("<id>", text)
    text = " ".join(text.split())  # no newlines or control characters
    return text[:_MAX_MESSAGE]


def error_body(exc: BaseException) -> dict[str, str]:
    """The JSON error object for an exception (also used for mid-stream SSE errors)."""
    if isinstance(exc, TPServeError) and exc.status_code < 500:
        return {"error": public_message(str(exc), False) or type(exc).__name__,
                "error_type": exc.error_type}
    if isinstance(exc, _EXPLAINED):  # server-side, but the message is the explanation
        return {"error": public_message(str(exc), True) or type(exc).__name__,
                "error_type": exc.error_type}
    error_type = exc.error_type if isinstance(exc, TPServeError) else GenerationError.error_type
    summary = public_message(str(exc), True) if isinstance(exc, TPServeError) else ""
    message = f"internal error {_logged_id(exc)}" + (f": {summary}" if summary else "")
    return {"error": message, "error_type": error_type}


def _logged_id(exc: BaseException) -> str:
    """The id under which `exc` is (once) logged in full, for the client to quote."""
    error_id = getattr(exc, "error_id", None)
    if error_id is None:
        error_id = uuid.uuid4().hex[:12]
        logger.error("internal error %s: %s: %s", error_id, type(exc).__name__, exc,
                     exc_info=exc if exc.__traceback__ is not None else None)
        try:
            exc.error_id = error_id  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__
            pass
    return error_id


def error_response(exc: BaseException) -> JSONResponse:
    status = exc.status_code if isinstance(exc, TPServeError) else 500
    wait = exc.retry_after if isinstance(exc, TPServeError) else None
    headers = {"Retry-After": str(wait)} if wait is not None else None
    return JSONResponse(error_body(exc), status_code=status, headers=headers)


def as_tpserve_error(exc: Exception) -> TPServeError:
    """Wrap a backend failure that is not one of ours (a bug): logged in full, shown to the
    client only as "internal error <id>"."""
    if isinstance(exc, TPServeError):
        return exc
    wrapped = GenerationError("")
    wrapped.error_id = _logged_id(exc)  # type: ignore[attr-defined]
    return wrapped


async def _on_request_validation(request: Request, exc: RequestValidationError
                                 ) -> JSONResponse:
    message = describe_errors(exc.errors())
    ctype = request.headers.get("content-type", "")
    if "json" not in ctype.lower() and any(tuple(e.get("loc", ())) == ("body",)
                                           for e in exc.errors()):
        # FastAPI reads a body of another type (curl -d sends a form type) as bytes.
        message = (f"the body must be JSON sent with `content-type: application/json` "
                   f"(this request's content-type is `{ctype[:100]}`)")
    return JSONResponse({"error": public_message(message, False), "error_type": "validation"},
                        status_code=422)


async def _on_tpserve_error(_: Request, exc: TPServeError) -> JSONResponse:
    return error_response(exc)


# FastAPI answers 400 with this detail when the body cannot be decoded at all (bytes that are
# not UTF-8, JSON nested past the parser's depth, an integer past Python's 4,300-digit limit):
# malformed input, so a 422 like the others.
_UNPARSEABLE = "There was an error parsing the body"


def _routing_message(request: Request, exc: HTTPException) -> str:
    """Starlette's bare "Not Found" / "Method Not Allowed", worded to say what to do."""
    method, path = request.method, request.url.path[:200]
    if exc.status_code == 404 and exc.detail == "Not Found":
        return (f"no route `{method} {path}` on this server: it serves TGI's routes "
                "(/generate, /generate_stream, /info, /health, /metrics) and OpenAI's "
                "(/v1/completions, /v1/chat/completions, /v1/responses, /v1/models); "
                "GET /docs lists them all")
    allow = (exc.headers or {}).get("Allow")
    if exc.status_code == 405 and exc.detail == "Method Not Allowed" and allow:
        return f"`{path}` does not take {method}: send {allow.replace(', ', ' or ')}"
    return str(exc.detail)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.detail == _UNPARSEABLE:
        return JSONResponse(
            {"error": "the request body is not valid JSON: it must be UTF-8, nested at most "
                      "a few hundred levels deep, and have no number of more than 4,300 "
                      "digits", "error_type": "validation"},
            status_code=422)
    # 413 (body limit) is the client's input, like the 422s; 429 (the bytes of bodies held
    # at once) is the server's load, like the engine's 429.
    error_type = {413: "validation", 429: OverloadedError.error_type}.get(exc.status_code,
                                                                         "http")
    return JSONResponse(
        {"error": public_message(_routing_message(request, exc), exc.status_code >= 500),
         "error_type": error_type},
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Last resort: routes already convert backend failures; this catches our own bugs.
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(TPServeError, _on_tpserve_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)

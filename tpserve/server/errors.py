"""Map every failure to TGI's error body `{"error": ..., "error_type": ...}`.

TGI clients (text_generation.Client, tpserve.Client) dispatch on `error_type`, so all
routes, including FastAPI's own request validation and 404s, use this one shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tpserve.errors import GenerationError, TPServeError
from tpserve.protocol import describe_errors

logger = logging.getLogger("tpserve.server")


def error_body(exc: BaseException) -> dict[str, str]:
    """The JSON error object for an exception (also used for mid-stream SSE errors)."""
    if isinstance(exc, TPServeError):
        return {"error": str(exc) or type(exc).__name__, "error_type": exc.error_type}
    return {"error": f"{type(exc).__name__}: {exc}", "error_type": GenerationError.error_type}


def error_response(exc: BaseException) -> JSONResponse:
    status = exc.status_code if isinstance(exc, TPServeError) else 500
    return JSONResponse(error_body(exc), status_code=status)


def as_tpserve_error(exc: Exception) -> TPServeError:
    """Wrap a backend failure that is not one of ours, logging it since it is a bug."""
    if isinstance(exc, TPServeError):
        return exc
    logger.error("backend failed", exc_info=exc)
    return GenerationError(f"{type(exc).__name__}: {exc}")


async def _on_request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(
        {"error": describe_errors(exc.errors()), "error_type": "validation"}, status_code=422
    )


async def _on_tpserve_error(_: Request, exc: TPServeError) -> JSONResponse:
    return error_response(exc)


async def _on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(
        {"error": str(exc.detail), "error_type": "http"},
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Last resort: routes already convert backend failures; this catches our own bugs.
    logger.error("unhandled error", exc_info=exc)
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(TPServeError, _on_tpserve_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)

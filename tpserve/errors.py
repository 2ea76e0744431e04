"""Errors shared by the server, the engine and the client.

Each error carries the TGI `error_type` string so that the HTTP layer and the clients
(tpserve.Client and text_generation.Client) agree on what went wrong.
"""

from __future__ import annotations


class TPServeError(Exception):
    error_type = "generation"
    status_code = 500
    # Seconds for HTTP's Retry-After header (RFC 9110) on errors a later try may pass:
    # proxies, load balancers and generic HTTP clients back off by it.
    retry_after: int | None = None


class ValidationError(TPServeError):
    """The request is invalid (HTTP 422). Nothing was queued."""

    error_type = "validation"
    status_code = 422


class OverloadedError(TPServeError):
    """The server is at its concurrency limit (HTTP 429). Retry later."""

    error_type = "overloaded"
    status_code = 429
    retry_after = 1  # a slot frees as soon as any running request ends


class GenerationError(TPServeError):
    """Generation failed inside the engine (HTTP 500)."""

    error_type = "generation"
    status_code = 500


class ShardLostError(GenerationError):
    """A shard of the model (its actor, process or node) was lost while this request ran
    (HTTP 503). The server rebuilds the shard group on its own (--max-rebuilds); retry once
    GET /health answers 200 again."""

    error_type = "shard_lost"
    status_code = 503
    retry_after = 5  # a rebuild takes a model load: poll, do not hammer


class NotReadyError(TPServeError):
    """The model is still loading (HTTP 503)."""

    error_type = "unhealthy"
    status_code = 503
    retry_after = 5


class RequestTimeoutError(TPServeError):
    """The request passed its deadline (--request-timeout, HTTP 504) and was aborted."""

    error_type = "timeout"
    status_code = 504


class UnauthorizedError(TPServeError):
    """The server requires an API key and none, or a wrong one, was sent (HTTP 401)."""

    error_type = "unauthorized"
    status_code = 401


class NotFoundError(TPServeError):
    """A stored object (a Responses API response) that does not exist, or no longer (HTTP
    404)."""

    error_type = "not_found"
    status_code = 404


class ShardingError(ValueError):
    """A checkpoint tensor cannot be split across the requested tensor-parallel size."""


class CheckpointError(FileNotFoundError):
    """A model could not be found or read."""


class KernelUnavailableError(RuntimeError):
    """An explicitly requested attention backend cannot run here; the message says why."""

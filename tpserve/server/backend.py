"""The narrow interface the HTTP layer needs from the engine.

The Driver actor implements it over the Ray workers; server tests implement it with a fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams

__all__ = ["EngineBackend", "ModelInfo", "not_ready_message"]  # ModelInfo lives in tpserve.engine.info


class EngineBackend(Protocol):
    def ready(self) -> bool:
        """True once every shard has loaded and warmed up."""

    def info(self) -> ModelInfo: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        truncate: int | None = None,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[GenerationEvent]:
        """Queue one request and stream its events; the last one has finished=True. A
        prompt of token ids is used as it is (checked against the vocabulary).

        Raises tpserve.errors.ValidationError (prompt too long, ...) or OverloadedError
        before the first event. Closing the iterator early aborts the request. The
        iterator may also offer `rest() -> Awaitable[list[GenerationEvent]]`: every event
        still to come, at once (tpserve.engine.async_engine.EngineStream); non-streamed
        answers use it when it is there.
        """

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render OpenAI-style messages (and OpenAI tool objects, for templates that describe
        tools) to a prompt; ValidationError when the model has no template or it fails. The
        server passes `tools` only when a request has some."""

    def count_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        """Tokens of `text` as a prompt; add_special_tokens=False for a rendered chat prompt,
        which already holds the special tokens its template wants (as generate() is then
        called)."""

    # Optional: `decode(ids) -> str`, token ids as text (OpenAI's echo of a token-id
    # prompt; without it such a prompt cannot be echoed).
    # Optional: `token_bytes(token_id, text) -> bytes`, the bytes one token stands for
    # (`text`: it decoded alone), also for a piece of a multi-byte character (OpenAI's
    # log-probability `bytes`; without it, the UTF-8 of `text`).
    # Optional: `token_spans(text, add_special_tokens=True) -> list[(id, start, stop)]`, the
    # prompt's tokens and the characters each covers (POST /tokenize; without it, 501).
    # Optional: `token_id(piece) -> int | None`, the id of a string that is one token of the
    # vocabulary (--reasoning-parser: auto, and tags that are special tokens; without it,
    # auto reads none and special tags are left out of the text).
    # Optional: `stats() -> dict[str, float]`, engine gauges exported by GET /metrics
    # (running_sequences, waiting_sequences, kv_blocks_free, ...).
    # Optional, for several replicas behind one address (tpserve/serve/):
    # `replicas() -> list[dict]`, listed by GET /info under "replicas", and
    # `replica_stats() -> dict[str, dict[str, float]]`, exported as tpserve_replica gauges,
    # and `replica_health() -> dict`, GET /health's body: 503 when it has an "error" key.


def not_ready_message(backend: EngineBackend) -> str:
    """Why the backend does not take requests: its own `not_ready_reason()` when it has one
    (shutting down, engine failed), else the usual cause."""
    reason = getattr(backend, "not_ready_reason", None)
    return reason() if reason is not None else "the model is still loading"

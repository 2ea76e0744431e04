"""The HTTP ingress of several replicas: today's app (server/app.py's build_app, every TGI and
OpenAI route, streaming included) over a backend that forwards each generation to a replica
through a Serve DeploymentHandle; Serve's router (router.py) picks the replica.

Chat templates and token counts are answered here, from the tokenizer, so the only call a
request makes to a replica is its generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import ray.exceptions

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import (
    GenerationError,
    NotReadyError,
    ShardLostError,
    TPServeError,
    ValidationError,
)
from tpserve.serve.loopback import keep_replica_grpc_on_loopback

log = logging.getLogger(__name__)


# A replica whose shard died answers NotReadyError (or dies itself) until Serve's health check
# replaces it; sending again lets the router pick a live replica meanwhile.
RETRIES = 5
REPLICA_POLL_S = 1.0
RETRY_WAIT_S = 0.5


def retryable(err: BaseException) -> bool:
    """Failures before the first token: nothing was sent to the client yet."""
    return isinstance(err, (NotReadyError, GenerationError))


def unwrap_replica_error(exc: BaseException) -> BaseException:
    """A replica's exception as the HTTP layer maps it: tpserve errors keep their class (and
    status); a replica whose actor died mid-request (process killed, node lost) lost its
    shard group as a dead shard does (503 shard_lost, retry); anything else is a generation
    failure (500)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, TPServeError):
        return cause
    if isinstance(exc, TPServeError):
        return exc
    if isinstance(exc, ray.exceptions.RayActorError):  # ActorDiedError, ActorUnavailableError
        first = str(exc).strip().splitlines()
        return ShardLostError(f"the replica serving this request was lost ({type(exc).__name__}"
                              f"{': ' + first[0] if first else ''}); Serve is replacing it, "
                              "retry the request (the other replicas serve it)")
    return GenerationError(f"the replica failed: {type(exc).__name__}: "
                           f"{str(cause or exc).splitlines()[0] if str(cause or exc) else ''}")


@contextlib.contextmanager
def own_serve_request_id() -> Iterator[None]:
    """A handle call made inside this block gets an internal request id of its own.

    A DeploymentHandle call takes the internal request id of the ingress request it is made
    in, and Serve's router keys the requests it is placing by that id: a second call with an
    id it already holds is taken for a retry of the first and never placed. The choices of
    one OpenAI request (`n`, a list of prompts) are calls made side by side, so each needs
    its own id. The ingress request's context is left as it was. (Serve also files a call
    under that id to cancel it with the ingress request; the ingress cancels its streams
    itself: generate() below, when the client leaves.)
    """
    try:
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id

        var = serve_context._serve_request_context
        current = serve_context._get_serve_request_context()
        token = var.set(dataclasses.replace(current,
                                            _internal_request_id=generate_request_id()))
    except (ImportError, AttributeError, TypeError):  # another Ray: nothing to isolate
        yield
        return
    try:
        yield
    finally:
        var.reset(token)


class ReplicaSetBackend:
    """tpserve.server.backend.EngineBackend over a Serve deployment of TPReplica.

    `handle` is a DeploymentHandle (or a test fake of the same shape: .options(stream=True),
    .method.remote(...), .broadcast(method).results_async(...)).
    """

    def __init__(self, handle: Any, tokenizer: Any, replicas: int = 1) -> None:
        self.handle = handle
        self.tokenizer = tokenizer
        # GET /health: 503 until this many replicas were ready at once, then 200 while any is.
        self.replicas_wanted = replicas
        self._all_up = False
        self._info: ModelInfo | None = None
        self._table: dict[str, dict] = {}  # replica id -> its last status()
        self._tokens_seen: dict[str, tuple[float, float]] = {}  # replica -> (time, tokens)
        self._poller: asyncio.Task | None = None
        # Set by begin_drain (tpserve launch got SIGINT/SIGTERM): new requests get 503 with
        # this reason, those in flight (counted in `inflight`) carry on.
        self.draining: str | None = None
        self.inflight = 0

    async def refresh_info(self) -> ModelInfo:
        """Ask one replica for the model's limits (the same on every replica)."""
        self._info = await self.handle.info.remote()
        return self._info

    async def refresh_replicas(self, timeout_s: float = 5.0) -> dict[str, dict]:
        """Every running replica's status() (a replica that does not answer is left out)."""
        answers = await self.handle.broadcast("status").results_async(
            timeout_s=timeout_s, return_exceptions=True)
        self._table = {a["replica_id"]: a for a in answers if isinstance(a, dict)}
        if self.replicas_ready() >= self.replicas_wanted:
            self._all_up = True
        return self._table

    def replicas_ready(self) -> int:
        return sum(1 for r in self._table.values() if r.get("ready"))

    def start_polling(self, period_s: float = REPLICA_POLL_S) -> None:
        """Refresh the replica table in the background (/info and /metrics read it)."""
        async def poll() -> None:
            while True:
                try:
                    await self.refresh_replicas()
                except Exception:  # noqa: BLE001 - a failed poll keeps the last table
                    log.debug("replica status poll failed", exc_info=True)
                await asyncio.sleep(period_s)

        self._poller = asyncio.get_running_loop().create_task(poll())

    # --- EngineBackend --------------------------------------------------------------------
    def ready(self) -> bool:
        if self._info is None or self.draining is not None:
            return False
        # Before the first poll the table is empty; a replica answered refresh_info already.
        return not self._table or any(r["ready"] for r in self._table.values())

    def not_ready_reason(self) -> str:
        if self.draining is not None:
            return self.draining
        if self._table and not any(r["ready"] for r in self._table.values()):
            return "no replica can serve (" + "; ".join(
                replica_state(r) for r in self._table.values()) + ")"
        return "the model is still loading"

    def replica_health(self) -> dict:
        """GET /health's body (server/app.py): an error body (503) until every wanted replica
        has been ready at once, and when none can serve or the server drains; else `status`
        `ok`, or `degraded` while fewer than wanted serve (one was lost and Serve is
        replacing it). Both carry the counts."""
        ready = self.replicas_ready()
        counts = {"replicas_ready": ready, "replicas_wanted": self.replicas_wanted}
        if self.draining is None and self._info is not None and ready and not self._all_up:
            reason = (f"starting: {ready} of {self.replicas_wanted} replicas ready (200 once "
                      "all are)")
            return {"error": reason, "error_type": NotReadyError.error_type, **counts}
        if not self.ready() or not ready:
            return {"error": self.not_ready_reason(), "error_type": NotReadyError.error_type,
                    **counts}
        return {"status": "ok" if ready >= self.replicas_wanted else "degraded", **counts}

    def begin_drain(self, reason: str = "the server is shutting down") -> None:
        """Stop accepting requests (503 with `reason`); those in flight carry on."""
        self.draining = reason

    async def drain(self, timeout_s: float) -> int:
        """begin_drain, then wait up to timeout_s for the requests in flight to end; returns
        how many are still running."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.inflight

    def info(self) -> ModelInfo:
        if self._info is None:
            raise NotReadyError("no replica has answered yet")
        return dataclasses.replace(self._info, extra={**self._info.extra,
                                                      "num_replicas": len(self._table)})

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       truncate: int | None = None,
                       add_special_tokens: bool = True) -> AsyncIterator[GenerationEvent]:
        if self.draining is not None:
            raise NotReadyError(self.draining)
        self.inflight += 1
        try:
            async for event in self._generate(prompt, params, truncate, add_special_tokens):
                yield event
        finally:
            self.inflight -= 1

    async def _generate(self, prompt, params, truncate, add_special_tokens):
        stream, first = await self._start(prompt, params, truncate, add_special_tokens)
        finished = False
        try:
            for event in first:
                finished = event.finished
                yield event
            async for batch in stream:
                for event in batch:  # a replica sends every event ready at once (a list)
                    finished = event.finished
                    yield event
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to what the HTTP layer reports
            if self.draining is not None and isinstance(exc, ray.exceptions.RayActorError):
                # 503 `unhealthy`, as the direct server (AsyncEngine.stop): the stop cut
                # it, no engine failed.
                raise NotReadyError("the server shut down before this request finished "
                                    "(--shutdown-timeout ran out, or a second Ctrl-C "
                                    "skipped it)") from None
            raise unwrap_replica_error(exc) from None
        finally:
            if not finished:  # the client left: cancelling aborts it on the replica
                stream.cancel()

    async def _start(self, prompt, params, truncate, add_special_tokens):
        """Send the request and wait for its first events. A replica that cannot serve (a
        shard died and Serve has not replaced it yet) fails before generating anything, so
        the request is sent again and the router picks another replica."""
        for attempt in range(RETRIES + 1):
            with own_serve_request_id():
                stream = self.handle.options(stream=True).generate.remote(
                    prompt, params, truncate, add_special_tokens)
            try:
                return stream, await stream.__anext__()
            except (asyncio.CancelledError, GeneratorExit):
                stream.cancel()
                raise
            except StopAsyncIteration:
                raise GenerationError("the replica ended the stream without a token") from None
            except Exception as exc:  # noqa: BLE001 - retried or mapped below
                err = unwrap_replica_error(exc)
                if attempt == RETRIES or not retryable(err):
                    raise err from None
                log.warning("replica could not serve (%s); sending the request again", err)
                await asyncio.sleep(RETRY_WAIT_S * (attempt + 1))
        raise AssertionError("unreachable")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("this model has no chat template; use /v1/completions or "
                                  "/generate with a plain prompt")
        try:
            # `tools` only when the request has some: the call stays as it was without.
            extra = {} if tools is None else {"tools": tools}
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True, **extra)
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise ValidationError(f"chat template failed on these messages: {exc}") from exc

    def count_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int, text: str) -> bytes:
        from tpserve.tokenizer import token_bytes

        return token_bytes(self.tokenizer, token_id, text)

    def token_spans(self, text: str, add_special_tokens: bool = True
                    ) -> list[tuple[int, int, int]]:
        from tpserve.engine.engine import token_spans

        return token_spans(self.tokenizer, text, add_special_tokens)

    def token_id(self, piece: str) -> int | None:
        from tpserve.engine.engine import vocab_id

        return vocab_id(self.tokenizer, piece)

    # --- optional: several replicas --------------------------------------------------------
    def replicas(self) -> list[dict]:
        """Each replica: id, state, its shard actors and its engine gauges."""
        return [{"replica_id": rid, "state": replica_state(r), "shards": r.get("shards", []),
                 "namespace": r.get("namespace"), **r.get("stats", {})}
                for rid, r in sorted(self._table.items())]

    def replica_stats(self) -> dict[str, dict[str, float]]:
        """Per-replica gauges for /metrics, with tokens/s from successive polls."""
        out: dict[str, dict[str, float]] = {}
        for rid, r in self._table.items():
            s = {k: float(v) for k, v in r.get("stats", {}).items()
                 if isinstance(v, (int, float))}
            tokens, at = s.get("tokens_generated"), r.get("at")
            if tokens is not None and at is not None:
                prev = self._tokens_seen.get(rid)
                if prev is not None and at > prev[0]:
                    s["tokens_per_second"] = max(0.0, (tokens - prev[1]) / (at - prev[0]))
                    self._tokens_seen[rid] = (at, tokens)
                elif prev is None:
                    self._tokens_seen[rid] = (at, tokens)
            out[rid] = s
        return out

    def stats(self) -> dict[str, float]:
        """Engine gauges summed over replicas (the per-replica ones are in replica_stats)."""
        total: dict[str, float] = {}
        for s in self.replica_stats().values():
            for k, v in s.items():
                total[k] = total.get(k, 0.0) + v
        total.pop("tokens_per_second", None)
        total["replicas"] = float(len(self._table))
        return total


def replica_state(status: dict) -> str:
    if status.get("dead"):
        return f"failed: {status['dead']}"
    return "ready" if status.get("ready") else "not ready"


class TPServeIngress:
    """The ingress deployment class (wrapped by serve.ingress in app.py)."""

    async def __init__(self, replica_handle: Any, tokenizer_path: str, server: Any = None,
                       replicas: int = 1, grpc_on_loopback: bool = False,
                       model_path: str | None = None) -> None:
        from tpserve.tokenizer import load_tokenizer

        if grpc_on_loopback:
            keep_replica_grpc_on_loopback()
        self.server = server  # ServerConfig: API keys, body limit, deadlines, as the direct server
        tokenizer = load_tokenizer(tokenizer_path, model_path)  # --tokenizer, else the model's
        self.backend = ReplicaSetBackend(replica_handle, tokenizer, replicas)
        await self.backend.refresh_info()
        await self.backend.refresh_replicas()
        self.backend.start_polling()

    async def drain(self, timeout_s: float) -> int:
        """`tpserve launch` on SIGINT/SIGTERM: new requests get 503, those in flight get
        timeout_s to finish; how many are still running."""
        return await self.backend.drain(timeout_s)

    def __serve_build_asgi_app__(self):
        from tpserve.server.app import build_app

        return build_app(self.backend, self.server)

"""Bridges the synchronous engine loop (its own thread) to the asyncio HTTP server.

Requests and aborts enter through a thread-safe inbox that the loop drains between steps,
so the engine's state is only ever touched by its own thread; events go back to each
request's asyncio queue with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import GenerationError, NotReadyError, OverloadedError, TPServeError

log = logging.getLogger(__name__)


@dataclass
class _Submit:
    prompt_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclass
class _Abort:
    seq_id: int


class AsyncEngine:
    """Implements tpserve.server.backend.EngineBackend over an Engine built in a thread."""

    def __init__(self, build_engine, model_id: str, max_concurrent_requests: int) -> None:
        self._build = build_engine
        self.model_id = model_id
        self.max_concurrent = max_concurrent_requests
        self.engine = None
        self.error: BaseException | None = None
        # Set when a shard actor died: the replica cannot serve until it is rebuilt.
        self.dead: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[int, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._inflight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpserve-engine", daemon=True)
        self.steps = 0
        self.last_step_seconds = 0.0
        self._ray_metrics = RayMetrics()

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until loaded; re-raise the load error, if any."""
        while not self._ready.wait(0.2):
            if self.error is not None:
                raise self.error
            if timeout is not None:
                timeout -= 0.2
                if timeout <= 0:
                    raise TimeoutError("model did not finish loading in time")
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        if self.engine is not None:
            self.engine.shutdown()

    def ready(self) -> bool:
        return self._ready.is_set() and self.error is None and self.dead is None

    @property
    def inflight(self) -> int:
        return self._inflight

    # --- EngineBackend ------------------------------------------------------------------
    def info(self) -> ModelInfo:
        e = self.engine
        if e is None:
            return ModelInfo(self.model_id, "unknown", "unknown", 0, 0, 0, self.max_concurrent)
        c = e.cfg
        return ModelInfo(
            model_id=self.model_id, model_dtype=c.model.dtype,
            model_device_type=c.parallel.device, tp_size=c.parallel.tp_size,
            max_input_tokens=e.max_input_tokens, max_total_tokens=e.max_model_len,
            max_concurrent_requests=self.max_concurrent,
            max_batch_total_tokens=e.num_blocks * c.cache.block_size,
            attention_backend=e.load_reports[0].backend,
            extra={"kv_cache_blocks": e.num_blocks, "block_size": c.cache.block_size,
                   "architectures": list(getattr(e.hf_config, "architectures", None) or [])})

    def stats(self) -> dict[str, float]:
        """Engine gauges for /metrics and the Ray dashboard (read without locking: each is
        a single length or counter read)."""
        e = self.engine
        if e is None:
            return {"ready": 0.0}
        # The engine's own step count when it has one (its core may run elsewhere).
        return {"ready": float(self.ready()), "steps": float(self.steps), **e.stats(),
                "requests_inflight": float(self._inflight),
                "last_step_seconds": self.last_step_seconds}

    def count_tokens(self, text: str) -> int:
        self._require_ready()
        return len(self.engine.tokenize(text))

    def apply_chat_template(self, messages: list[dict]) -> str:
        from tpserve.errors import ValidationError

        self._require_ready()
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValidationError("this model has no chat template; use /v1/completions or "
                                  "/generate with a plain prompt")
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise ValidationError(f"chat template failed on these messages: {exc}") from exc

    def _require_ready(self) -> None:
        if not self.ready():
            why = ("the model is still loading" if self.error is None and self.dead is None
                   else f"the engine failed: {self.error or self.dead}")
            raise NotReadyError(why)

    async def generate(self, prompt: str, params: SamplingParams, truncate: int | None = None,
                       add_special_tokens: bool = True) -> AsyncIterator[GenerationEvent]:
        self._require_ready()
        with self._lock:
            if self._inflight >= self.max_concurrent:
                raise OverloadedError(
                    f"Model is overloaded: {self._inflight} requests in flight, the limit is "
                    f"{self.max_concurrent} (--max-concurrent-requests). Retry later.")
            self._inflight += 1
        seq_id = None
        try:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(
                None, lambda: self.engine.tokenize(prompt, truncate, add_special_tokens))
            sink: asyncio.Queue = asyncio.Queue()
            accepted = loop.create_future()
            self._inbox.put(_Submit(ids, params, sink, loop, accepted))
            seq_id = await accepted  # raises ValidationError from the engine's checks
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    seq_id = None  # the engine already dropped it
                    raise item
                if item.finished:
                    seq_id = None  # closing after the last event is not an abort
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                self._inflight -= 1
            if seq_id is not None:  # the client went away or a consumer stopped early
                self._inbox.put(_Abort(seq_id))

    # --- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready / health
            log.exception("engine failed to start")
            self.error = exc
            return
        self._ready.set()
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if self._stop.is_set():
                break
            if self.engine.has_work():
                self._step()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if isinstance(item, _Abort):
            self.engine.abort(item.seq_id)
            self._sinks.pop(item.seq_id, None)
            return
        try:
            seq = self.engine.add_request(item.prompt_ids, item.params)
        except TPServeError as exc:
            item.loop.call_soon_threadsafe(_set_exception, item.accepted, exc)
            return
        except Exception as exc:  # noqa: BLE001 - the engine (or a shard) failed, not the input
            log.exception("submitting a request failed")
            if _replica_dead(exc):
                self.dead = f"a shard actor died: {exc}"
            err = GenerationError(f"generation failed: {type(exc).__name__}: {exc}")
            item.loop.call_soon_threadsafe(_set_exception, item.accepted, err)
            return
        if item.accepted.done():  # the caller gave up (disconnected) while it queued
            self.engine.abort(seq.seq_id)
            return
        self._sinks[seq.seq_id] = (item.sink, item.loop)
        item.loop.call_soon_threadsafe(_set_result, item.accepted, seq.seq_id)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events, _ = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving the rest
            log.exception("step failed; failing the requests in it")
            if _replica_dead(exc):
                self.dead = f"a shard actor died: {exc}"
            err = GenerationError(f"generation failed: {type(exc).__name__}: {exc}")
            for seq_id in list(self._sinks):
                self.engine.abort(seq_id)
                sink, loop = self._sinks.pop(seq_id)
                loop.call_soon_threadsafe(sink.put_nowait, err)
            return
        for seq_id, ev in events:
            target = self._sinks.get(seq_id)
            if target is None:
                continue
            sink, loop = target
            loop.call_soon_threadsafe(sink.put_nowait, ev)
            if ev.finished:
                self._sinks.pop(seq_id, None)
        self.last_step_seconds = time.perf_counter() - t0
        self.steps += 1
        self._ray_metrics.maybe_report(self)


class RayMetrics:
    """The engine gauges as Ray metrics, so the Ray dashboard (and its Prometheus export)
    shows them next to the actors. Reported at most twice a second; a no-op outside Ray."""

    def __init__(self) -> None:
        self._gauge = None
        self._next = 0.0

    def maybe_report(self, backend: AsyncEngine) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + 0.5
        try:
            import ray

            if not ray.is_initialized():
                return
            if self._gauge is None:
                from ray.util.metrics import Gauge

                self._gauge = Gauge("tpserve_engine", "tpserve engine state", tag_keys=("stat",))
            for name, value in backend.stats().items():
                self._gauge.set(float(value), tags={"stat": name})
        except Exception:  # noqa: BLE001 - metrics must never take serving down
            log.debug("ray metrics report failed", exc_info=True)


def _replica_dead(exc: BaseException) -> bool:
    """A shard is gone (or stuck): the replica cannot serve until it is rebuilt."""
    return bool(getattr(exc, "replica_dead", False)) or type(exc).__name__ in (
        "ActorDiedError", "RayActorError", "ActorUnavailableError")


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

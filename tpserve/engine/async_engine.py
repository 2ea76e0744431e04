"""Bridges the synchronous engine loop (its own thread) to the asyncio HTTP server.

Requests and aborts enter through a thread-safe inbox that the loop drains between steps,
so the engine's state is only ever touched by its own thread; events go back to each
request's event sink with call_soon_threadsafe.

This thread also owns the replica's lifecycle after a lost shard (a dead actor, process or
node, or a stuck collective): requests that had produced tokens fail with ShardLostError
(503), those that had not are kept, the whole shard group is torn down and built again
through the same factory as at start (RebuildPolicy bounds the attempts and backs off), and
the kept requests are replayed on the new group (safe: nothing of them was sent yet).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count

from tpserve.engine.build_wait import reporting_waits
from tpserve.engine.heap import IdleCollector, freeze_startup_objects
from tpserve.engine.info import ModelInfo
from tpserve.engine.rebuild import RebuildPolicy
from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.engine.step_trace import StepTrace
from tpserve.errors import (
    GenerationError,
    NotReadyError,
    OverloadedError,
    ShardLostError,
    TPServeError,
)

log = logging.getLogger(__name__)

IDLE_CHECK_S = 1.0  # how often an idle replica looks for a lost shard
# Prompts up to this many characters (~2k tokens) are tokenized on the event loop itself:
# a thread hop costs more than the tokenizer for them, and worse, the request's next step
# queues behind every other arrival's callbacks, so a burst of 256 requests reached the
# engine only after the loop had parsed all of them (~0.3 s with an idle GPU, measured on
# one H200). Longer prompts go to a thread so the loop keeps answering meanwhile.
INLINE_TOKENIZE_CHARS = 8192


class EventSink:
    """One request's events on their way from the engine thread to its handler, fed on the
    handler's event loop (put_nowait) and read there (get). What asyncio.Queue did here
    without its bookkeeping (bound-loop checks, task counting, a deque of waiters): a
    256-request burst passes 65k events through these, each a wake-up of its handler."""

    __slots__ = ("_items", "_loop", "_quiet", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque = deque()
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        self._quiet = False  # wake the reader for the last event only (wait_last)

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and (not self._quiet or _is_last(item)):
            self._waiter = None
            if not waiter.done():  # a cancelled reader's future stays cancelled
                waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        return self._items.popleft()

    async def wait_last(self) -> None:
        """Wait, without a wake-up per event, until the last event (finished) or an error
        is in the sink."""
        self._quiet = True
        while not (self._items and _is_last(self._items[-1])):
            self._waiter = self._loop.create_future()
            await self._waiter

    def take_all(self) -> list:
        items, self._items = list(self._items), deque()
        return items


class EngineStream:
    """One request's events as an async iterator (the EngineBackend contract), plus `rest()`:
    every remaining event in one list, with one wake-up of the caller.

    A non-streamed answer needs its events only at the end, yet handing them over one at a
    time woke its handler once per token: 65k wake-ups through three async generators in a
    256 x 256/256 burst, on the event loop that also parses requests and writes answers,
    which is what kept the driver's last answers 0.1-0.2 s behind the core's last step on
    one H200. `rest()` lets the sink only collect until the last event arrives."""

    def __init__(self, engine: AsyncEngine, prompt: str | list[int], params: SamplingParams,
                 truncate: int | None, add_special_tokens: bool) -> None:
        self._engine, self._prompt, self._params = engine, prompt, params
        self._truncate, self._add_special_tokens = truncate, add_special_tokens
        self._sink: EventSink | None = None
        self._handle: int | None = None  # set while the engine may still produce events
        self._counted = False  # holds one of the engine's in-flight places
        self._done = False

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        if self._sink is None:
            await self._start()
        return self._take(await self._sink.get())

    async def rest(self) -> list[GenerationEvent]:
        """Every event still to come (all of them if none was taken), ending with the last."""
        if self._done:
            return []
        if self._sink is None:
            await self._start()
        await self._sink.wait_last()
        items = self._sink.take_all()
        # Only the last item can end the stream (the engine sends nothing after a final
        # event or an error): look at it alone, as a burst's answers all end within its
        # last steps and a pass over every event would land there.
        self._take(items[-1])
        return items

    async def aclose(self) -> None:
        self._release()

    def _take(self, item) -> GenerationEvent:
        if isinstance(item, BaseException):
            self._handle = None  # the engine already dropped it
            self._release()
            raise item
        if item.finished:
            self._handle = None  # the last event: closing now is not an abort
            self._release()
        return item

    async def _start(self) -> None:
        engine = self._engine
        engine._require_ready()
        with engine._lock:
            if engine._inflight >= engine.max_concurrent:
                raise OverloadedError(
                    f"Model is overloaded: {engine._inflight} sequences in flight, the limit "
                    f"is {engine.max_concurrent} (--max-concurrent-requests; each of a "
                    "request's n or best_of choices counts as one). Retry later.")
            engine._inflight += 1
        self._counted = True
        try:
            loop = asyncio.get_running_loop()
            prompt, truncate, special = self._prompt, self._truncate, self._add_special_tokens
            if not isinstance(prompt, str) or len(prompt) <= INLINE_TOKENIZE_CHARS:
                ids = engine.engine.tokenize(prompt, truncate, special)
            else:
                ids = await loop.run_in_executor(
                    None, lambda: engine.engine.tokenize(prompt, truncate, special))
            guided = self._params.guided
            check = getattr(engine.engine, "check_grammar", None)
            if guided is not None and check is not None:
                # Compiling a schema can take from a millisecond to a second (cached by
                # kind and value): on a worker thread, so other clients are not kept
                # waiting; one that does not compile is a ValidationError (422) here.
                await loop.run_in_executor(None, check, guided)
            sink = EventSink(loop)
            accepted = loop.create_future()
            self._handle = next(engine._handles)
            if engine._trace is not None:
                engine._trace.event("arrive", 1)
            engine._inbox.put(_Submit(self._handle, ids, self._params, sink, loop, accepted))
            await accepted  # raises ValidationError from the engine's checks
            self._sink = sink
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Give back the in-flight place, and abort the request if the engine may still
        be working on it (the client went away, a consumer stopped early, a timeout, or a
        rebuild holds it). Idempotent."""
        self._done = True
        if self._counted:
            self._counted = False
            with self._engine._lock:
                self._engine._inflight -= 1
        if self._handle is not None:
            self._engine._inbox.put(_Abort(self._handle))
            self._handle = None

    def __del__(self) -> None:  # dropped without aclose(): still give the place back
        if self._counted or self._handle is not None:
            self._release()


@dataclass
class _Submit:
    handle: int  # ours, stable across rebuilds (the engine's seq ids start over)
    prompt_ids: list[int]
    params: SamplingParams
    sink: EventSink
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    answered: bool = False  # `accepted` was resolved (engine thread's view)
    started: bool = False  # a token was sent: replaying it would repeat output

    def fail(self, exc: BaseException) -> None:
        if self.answered:
            _post(self.loop, self.sink.put_nowait, exc)
        else:
            _post(self.loop, _set_exception, self.accepted, exc)


@dataclass
class _Abort:
    handle: int


class NullMetrics:
    """The metrics interface AsyncEngine reports to, doing nothing (tests, no Ray)."""

    def start(self) -> bool:
        return False

    def stop(self) -> None: ...

    def request_arrived(self, seq_id: int) -> None: ...

    def request_ended(self, seq_id: int) -> None: ...

    def step_done(self, events, step_seconds: float) -> None: ...

    def rebuilt(self) -> None: ...


def _vocab_size(engine) -> int | None:
    """The model's vocabulary (a multimodal config keeps it in text_config), else the
    tokenizer's; None when neither is known."""
    cfg = engine.hf_config
    size = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None),
                                                       "vocab_size", None)
    tok = getattr(engine, "tokenizer", None)
    return size or (len(tok) if tok is not None else None)


class AsyncEngine:
    """Implements tpserve.server.backend.EngineBackend over an Engine built in a thread."""

    def __init__(self, build_engine, model_id: str, max_concurrent_requests: int,
                 metrics_factory=None, rebuild: RebuildPolicy | None = None) -> None:
        self._build = build_engine
        self.model_id = model_id
        self.max_concurrent = max_concurrent_requests
        self.engine = None
        self.error: BaseException | None = None
        # Set when a shard was lost: why; cleared when the group is rebuilt.
        self.dead: str | None = None
        # loading | serving | rebuilding | failed (a lost shard and no rebuild left)
        self.state = "loading"
        self.rebuild = rebuild or RebuildPolicy(max_rebuilds=0)
        self._engine_live = False  # self.engine's shards exist (not torn down)
        self._building = False  # the thread is in self._build (minutes: placement, load)
        self.waiting: str | None = None  # what that build waits for (engine/build_wait.py)
        self._handles = count()
        self._live: dict[int, _Submit] = {}  # engine seq id -> request
        self._seq_of: dict[int, int] = {}  # handle -> engine seq id
        self._replay: dict[int, _Submit] = {}  # handle -> request kept through a rebuild
        self._checked_at = 0.0
        self._collector = IdleCollector()  # full collections while idle (engine/heap.py)
        # rayops hook (shutdown): set by begin_drain; new requests get 503 with this reason.
        self.draining: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._inflight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpserve-engine", daemon=True)
        self.steps = 0
        self.last_step_seconds = 0.0
        self.bridge_seconds = 0.0  # cumulative time in _step (the engine's step or poll too)
        # Metrics where the deployment looks (Ray's export: cluster/ray_metrics.py), given by
        # whoever launches the engine, so the engine imports nothing of Ray.
        self._ray_metrics = metrics_factory(self.stats) if metrics_factory else NullMetrics()
        # TPSERVE_STEP_TRACE: this side's timeline, next to the engine core's.
        self._trace = StepTrace.from_env(".driver")

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ray_metrics.start()

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
        building = self._building
        self._stop.set()
        self._inbox.put(None)
        # A build (waiting for a placement, loading weights) is not waited for: it shuts its
        # group down itself when it ends (_build_group), or goes with this process.
        self._thread.join(timeout=1.0 if building else 30)
        self._ray_metrics.stop()
        # rayops hook (shutdown): whatever the drain did not finish ends now, with an error
        # rather than a connection that never answers; 503 `unhealthy`, as a request refused
        # while draining: no engine failure, nothing to log as one.
        err = NotReadyError("the server shut down before this request finished "
                            "(--shutdown-timeout ran out, or a second Ctrl-C skipped it)")
        for item in [*self._live.values(), *self._replay.values()]:
            item.fail(err)
        self._live.clear()
        self._replay.clear()
        if self.engine is not None and self._engine_live:
            self._engine_live = False
            self.engine.shutdown()

    def begin_drain(self, reason: str = "the server is shutting down") -> None:
        """Stop accepting requests (503 with `reason`); in-flight ones carry on."""
        self.draining = reason

    def not_ready_reason(self) -> str:
        if self.draining:
            return self.draining
        if self.state == "rebuilding":
            then = f": {self.waiting}" if self.waiting else ", retry shortly"
            return (f"{self.dead}; rebuilding the shard group (attempt "
                    f"{self.rebuild.attempts + 1} of {self.rebuild.max_rebuilds}){then}")
        if self.state == "failed":
            return (f"{self.dead}; the shard group was not rebuilt ("
                    f"{self.rebuild.attempts} of --max-rebuilds {self.rebuild.max_rebuilds} "
                    "attempts spent): restart tpserve launch")
        if self.error is not None:
            return f"the engine failed: {self.error}"
        return "the model is still loading" + (f": {self.waiting}" if self.waiting else "")

    def ready(self) -> bool:
        return (self._ready.is_set() and self.error is None and self.state == "serving"
                and self.draining is None)

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
            encoder_decoder=bool(getattr(e.hf_config, "is_encoder_decoder", False)),
            adapters=c.lora.names,
            extra={"kv_cache_blocks": e.num_blocks, "block_size": c.cache.block_size,
                   "placement": c.parallel.placement,  # rayops hook: --placement
                   "replica_state": self.state, "rebuilds": self.rebuild.rebuilds,
                   "rebuilds_left": self.rebuild.left,
                   "architectures": list(getattr(e.hf_config, "architectures", None) or []),
                   # --tokenizer where given (a directory or hub id), else the model's own;
                   # getattr: the simulated cores of benchmarks and tests carry no such field.
                   "tokenizer": getattr(c.model, "tokenizer_id", None) or self.model_id,
                   # Token ids 0..vocab_size-1 are valid in prompts and /detokenize.
                   "vocab_size": _vocab_size(e)})

    def stats(self) -> dict[str, float]:
        """Engine gauges for /metrics and the Ray dashboard (read without locking: each is
        a single length or counter read)."""
        e = self.engine
        if e is None:
            return {"ready": 0.0}
        lifecycle = {"rebuilds": float(self.rebuild.rebuilds),
                     "rebuilding": float(self.state == "rebuilding"),
                     "failed": float(self.state == "failed")}
        # The engine's own step count when it has one (its core may run elsewhere).
        return {"ready": float(self.ready()), "steps": float(self.steps),
                **(e.stats() if self._engine_live else {}), **lifecycle,
                "requests_inflight": float(self._inflight),
                "last_step_seconds": self.last_step_seconds,
                "bridge_step_seconds": self.bridge_seconds}

    def count_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        self._require_ready()
        return len(self.engine.tokenize(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        from tpserve.errors import ValidationError

        self._require_ready()
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValidationError("this model has no chat template; use /v1/completions or "
                                  "/generate with a plain prompt")
        try:
            extra = {} if tools is None else {"tools": tools}
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **extra)
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise ValidationError(f"chat template failed on these messages: {exc}") from exc

    def _require_ready(self) -> None:
        if not self.ready():
            raise NotReadyError(self.not_ready_reason())

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens included (an echoed token-id prompt)."""
        self._require_ready()
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The bytes one token stands for (`text`: it decoded alone), also for a piece of a
        multi-byte character (tpserve.tokenizer.token_bytes)."""
        from tpserve.tokenizer import token_bytes

        self._require_ready()
        return token_bytes(self.engine.tokenizer, token_id, text)

    def token_spans(self, text: str, add_special_tokens: bool = True
                    ) -> list[tuple[int, int, int]]:
        from tpserve.engine.engine import token_spans

        self._require_ready()
        return token_spans(self.engine.tokenizer, text, add_special_tokens)

    def token_id(self, piece: str) -> int | None:
        """The id of `piece` when it is one token of the vocabulary, else None."""
        from tpserve.engine.engine import vocab_id

        self._require_ready()
        return vocab_id(self.engine.tokenizer, piece)

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 truncate: int | None = None,
                 add_special_tokens: bool = True) -> EngineStream:
        """The request's events (EngineStream): nothing happens until the first is awaited;
        closing the stream before the last event aborts the request."""
        return EngineStream(self, prompt, params, truncate, add_special_tokens)

    # --- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._build_group()
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready / health
            log.exception("engine failed to start")
            self.error = exc
            return
        if engine is None:
            self.error = NotReadyError("the server stopped before the model was ready")
            return
        self.engine = engine
        self._engine_live, self.state = True, "serving"
        freeze_startup_objects()
        self._ready.set()
        while not self._stop.is_set():
            if self.state == "rebuilding":
                self._rebuild()
                continue
            serving = self.state == "serving"
            self._drain(block=not (serving and self.engine.has_work()))
            if self._stop.is_set():
                break
            if self.state == "serving" and self.engine.has_work():
                self._step()
                self._collector.busy()
            elif self.state == "serving":
                self._check_idle()
                self._collector.idle()

    def _drain(self, block: bool) -> None:
        if block and self._trace is not None:
            self._trace.flush()  # idle: the file write delays nothing
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        items = []
        while item is not None:
            items.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        # Consecutive submissions go to the engine in one call: the engine core takes new
        # requests between steps, so one call per request would make a burst of N requests
        # wait N steps to get in. Aborts keep their place in the order.
        batch: list[_Submit] = []
        for item in items:
            if isinstance(item, _Abort):
                self._submit(batch)
                batch = []
                self._abort(item)
            else:
                batch.append(item)
        self._submit(batch)

    def _abort(self, item: _Abort) -> None:
        if self._replay.pop(item.handle, None) is not None:
            return
        seq_id = self._seq_of.pop(item.handle, None)
        if seq_id is not None:
            self._live.pop(seq_id, None)
            self.engine.abort(seq_id)
            self._ray_metrics.request_ended(seq_id)

    def _submit(self, items: list[_Submit]) -> None:
        if not items:
            return
        if self.state == "rebuilding":  # raced with the loss: served after the rebuild
            for item in items:
                self._replay[item.handle] = item
            return
        if self.state == "failed":
            for item in items:
                item.fail(NotReadyError(self.not_ready_reason()))
            return
        many = getattr(self.engine, "add_requests", None)
        if self._trace is not None:
            self._trace.event("submit", len(items))
        try:
            if many is not None:
                results = many([(item.prompt_ids, item.params) for item in items])
            else:  # an engine that takes one request per call
                results = []
                for item in items:
                    try:
                        results.append(self.engine.add_request(item.prompt_ids, item.params))
                    except TPServeError as exc:
                        results.append(exc)
        except Exception as exc:  # noqa: BLE001 - the engine (or a shard) failed, not the input
            log.exception("submitting requests failed")
            if _replica_dead(exc):
                for item in items:
                    self._replay[item.handle] = item  # nothing of them ran: replay them
                self._lose(exc)
                if self.state == "failed":
                    self._give_up()
            else:
                for item in items:
                    item.fail(GenerationError(f"generation failed: {type(exc).__name__}: "
                                              f"{exc}"))
            return
        for item, seq in zip(items, results, strict=True):
            if isinstance(seq, BaseException):
                item.fail(seq)
                continue
            self._live[seq.seq_id] = item
            self._seq_of[item.handle] = seq.seq_id
            self._ray_metrics.request_arrived(seq.seq_id)
            if not item.answered:
                item.answered = True
                if not _post(item.loop, _set_result, item.accepted, item.handle):
                    self._abort(_Abort(item.handle))  # its caller is gone

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events, _ = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving the rest
            log.exception("step failed; failing the requests in it")
            self._fail_inflight(exc)
            return
        # One wake-up of each event loop per step (a call_soon_threadsafe per event writes
        # to the loop's self-pipe once per token), events in the order the engine made them.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for seq_id, ev in events:
            item = self._live.get(seq_id)
            if item is None:
                continue
            item.started = True
            batch = batches.get(item.loop)
            if batch is None:
                batch = batches[item.loop] = []
            batch.append((item.sink, ev))
            if ev.finished:
                self._live.pop(seq_id, None)
                self._seq_of.pop(item.handle, None)
        for loop, batch in batches.items():
            if not _post(loop, _deliver, batch):  # its callers are gone: free their places
                gone = [h for h, i in self._seq_of.items()
                        if getattr(self._live.get(i), "loop", None) is loop]
                for handle in gone:
                    self._abort(_Abort(handle))
        if self._trace is not None and events:
            self._trace.event("events", len(events))
            done = sum(1 for _, ev in events if ev.finished)
            if done:
                self._trace.event("done", done)
        self.last_step_seconds = time.perf_counter() - t0
        self.bridge_seconds += self.last_step_seconds
        self.steps += 1
        self._ray_metrics.step_done(events, self.last_step_seconds)

    def _check_idle(self) -> None:
        """An idle replica would only notice a lost shard at its next request: look every
        IDLE_CHECK_S, so /health turns 503 and the rebuild starts without waiting for one."""
        check = getattr(self.engine, "check", None)
        now = time.monotonic()
        if check is None or now - self._checked_at < IDLE_CHECK_S:
            return
        self._checked_at = now
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - only a lost shard changes anything
            if _replica_dead(exc):
                self._fail_inflight(exc)
            else:
                log.warning("replica check failed: %s: %s", type(exc).__name__, exc)

    def _fail_inflight(self, exc: BaseException) -> None:
        """A step failed: every request in the engine ends. After a lost shard, those that
        produced no token yet are kept for the rebuilt group instead."""
        lost = _replica_dead(exc)
        if lost:  # unhealthy before any caller hears of the loss
            self._lose(exc)
            then = ("the server is rebuilding the shard group, retry when GET /health answers "
                    "200" if self.state == "rebuilding" else "the server has no rebuild left "
                    "(--max-rebuilds) and stops serving: restart it")
            err: GenerationError = ShardLostError(
                f"a shard of the model was lost while this request ran ({_summary(exc)}); "
                f"{then}")
        else:
            err = GenerationError(f"generation failed: {type(exc).__name__}: {exc}")
        for seq_id, item in list(self._live.items()):
            try:
                self.engine.abort(seq_id)
            except Exception:  # noqa: BLE001 - a lost engine has nothing left to free
                pass
            self._ray_metrics.request_ended(seq_id)
            if lost and not item.started:
                self._replay[item.handle] = item
            else:
                item.fail(err)
        self._live.clear()
        self._seq_of.clear()
        if self.state == "failed":
            self._give_up()  # no rebuild left: the kept requests end too

    def _lose(self, exc: BaseException) -> None:
        """A shard is gone: stop serving; rebuild if the policy allows, else give up."""
        self.dead = f"a shard was lost ({_summary(exc)})"
        log.error("a shard was lost (%s: %s); %d rebuild(s) left (--max-rebuilds)",
                  type(exc).__name__, exc, self.rebuild.left)
        self.state = "rebuilding" if self.rebuild.left else "failed"

    def _rebuild(self) -> None:
        """Tear the whole group down, then build a new one (placement group, weights,
        warmup) until one comes up, the budget is spent, or the server stops."""
        self._teardown()
        while not self._stop.is_set():
            delay = self.rebuild.next_delay()
            if delay is None:
                self.state = "failed"
                self._give_up()
                return
            log.warning("rebuilding the shard group in %.1fs (attempt %d of %d)", delay,
                        self.rebuild.attempts + 1, self.rebuild.max_rebuilds)
            if self._stop.wait(delay):
                return
            t0 = time.perf_counter()
            try:
                engine = self._build_group()
            except Exception as exc:  # noqa: BLE001 - counted; the next attempt may succeed
                self.rebuild.record(ok=False)
                self.dead = f"a shard was lost, and rebuilding failed ({_summary(exc)})"
                log.exception("rebuilding the shard group failed")
                continue
            if engine is None:
                return
            self.rebuild.record(ok=True)
            self.engine, self._engine_live = engine, True
            freeze_startup_objects()
            self.dead, self.state = None, "serving"
            self._ray_metrics.rebuilt()
            log.warning("shard group rebuilt in %.1fs; serving again (%d rebuild(s) left)",
                        time.perf_counter() - t0, self.rebuild.left)
            self._drain(block=False)  # aborts of kept requests (deadline, disconnect) first
            kept = list(self._replay.values())  # in arrival order
            self._replay.clear()
            self._submit(kept)
            return

    def _build_group(self):
        """A new shard group, or None when the server stopped while it was built (stop()
        does not wait for a build): that group is shut down here rather than left running."""
        self._building = True
        try:
            with reporting_waits(self._set_waiting):
                engine = self._build()
        finally:
            self._building = False
        if not self._stop.is_set():
            return engine
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("shutting down the group built after stop failed")
        return None

    def _set_waiting(self, reason: str | None) -> None:
        self.waiting = reason
        if reason:
            log.warning("the shard group's build is %s", reason)

    def _give_up(self) -> None:
        self._teardown()
        log.error("not rebuilding the shard group: %s", self.not_ready_reason())
        err = ShardLostError(self.not_ready_reason())
        for item in self._replay.values():
            item.fail(err)
        self._replay.clear()

    def _teardown(self) -> None:
        """Kill every actor of the group and free its placement group (a dead rank cannot
        take part in a clean shutdown, so the live ones are not asked to)."""
        if not self._engine_live:
            return
        self._engine_live = False
        kill = getattr(self.engine, "kill", None) or self.engine.shutdown
        try:
            kill()
        except Exception:  # noqa: BLE001 - what is left of the group is unreachable anyway
            log.exception("tearing down the lost shard group failed")


def _replica_dead(exc: BaseException) -> bool:
    """A shard is gone (or stuck): the replica cannot serve until it is rebuilt."""
    return bool(getattr(exc, "replica_dead", False)) or type(exc).__name__ in (
        "ActorDiedError", "RayActorError", "ActorUnavailableError", "GetTimeoutError")


def _summary(exc: BaseException, limit: int = 300) -> str:
    """One line for reasons and error bodies (Ray's messages run to many lines, and a 5xx
    body keeps only the first); the log has the whole exception."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_last(item) -> bool:
    return isinstance(item, BaseException) or item.finished


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """loop.call_soon_threadsafe(fn, *args), or False where that loop has closed (a caller's
    asyncio.run ended with its stream open): the engine thread must outlive any caller."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _deliver(batch: list[tuple[EventSink, GenerationEvent]]) -> None:
    for sink, ev in batch:
        sink.put_nowait(ev)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

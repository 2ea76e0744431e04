"""Rank 0 of a replica with the engine core in the same process ("engine core").

The scheduler and rank 0's model runner share one process, so at tp = 1 a step needs no
inter-process call at all; ranks 1..tp-1 follow over the control channel. The step loop runs
in its own thread; the driver's calls (submit_many, abort, and one long poll that returns every
output produced since the last one) run in other threads of this threaded actor and only
touch a queue and a condition variable, so they never block a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from tpserve.config import EngineConfig
from tpserve.engine.core import EngineCore
from tpserve.engine.guided import GuidedVocab
from tpserve.engine.heap import IdleCollector, freeze_startup_objects
from tpserve.engine.outputs import TokenOutput, pack_outputs
from tpserve.engine.request import SamplingParams
from tpserve.engine.step_trace import StepTrace
from tpserve.errors import TPServeError
from tpserve.startup import now

log = logging.getLogger(__name__)

# The gauges walk every sequence (work_tokens), in a poll thread that holds the GIL against
# the step loop; polls come once per step, so they are recomputed at most this often
# (always when the core is idle, so the last poll of a burst reports settled values). The
# step counters are read on every poll.
STATS_PERIOD_S = 0.1


class EngineCoreActor:
    def __init__(self, cfg: EngineConfig, followers: list | None = None) -> None:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # Imported here, in the shard's process: the driver imports this module to create
        # the actor and must not wait for torch first (seconds before the shards are placed).
        from tpserve.worker.worker import Worker

        # Ranks 1..tp-1 (actor handles): given here or, so that rank 0 can be placed first,
        # with start().
        self.cfg, self.followers = cfg, list(followers or [])
        self.worker = Worker(cfg, 0)
        self.core: EngineCore | None = None
        self._prep_lock = threading.Lock()  # prepare() runs once; start() waits for it
        self._prep_error: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._out: list[TokenOutput] = []
        self._error: tuple[str, str, bool] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict = {}
        self._stats_at = float("-inf")
        self._trace = StepTrace.from_env()  # TPSERVE_STEP_TRACE: a timeline of the steps

    def __repr__(self) -> str:
        # What `ray list actors` and the dashboard's actors view show: rank 0 hosts the core.
        return f"EngineCore({self.worker!r})"

    def prepare(self, followers: list | None = None) -> None:
        """Set up every rank (process group, weights, KV cache, warmup, graphs) and build the
        engine core. The driver calls this as soon as the shards are placed, so the set-up
        runs while it loads the tokenizer; start() then waits for it. Once only: a second
        call (start's) waits for the first and raises its error, if any."""
        with self._prep_lock:
            if self._prep_error is not None:
                raise self._prep_error
            if self.core is not None:
                return
            from tpserve.executor.rank0 import Rank0Executor
            from tpserve.weights import load_hf_config

            self.worker.marks["prepare"] = now()
            if followers is not None:
                self.followers = list(followers)
            try:
                executor = Rank0Executor(self.worker, self.followers,
                                         self.cfg.parallel.dist_timeout_s)
                hf = self.worker.hf_config or load_hf_config(self.cfg.model.path)
                # The end-of-sequence ids come with start(); no step runs before it.
                self.core = EngineCore(self.cfg, executor, hf, set())
            except BaseException as exc:
                self._prep_error = exc
                raise

    def start(self, eos_ids: list[int], followers: list | None = None) -> dict:
        """Set up (unless prepare() did), then start the step loop with the tokenizer's
        end-of-sequence ids; what the driver needs to validate and report."""
        self.prepare(followers)
        self.worker.marks["start"] = now()
        self.core.eos_ids = frozenset(eos_ids)
        freeze_startup_objects()  # full collections would walk the model's objects mid-step
        self._thread = threading.Thread(target=self._loop, name="tpserve-core", daemon=True)
        self._thread.start()
        c = self.core
        return {"num_blocks": c.num_blocks, "load_reports": c.load_reports,
                "warmup_seconds": c.warmup_seconds, "max_input_tokens": c.max_input_tokens,
                "max_model_len": c.max_model_len, "loops": c.executor.loops,
                "marks": {**self.worker.marks, "loop": now()},
                # The idle gauges, so /metrics has them before the first poll.
                "stats": c.stats()}

    # --- driver calls (other threads) ---------------------------------------------------
    def submit_many(self, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
        """Requests taken together at the next step boundary; for each, ("ok", seq_id,
        params with the seed filled in) or ("error", class name, message)."""
        fut: Future = Future()
        self._inbox.put(("add", requests, None, fut))
        return fut.result()

    def abort(self, seq_ids: list[int]) -> None:
        self._inbox.put(("abort", seq_ids, None, None))

    def set_guided_vocab(self, vocab: GuidedVocab | None) -> None:
        """The tokenizer's vocabulary for guided requests (the driver sends it before the
        first one). The library's tokenizer is built here, in this call's thread: about a
        second for a large vocabulary, which the step loop does not wait for."""
        if vocab is not None:
            vocab.lltokenizer()
        self.core.set_guided_vocab(vocab)

    def poll(self, timeout_s: float) -> tuple[dict, dict, tuple | None]:
        """Every output since the last poll, packed (waits up to timeout_s for one), the
        engine's gauges, and (class name, message, replica dead) if a step failed."""
        with self._cv:
            self._cv.wait_for(lambda: self._out or self._error, timeout=timeout_s)
            out, self._out = self._out, []
            err, self._error = self._error, None
        return pack_outputs(out), self._gauges(), err

    def _gauges(self) -> dict:
        core, now = self.core, time.monotonic()
        if core is None:
            return {}
        if now - self._stats_at >= STATS_PERIOD_S or not core.requests:
            self._stats, self._stats_at = core.stats(), now
            return self._stats
        return {**self._stats, **core.counters()}

    def health(self) -> dict:
        return self.worker.health()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.core is not None:
            self.core.shutdown()

    # --- step loop (its own thread) -----------------------------------------------------
    def _loop(self) -> None:
        core, trace = self.core, self._trace
        collector = IdleCollector()
        while not self._stop.is_set():
            if trace is not None and not core.has_work():
                trace.flush()  # idle: the file write costs no step
            self._drain(block=not core.has_work())
            if self._stop.is_set() or not core.has_work():
                collector.idle()
                continue
            collector.busy()
            if trace is not None:
                before, t0, p0 = core.counters(), time.time(), time.perf_counter()
            try:
                outputs, _ = core.step()
            except Exception as exc:  # noqa: BLE001 - reported to the driver through poll
                log.exception("step failed; failing the requests in flight")
                for seq_id in list(core.requests):
                    core.abort(seq_id)
                dead = bool(getattr(exc, "replica_dead", False))
                with self._cv:
                    self._error = (type(exc).__name__, str(exc), dead)
                    self._cv.notify_all()
                continue
            if trace is not None:
                trace.step(t0, time.perf_counter() - p0, before, core.counters(), len(outputs))
            if outputs:
                with self._cv:
                    self._out.extend(outputs)
                    self._cv.notify_all()
        if trace is not None:
            trace.flush()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, a, b, fut = item
            if kind == "abort":
                for seq_id in a:
                    self.core.abort(seq_id)
            else:
                if self._trace is not None:
                    self._trace.event("add", len(a))
                try:
                    fut.set_result([("error", type(r).__name__, str(r))
                                    if isinstance(r, TPServeError)
                                    else ("ok", r.seq_id, r.params)
                                    for r in self.core.add_requests(a)])
                except Exception as exc:  # noqa: BLE001 - never leave the caller waiting
                    fut.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

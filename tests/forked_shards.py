"""tp shards as processes forked from a clean server process, for the oracle matrices.

Each rank runs the shard Worker a Ray actor runs (process group, weights, cache, steps over
the control channel from rank 0, gloo all-reduces), so what the matrices check (each rank's
slice, the collectives between them, the tokens against transformers) is what a Ray replica
computes. Only the transport differs: a pipe per rank instead of Ray calls. A Ray actor's
start costs ~4 s of CPU (Python, Ray, torch) and a tp = 4 case started four of them on two
cores; a forked child has torch imported already and starts in milliseconds. The Ray path
(placement, actors, their failures) has its own tests: test_tp_llama.py, test_fault.py,
test_e2e_families.py and the launch tests.

The ranks are forked by multiprocessing's fork server, a process started once per test
session that imports torch and the worker and does nothing else, not by the test process:
that one has run Ray, transformers, tqdm's monitor and engine threads by the time it forks,
and ranks forked from it twice died in their first call with glibc's "unaligned fastbin
chunk detected" (CI, 2026-12-07: once with Ray running, once after it had been stopped).
The server holds no rank's pipe, so a rank whose test process is killed reads EOF and
exits, where a rank forked from the test process also held the earlier ranks' ends.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from typing import Any

from tpserve.config import EngineConfig
from tpserve.engine.step import StepBatch, StepOutput
from tpserve.executor.base import Executor, ShardFailedError

_CALL_TIMEOUT_S = 300.0
# What the fork server imports once, so that a rank starts in ~0.1 s, not ~6 s: torch and
# the worker, and what a Worker imports when it reads a checkpoint's config (transformers'
# config classes, whose validators take ~2 s, and torch._dynamo). A name a version lacks
# is skipped by the server (ImportError), costing that rank its import only.
_PRELOAD = ["forked_shards", "tpserve.worker.worker", "torch._dynamo", "transformers",
            "transformers.configuration_utils", "transformers.utils.type_validators",
            "transformers.models.auto.configuration_auto"]


def _serve(cfg: EngineConfig, rank: int, conn) -> None:
    """A rank's process: answer (method, args) calls on its Worker until "exit"."""
    import torch

    from tpserve.worker.worker import Worker

    faulthandler.enable(all_threads=True)  # a crash prints the rank's Python stack
    torch.set_num_threads(cfg.parallel.cpus_per_shard)  # as Ray sets it for an actor
    worker = Worker(cfg, rank)
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the test process is gone (killed): no one to answer
            break
        if method == "exit":
            break
        if method == "abort":  # as glibc aborts a process on a corrupt heap (the tests')
            os.abort()
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except BaseException as exc:  # noqa: BLE001 - sent to the test process, raised there
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except OSError:  # as above: its end of the pipe is closed
            break
    conn.close()
    os._exit(0)  # no atexit handlers (the fork server's)


def _exit_reason(proc) -> str:
    proc.join(1)
    code = proc.exitcode
    if code is None:
        return "still running, its end of the pipe closed"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class ForkedShards(Executor):
    """Executor over tp forked processes; rank 0 runs each step and broadcasts it to ranks
    1..tp-1, whose follow() loops run it, as with Ray actors."""

    def __init__(self, cfg: EngineConfig) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first use)
        self.conns, self.procs = [], []
        for rank in range(cfg.parallel.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(cfg, rank, child), daemon=True,
                               name=f"forked-shard-{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.following = False

    def _send(self, rank: int, method: str, *args: Any) -> None:
        try:
            self.conns[rank].send((method, args))
        except OSError as exc:  # the rank's end is closed: it died
            raise ShardFailedError(f"forked shard {rank} is gone "
                                   f"({_exit_reason(self.procs[rank])})") from exc

    def _recv(self, rank: int, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(1.0):  # a rank that died says so now, not at the deadline
            if not proc.is_alive():
                raise ShardFailedError(f"forked shard {rank} died ({_exit_reason(proc)}) "
                                       "before answering; its stderr is above")
            if time.monotonic() > deadline:
                raise ShardFailedError(f"forked shard {rank} did not answer in "
                                       f"{timeout_s:.0f}s")
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as exc:  # its end closed (a duplex pipe is a socket)
            raise ShardFailedError(f"forked shard {rank} exited "
                                   f"({_exit_reason(proc)})") from exc
        if status == "error":
            raise ShardFailedError(f"forked shard {rank} failed: {value}")
        return value

    def _all(self, method: str, *args: Any) -> list:
        """Every rank at once: calls that meet in a collective must pair up."""
        for rank in range(len(self.conns)):
            self._send(rank, method, *args)
        return [self._recv(rank) for rank in range(len(self.conns))]

    def start(self) -> list:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._all("init_distributed", "127.0.0.1", port)
        return self._all("load_weights")

    def available_blocks(self) -> int:
        return min(self._all("available_blocks"))

    def allocate_cache(self, num_blocks: int) -> None:
        self._all("allocate_cache", num_blocks)

    def warmup(self, batch_sizes: tuple[int, ...]) -> float:
        seconds = max(self._all("warmup", batch_sizes))
        for rank in range(1, len(self.conns)):
            self._send(rank, "follow")
        self.following = True
        return seconds

    def execute_step(self, batch: StepBatch) -> StepOutput:
        self._send(0, "execute", batch)
        return self._recv(0)

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        if self.following:  # a follower answers only when its loop ends
            return [self._call0("health", timeout_s)]
        return self._all("health")

    def _call0(self, method: str, timeout_s: float) -> Any:
        self._send(0, method)
        return self._recv(0, timeout_s)

    def shutdown(self) -> None:
        if not self.procs:
            return
        try:
            if self.following:
                self._call0("stop_followers", 30)
                for rank in range(1, len(self.conns)):
                    self._recv(rank, 30)
            self._all("shutdown")
            for conn in self.conns:
                conn.send(("exit", ()))
        except (ShardFailedError, OSError):
            pass  # a dead rank cannot be stopped; it is killed below
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []

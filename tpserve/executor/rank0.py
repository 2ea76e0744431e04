"""The executor the engine core uses when it runs inside rank 0's own process: rank 0's
Worker is called directly (a step needs no inter-process call at tp = 1), ranks 1..tp-1 are
Ray actors reached only for set-up; each step reaches them through the control channel that
rank 0's Worker.execute broadcasts on."""

from __future__ import annotations

import time

import ray

from tpserve.cluster.device import collective_failed
from tpserve.engine.step import StepBatch, StepOutput
from tpserve.executor.base import Executor, ShardFailedError
from tpserve.worker.model_runner import PendingStep
from tpserve.worker.worker import LoadReport, Worker

# How often the step path checks that the followers' loops are still running. A dead peer
# also fails rank 0's next collective (gloo) or the driver's own watch (any backend).
_WATCH_EVERY_S = 0.1
# After a failed step, how long to wait for a dead follower's loop to be reported (Ray
# notices a killed process within about a second; the collective fails at once).
_GRACE_S = 5.0


class Rank0Executor(Executor):
    def __init__(self, worker: Worker, followers: list, timeout_s: float) -> None:
        self.worker, self.followers, self.timeout_s = worker, followers, timeout_s
        self.loops: list = []  # follow() of ranks 1..tp-1, started after warmup
        self._next_watch = 0.0

    def _all(self, method: str, *args) -> list:
        """Call `method` on every rank at once (rank 0 in this thread), so calls that meet in
        a collective (process-group set-up, graph capture) can pair up."""
        refs = [getattr(f, method).remote(*args) for f in self.followers]
        local = getattr(self.worker, method)(*args)
        return [local, *ray.get(refs, timeout=self.timeout_s)]

    def start(self) -> list[LoadReport]:
        addr, port = self.worker.node_ip(), self.worker.free_port()
        self._all("init_distributed", addr, port)
        return self._all("load_weights")

    def available_blocks(self) -> int:
        return min(self._all("available_blocks"))

    def allocate_cache(self, num_blocks: int) -> None:
        self._all("allocate_cache", num_blocks)

    def warmup(self, batch_sizes: tuple[int, ...]) -> float:
        seconds = max(self._all("warmup", batch_sizes))
        self.loops = [f.follow.remote() for f in self.followers]
        return seconds

    def execute_step(self, batch: StepBatch) -> StepOutput:
        return self.collect(self.launch_step(batch))

    def launch_step(self, batch: StepBatch) -> PendingStep:
        now = time.monotonic()
        if self.loops and now >= self._next_watch:
            self._next_watch = now + _WATCH_EVERY_S
            done, _ = ray.wait(self.loops, num_returns=1, timeout=0)
            if done:
                raise ShardFailedError(f"shard {1 + self.loops.index(done[0])}'s step loop "
                                       "ended; the replica must be restarted")
        try:
            return self.worker.launch(batch)
        except Exception as exc:
            raise self._why(exc) from exc

    def collect(self, handle: PendingStep) -> StepOutput:
        try:
            return handle.result()
        except Exception as exc:  # a device error surfaces when its results are waited for
            raise self._why(exc) from exc

    def _why(self, exc: Exception) -> Exception:
        """What a failed step means: a lost or hung shard (ShardFailedError), or exc."""
        if not self.loops:
            return exc
        # A collective that fails because a peer died (gloo: "connection reset by peer")
        # is a lost shard, not a bad step: the group cannot step again.
        done, _ = ray.wait(self.loops, num_returns=1, timeout=_GRACE_S)
        if done:
            return ShardFailedError(f"shard {1 + self.loops.index(done[0])} was lost (its "
                                    f"step loop ended); rank 0 saw: {type(exc).__name__}: "
                                    f"{exc}")
        if collective_failed(exc):  # a hung peer: the collective timed out
            return ShardFailedError(f"a collective of the shard group failed (a peer is hung "
                                    f"or unreachable): {type(exc).__name__}: {exc}")
        return exc

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        refs = [f.health.remote() for f in self.followers]
        return [self.worker.health(), *ray.get(refs, timeout=timeout_s)]

    def shutdown(self) -> None:
        try:
            if self.loops:
                self.worker.stop_followers()
                ray.get(self.loops, timeout=10)
            ray.get([f.shutdown.remote() for f in self.followers], timeout=10)
        except Exception:  # noqa: BLE001 - a dead rank cannot be stopped; the launcher kills it
            pass
        self.worker.shutdown()

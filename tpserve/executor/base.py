"""The interface between the engine (scheduling, no torch) and the model shards."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tpserve.engine.step import StepBatch, StepOutput


class ShardFailedError(RuntimeError):
    """A shard died or its step loop failed: the replica cannot serve until rebuilt."""

    replica_dead = True


class Executor(ABC):
    """Runs steps on every shard of one model replica. Methods are called from one thread
    (the engine loop) in this order: start, available_blocks, allocate_cache, warmup, then
    execute_step (or launch_step then collect) any number of times, health at any time after
    start, shutdown last."""

    @abstractmethod
    def start(self) -> list[Any]:
        """Set up the process group and load the weights; each rank's LoadReport."""

    @abstractmethod
    def available_blocks(self) -> int:
        """KV blocks that fit on every shard (the minimum over ranks)."""

    @abstractmethod
    def allocate_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def warmup(self, batch_sizes: tuple[int, ...]) -> float:
        """Compile kernels and capture graphs for these batch sizes; seconds taken."""

    @abstractmethod
    def execute_step(self, batch: StepBatch) -> StepOutput:
        """Run one step on every rank; rank 0's sampled tokens. Raises when any rank fails
        (never hangs on a dead one)."""

    def launch_step(self, batch: StepBatch) -> Any:
        """Start one step and return a handle for collect(), ideally before the device is
        done (overlapped steps: the engine prepares the next step meanwhile). Steps run in
        launch order. This default runs the whole step here."""
        return self.execute_step(batch)

    def collect(self, handle: Any) -> StepOutput:
        """The output of a launched step (waits for its sampled tokens)."""
        return handle

    @abstractmethod
    def health(self, timeout_s: float = 10.0) -> list[dict]:
        """One dict per rank; raises when a rank is dead or does not answer in time."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release devices, process groups and any actors; safe to call twice."""

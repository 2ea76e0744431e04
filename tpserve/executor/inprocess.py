"""tp = 1 in the calling process, no Ray: tests, benchmarks and single-device use."""

from __future__ import annotations

from tpserve.config import EngineConfig
from tpserve.engine.step import StepBatch, StepOutput
from tpserve.executor.base import Executor
from tpserve.worker.model_runner import PendingStep
from tpserve.worker.worker import LoadReport, Worker


class InProcessExecutor(Executor):
    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.parallel.tp_size != 1:
            raise ValueError(f"InProcessExecutor runs tp = 1 only (got --tp "
                             f"{cfg.parallel.tp_size}); use RayExecutor for more shards")
        self.worker = Worker(cfg, 0)

    def start(self) -> list[LoadReport]:
        self.worker.init_distributed("127.0.0.1", 0)
        return [self.worker.load_weights()]

    def available_blocks(self) -> int:
        return self.worker.available_blocks()

    def allocate_cache(self, num_blocks: int) -> None:
        self.worker.allocate_cache(num_blocks)

    def warmup(self, batch_sizes: tuple[int, ...]) -> float:
        return self.worker.warmup(batch_sizes)

    def execute_step(self, batch: StepBatch) -> StepOutput:
        return self.worker.execute(batch)

    def launch_step(self, batch: StepBatch) -> PendingStep:
        return self.worker.launch(batch)

    def collect(self, handle: PendingStep) -> StepOutput:
        return handle.result()

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        return [self.worker.health()]

    def shutdown(self) -> None:
        self.worker.shutdown()

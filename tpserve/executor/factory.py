"""Building an executor for a config: what the driver, tests and benchmarks call before they
construct an Engine around it."""

from __future__ import annotations

from tpserve.config import EngineConfig
from tpserve.executor.base import Executor


def build_executor(cfg: EngineConfig, hf_config=None, in_process: bool = False) -> Executor:
    """Check that the checkpoint shards at this tp (on the meta device, before any actor is
    placed), then build the in-process executor (tp = 1, no Ray) or the Ray one."""
    from tpserve.weights import load_hf_config
    from tpserve.worker.build import check_shardable

    check_shardable(cfg, hf_config or load_hf_config(cfg.model.path))
    if in_process:
        from tpserve.executor.inprocess import InProcessExecutor

        return InProcessExecutor(cfg)
    from tpserve.executor.ray_executor import RayExecutor

    return RayExecutor(cfg)

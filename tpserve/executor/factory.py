"""Building an executor for a config: what the driver, tests and benchmarks call before they
construct an Engine around it."""

from __future__ import annotations

from tpserve.config import EngineConfig
from tpserve.executor.base import Executor


def build_executor(cfg: EngineConfig, hf_config=None, in_process: bool = False) -> Executor:
    """Check that the checkpoint shards at this tp (on the meta device, before any actor is
    placed), then build the in-process executor (tp = 1, no Ray) or the Ray one. The Ray
    shards get the config as plain data, as `tpserve launch` hands it to them: reading it
    again with transformers cost each shard process ~4 s of CPU (its config machinery)."""
    from dataclasses import replace

    from tpserve.hf_config import quiet_snapshot
    from tpserve.weights import load_hf_config
    from tpserve.worker.build import check_shardable

    hf_config = hf_config or load_hf_config(cfg.model.path)
    check_shardable(cfg, hf_config)
    if in_process:
        from tpserve.executor.inprocess import InProcessExecutor

        return InProcessExecutor(cfg)
    from tpserve.executor.ray_executor import RayExecutor

    if not cfg.model.hf_snapshot:
        cfg = replace(cfg, model=replace(cfg.model, hf_snapshot=quiet_snapshot(hf_config)))
    return RayExecutor(cfg)

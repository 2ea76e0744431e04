"""Building an executor for a config: what the driver, tests and benchmarks call before they
construct an Engine around it."""

from __future__ import annotations

from tpserve.config import EngineConfig
from tpserve.executor.base import Executor


def _checked(cfg: EngineConfig, hf_config=None):
    """The checkpoint's config, once it is known to shard at this tp (checked on the meta
    device, before any process is placed)."""
    from tpserve.weights import load_hf_config
    from tpserve.worker.build import check_shardable

    hf_config = hf_config or load_hf_config(cfg.model.path)
    check_shardable(cfg, hf_config)
    return hf_config


def shard_config(cfg: EngineConfig, hf_config=None) -> EngineConfig:
    """cfg for shard processes, after the check: with the checkpoint's config as plain data,
    as `tpserve launch` hands it to its shards (reading it again with transformers cost each
    shard process ~4 s of CPU: its config machinery)."""
    from dataclasses import replace

    from tpserve.hf_config import quiet_snapshot

    hf_config = _checked(cfg, hf_config)
    if cfg.model.hf_snapshot:
        return cfg
    return replace(cfg, model=replace(cfg.model, hf_snapshot=quiet_snapshot(hf_config)))


def build_executor(cfg: EngineConfig, hf_config=None, in_process: bool = False) -> Executor:
    """The in-process executor (tp = 1, no Ray) or the Ray one, each after the check."""
    if in_process:
        from tpserve.executor.inprocess import InProcessExecutor

        _checked(cfg, hf_config)
        return InProcessExecutor(cfg)
    from tpserve.executor.ray_executor import RayExecutor

    return RayExecutor(shard_config(cfg, hf_config))

"""The tp shard actors of one model replica: placement, process-group set-up, loading, and
the per-step fan-out."""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpserve.cluster.device import ray_bundle
from tpserve.cluster.placement import check_placement, cluster_nodes, ray_strategy
from tpserve.cluster.shard_worker import LoadReport, ShardWorker
from tpserve.config import EngineConfig
from tpserve.engine.step import StepBatch, StepOutput

log = logging.getLogger(__name__)

ShardActor = ray.remote(ShardWorker)


class WorkerGroup:
    def __init__(self, cfg: EngineConfig, placement_timeout_s: float = 120.0,
                 namespace: str | None = None) -> None:
        self.cfg = cfg
        tp, device = cfg.parallel.tp_size, cfg.parallel.device
        bundle = ray_bundle(device, cfg.parallel.cpus_per_shard)
        try:
            check_capacity(bundle, tp)
            check_placement(cfg.parallel.placement, bundle, tp, cluster_nodes())
        except RuntimeError as exc:
            if not cfg.parallel.ray_address:
                raise
            # A joined cluster may autoscale: wait for the placement group instead.
            log.warning("%s Waiting up to %.0fs in case the cluster scales up.", exc,
                        placement_timeout_s)
        self.pg = placement_group([bundle] * tp, strategy=ray_strategy(cfg.parallel.placement),
                                  name=f"tpserve-{uuid.uuid4().hex[:8]}")
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"Ray could not place {tp} shard(s) of {bundle} within {placement_timeout_s:.0f}s;"
                f" the cluster has {ray.available_resources()}. Lower --tp, lower "
                "--cpus-per-shard, or add nodes/devices.") from None
        gpus = 1 if device != "cpu" else 0
        namespace = namespace or ray.get_runtime_context().namespace
        suffix = "" if _name_free("shard-0", namespace) else f"-{uuid.uuid4().hex[:6]}"
        self.names = [f"shard-{rank}{suffix}" for rank in range(tp)]
        cpus = cfg.parallel.cpus_per_shard if device == "cpu" else 1
        self.actors = [
            ShardActor.options(
                name=self.names[rank], namespace=namespace,
                num_cpus=cpus, num_gpus=gpus, max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank),
            ).remote(cfg, rank)
            for rank in range(tp)
        ]

    def start(self) -> list[LoadReport]:
        """Process group, weights; returns each rank's load report."""
        t0 = time.perf_counter()
        rank0 = self.actors[0]
        addr, port = ray.get([rank0.node_ip.remote(), rank0.free_port.remote()])
        backends = ray.get([a.init_distributed.remote(addr, port) for a in self.actors])
        log.info("process group up in %.1fs (backend %s, master %s:%d)",
                 time.perf_counter() - t0, backends[0], addr, port)
        reports = ray.get([a.load_weights.remote() for a in self.actors])
        return reports

    def available_blocks(self) -> int:
        return min(ray.get([a.available_blocks.remote() for a in self.actors]))

    def allocate_cache(self, num_blocks: int) -> None:
        ray.get([a.allocate_cache.remote(num_blocks) for a in self.actors])

    def warmup(self, batch_sizes: tuple[int, ...]) -> float:
        return max(ray.get([a.warmup.remote(batch_sizes) for a in self.actors]))

    def execute(self, batch: StepBatch) -> StepOutput:
        """Every rank runs the step (they meet in the all-reduces); rank 0 answers. Waiting
        on all ranks surfaces an error on any of them instead of hanging."""
        refs = [a.execute.remote(batch) for a in self.actors]
        return ray.get(refs)[0]

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        return ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)

    def shutdown(self) -> None:
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
        except Exception:  # noqa: BLE001 - tearing down; a dead actor needs no shutdown
            pass
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)


def check_capacity(bundle: dict[str, float], tp: int) -> None:
    """Refuse at once when the whole cluster could never hold tp shards (rather than wait
    for a placement group that cannot be placed)."""
    total = ray.cluster_resources()
    short = {k: (v * tp, total.get(k, 0.0)) for k, v in bundle.items() if total.get(k, 0.0) < v * tp}
    if short:
        need = ", ".join(f"{need:g} {k} (the cluster has {have:g})" for k, (need, have) in short.items())
        raise RuntimeError(
            f"--tp {tp} needs {need}: one shard takes {bundle}. Lower --tp or "
            "--cpus-per-shard, add nodes, or join a bigger cluster with --address.")


def _name_free(name: str, namespace: str) -> bool:
    """Named actors must be unique per namespace: a second replica on the same cluster gets
    suffixed names rather than a collision."""
    try:
        ray.get_actor(name, namespace=namespace)
        return False
    except ValueError:
        return True

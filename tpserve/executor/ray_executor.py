"""The tp shard actors of one model replica, placed by Ray, driven through the Executor
interface."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpserve.cluster.placement import group_name, place_shards, ray_bundle, shard_names
from tpserve.config import EngineConfig
from tpserve.engine.step import StepBatch, StepOutput
from tpserve.executor.base import Executor, ShardFailedError
from tpserve.worker.worker import LoadReport, Worker

log = logging.getLogger(__name__)


ShardActor = ray.remote(Worker)


class RayExecutor(Executor):
    def __init__(self, cfg: EngineConfig, placement_timeout_s: float = 120.0,
                 namespace: str | None = None) -> None:
        self.cfg = cfg
        tp, device = cfg.parallel.tp_size, cfg.parallel.device
        bundle = ray_bundle(device, cfg.parallel.cpus_per_shard)
        namespace = namespace or ray.get_runtime_context().namespace
        self.names = shard_names(tp, namespace)
        self.pg = place_shards(bundle, tp, bool(cfg.parallel.ray_address), placement_timeout_s,
                               cfg.parallel.placement, name=group_name(self.names))
        cpus = cfg.parallel.cpus_per_shard if device == "cpu" else 1
        self.actors = [
            ShardActor.options(
                name=self.names[rank], namespace=namespace,
                # 2 threads: health() answers while a follower runs its step loop.
                num_cpus=cpus, num_gpus=1 if device != "cpu" else 0, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank),
            ).remote(cfg, rank)
            for rank in range(tp)
        ]
        self.loops: list[ray.ObjectRef] = []  # follow() of ranks 1..tp-1, once started
        self.timeout_s = cfg.parallel.dist_timeout_s

    def start(self) -> list[LoadReport]:
        """Process group, weights; returns each rank's load report."""
        t0 = time.perf_counter()
        rank0 = self.actors[0]
        addr, port = ray.get([rank0.node_ip.remote(), rank0.free_port.remote()])
        backends = ray.get([a.init_distributed.remote(addr, port) for a in self.actors])
        log.info("process group up in %.1fs (backend %s, master %s:%d)",
                 time.perf_counter() - t0, backends[0], addr, port)
        return ray.get([a.load_weights.remote() for a in self.actors])

    def available_blocks(self) -> int:
        return min(ray.get([a.available_blocks.remote() for a in self.actors]))

    def allocate_cache(self, num_blocks: int) -> None:
        ray.get([a.allocate_cache.remote(num_blocks) for a in self.actors])

    def warmup(self, batch_sizes: tuple[int, ...]) -> float:
        return max(ray.get([a.warmup.remote(batch_sizes) for a in self.actors]))

    def execute_step(self, batch: StepBatch) -> StepOutput:
        """One Ray call to rank 0, which broadcasts the step to the other ranks' loops over
        the control channel. Waiting on rank 0 together with the loops' results surfaces a
        dead or failed rank at once instead of a hang in a collective."""
        if not self.loops and len(self.actors) > 1:
            self.loops = [a.follow.remote() for a in self.actors[1:]]
        ref = self.actors[0].execute.remote(batch)
        ready, _ = ray.wait([ref, *self.loops], num_returns=1, timeout=self.timeout_s)
        if ref not in ready:
            if not ready:
                raise ShardFailedError(f"a step took longer than the collective timeout "
                                       f"({self.timeout_s:.0f}s); the replica is stuck")
            rank = 1 + self.loops.index(ready[0])
            try:
                ray.get(ready[0])
                why = "its step loop ended"
            except Exception as exc:  # noqa: BLE001 - reported with the rank below
                why = f"{type(exc).__name__}: {exc}"
            raise ShardFailedError(f"shard {rank} ({self.names[rank]}) failed: {why}")
        return ray.get(ref)

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        return ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)

    def shutdown(self) -> None:
        try:
            if self.loops:
                ray.get(self.actors[0].stop_followers.remote(), timeout=10)
                ray.get(self.loops, timeout=10)
        except Exception:  # noqa: BLE001 - a dead rank cannot be stopped; it is killed below
            pass
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=10)
        except Exception:  # noqa: BLE001 - tearing down; a dead actor needs no shutdown
            pass
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.pg)

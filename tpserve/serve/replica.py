"""One model replica as a Ray Serve deployment: the same engine the direct server runs (the
engine core in rank 0's actor, followers, tokenizer and output processor here), with its
shards placed in the bundles Serve reserved for this replica.

Bundle 0 of a replica's placement group holds the replica actor itself (Serve places it
there); bundles 1..tp hold shards 0..tp-1. Serve captures child actors into the group, so
when Serve replaces a replica, its shards go with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tpserve.cluster.core_client import CoreClient
from tpserve.cluster.follower import FollowerActor
from tpserve.cluster.placement import ray_bundle
from tpserve.config import EngineConfig
from tpserve.engine.async_engine import AsyncEngine
from tpserve.engine.info import ModelInfo
from tpserve.engine.request import GenerationEvent, SamplingParams
from tpserve.errors import NotReadyError
from tpserve.serve.loopback import keep_replica_grpc_on_loopback

log = logging.getLogger(__name__)

_END = object()  # the request's last event was queued

# What the replica actor itself reserves: it tokenizes, detokenizes and relays tokens.
REPLICA_CPUS = 0.25


def replica_bundles(cfg: EngineConfig, shard_cpus: float | None = None) -> list[dict]:
    """Serve's placement_group_bundles for one replica: the replica actor, then one bundle
    per shard (shard_cpus overrides the CPU device's cores per shard, fractions allowed)."""
    shard = ray_bundle(cfg.parallel.device, cfg.parallel.cpus_per_shard)
    if shard_cpus is not None and cfg.parallel.device == "cpu":
        shard = {"CPU": float(shard_cpus)}
    return [{"CPU": REPLICA_CPUS}] + [dict(shard) for _ in range(cfg.parallel.tp_size)]


class ReplicaCoreClient(CoreClient):
    """CoreClient whose shards go into the replica's own placement group (Serve's), with
    names unique to the replica; the group belongs to Serve, so it is not removed here."""

    def __init__(self, cfg: EngineConfig, pg: PlacementGroup, bundles: list[dict],
                 replica_name: str) -> None:
        self._serve_pg, self._bundles, self._replica_name = pg, bundles, replica_name
        super().__init__(cfg)

    def _place(self, cfg: EngineConfig, namespace: str) -> None:
        tp = cfg.parallel.tp_size
        self.pg = self._serve_pg
        self.names = [f"{self._replica_name}-shard-{rank}" for rank in range(tp)]

        def opts(rank: int, concurrency: int) -> dict:
            b = self._bundles[1 + rank]
            return dict(name=self.names[rank], namespace=namespace, num_cpus=b.get("CPU", 0),
                        num_gpus=b.get("GPU", 0), max_concurrency=concurrency,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=1 + rank))

        from tpserve.cluster.engine_core_actor import EngineCoreActor

        # Rank 0 first, as CoreClient places it (the followers' handles go with start()).
        self.core = ray.remote(EngineCoreActor).options(**opts(0, 8)).remote(cfg)
        self.followers = [ray.remote(FollowerActor).options(**opts(r, 2)).remote(cfg, r)
                          for r in range(1, tp)]
        self.actors = [self.core, *self.followers]

    def shutdown(self) -> None:
        try:
            ray.get(self.core.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - tearing down; a dead actor needs no shutdown
            pass
        for a in self.actors:
            ray.kill(a)


class TPReplica:
    """The Serve deployment class of one replica (wrapped by serve.deployment in app.py)."""

    async def __init__(self, cfg: EngineConfig, bundles: list[dict],
                       grpc_on_loopback: bool = False) -> None:
        from ray import serve

        if grpc_on_loopback:
            keep_replica_grpc_on_loopback()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("TPReplica must run as a Serve replica with "
                               "placement_group_bundles (see tpserve/serve/app.py)")
        name = f"tpserve-{self.replica_id}"
        self.backend = AsyncEngine(lambda: ReplicaCoreClient(cfg, pg, bundles, name),
                                   cfg.model.model_id, cfg.scheduler.max_concurrent_requests)
        self.backend.start()
        # Serve counts the replica as starting until the constructor returns: it gets no
        # requests before every shard has loaded and warmed up.
        await asyncio.get_running_loop().run_in_executor(None, self.backend.wait_ready)
        self.tokens_out = 0
        log.info("replica %s ready (tp=%d)", self.replica_id, cfg.parallel.tp_size)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       truncate: int | None = None,
                       add_special_tokens: bool = True
                       ) -> AsyncIterator[list[GenerationEvent]]:
        """The request's events in lists: each list holds every event that was ready when
        the previous one was sent. Each list is one streamed Ray object, so a replica whose
        consumer falls behind sends several tokens per message instead of one each."""
        ready: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            events = self.backend.generate(prompt, params, truncate, add_special_tokens)
            try:
                async for event in events:
                    ready.put_nowait(event)
                ready.put_nowait(_END)
            except Exception as exc:  # noqa: BLE001 - re-raised to the caller below
                ready.put_nowait(exc)
            finally:  # cancelled (the caller left): closing it aborts the request
                await events.aclose()

        task = asyncio.get_running_loop().create_task(pump())
        try:
            while True:
                items = [await ready.get()]
                while not ready.empty():
                    items.append(ready.get_nowait())
                events = [i for i in items if isinstance(i, GenerationEvent)]
                if events:
                    self.tokens_out += len(events)
                    yield events
                for i in items:
                    if isinstance(i, BaseException):
                        raise i
                if _END in items:
                    return
        finally:  # the caller went away: cancelling the pump aborts the request
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def info(self) -> ModelInfo:
        return self.backend.info()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.backend.apply_chat_template(messages, tools=tools)

    def count_tokens(self, text: str, add_special_tokens: bool = True) -> int:
        return self.backend.count_tokens(text, add_special_tokens)

    def stats(self) -> dict[str, float]:
        s = self.backend.stats()
        s["tokens_generated"] = float(self.tokens_out)
        return s

    def status(self) -> dict:
        """What /info lists for this replica."""
        core = self.backend.engine
        return {"replica_id": self.replica_id, "ready": self.backend.ready(),
                "dead": self.backend.dead, "shards": list(getattr(core, "names", [])),
                "namespace": ray.get_runtime_context().namespace,
                "stats": self.stats(), "at": time.monotonic()}

    async def check_health(self) -> None:
        """Serve's health check: a replica with a dead shard raises, so Serve replaces it
        (its placement group, and the shards in it, go with it)."""
        if not self.backend.ready():
            raise NotReadyError(f"replica {self.replica_id} cannot serve: "
                                f"{self.backend.dead or self.backend.error or 'not ready'}")
        # In a thread: the shards' answers must not hold up the tokens this replica streams.
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.backend.engine.health(timeout_s=5.0))

    def record_routing_stats(self) -> dict[str, float]:
        """Read by Serve's controller about once a second and handed to every router
        (router.py weighs work_tokens; the ingress lists the rest on /info and /metrics)."""
        stats = {k: float(v) for k, v in self.stats().items() if isinstance(v, (int, float))}
        self._export(stats)
        return stats

    def _export(self, stats: dict[str, float]) -> None:
        """The same gauges as the Ray metric tpserve_replica{replica, stat} (Ray's Prometheus
        export and dashboard), refreshed whenever Serve collects routing stats."""
        try:
            if getattr(self, "_gauge", None) is None:
                from ray.util.metrics import Gauge

                self._gauge = Gauge("tpserve_replica", "tpserve replica state",
                                    tag_keys=("replica", "stat"))
            for name, value in stats.items():
                self._gauge.set(value, tags={"replica": self.replica_id, "stat": name})
        except Exception:  # noqa: BLE001 - metrics must never fail a health or stats call
            log.debug("ray metrics export failed", exc_info=True)

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.stop()

"""The Serve application: R replicas of TPReplica (tp shard bundles each) behind one ingress
serving today's HTTP routes; started by `tpserve launch --replicas R|auto`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from tpserve.config import EngineConfig
from tpserve.serve.replica import REPLICA_CPUS, replica_bundles

log = logging.getLogger(__name__)

APP_NAME = "tpserve"
REPLICA_DEPLOYMENT = "tpserve-replica"
INGRESS_DEPLOYMENT = "tpserve-ingress"


class AppExistsError(RuntimeError):
    """The cluster already serves a tpserve application: it is left alone."""


@dataclass(frozen=True)
class ReplicaSpec:
    """How many replicas and how they are placed and checked."""

    num_replicas: int = 1
    min_replicas: int | None = None    # both set: autoscale on requests in flight
    max_replicas: int | None = None
    shard_cpus: float | None = None    # CPU device: Ray CPUs per shard (fractions allowed)
    placement_strategy: str = "PACK"   # a replica's shards; STRICT_PACK keeps them on a node
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    router_kwargs: dict | None = None  # PolicyConfig fields
    # tpserve's own local cluster (no --address): Serve's inter-deployment gRPC servers go
    # on loopback too, as Ray's other ports (serve/loopback.py).
    grpc_on_loopback: bool = False

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def replicas_wanted(self) -> int:
        """The replicas GET /health waits for: all of them, or the least autoscaling keeps."""
        return (self.min_replicas or 1) if self.autoscaling else self.num_replicas


def replicas_that_fit(cfg: EngineConfig, shard_cpus: float | None = None) -> int:
    """`--replicas auto`: as many whole replicas as the cluster's devices (or CPUs) hold."""
    need, total, fits = _fit(cfg, shard_cpus)
    if fits < 1:
        raise RuntimeError(f"--replicas auto: one replica needs {need}, the cluster has "
                           f"{total}. Lower --tp, or add nodes/devices.")
    return fits


def check_replicas_fit(cfg: EngineConfig, wanted: int, shard_cpus: float | None = None) -> None:
    """Raise, naming what is missing, when the cluster cannot hold `wanted` replicas: Serve
    would wait for them without end (it only logs, every 30 s, that one is not scheduled)."""
    need, total, fits = _fit(cfg, shard_cpus)
    if fits < wanted:
        have = ", ".join(f"{total.get(k, 0.0):g} {k}" for k in need)
        each = ", ".join(f"{v:g} {k}" for k, v in need.items())
        raise RuntimeError(
            f"{wanted} replica(s) of tp={cfg.parallel.tp_size} need {each} each, and the "
            f"cluster has {have} in all: it holds {fits}. Lower --replicas (or --min-replicas), "
            "--tp or --cpus-per-shard, or add nodes/devices.")


def _fit(cfg: EngineConfig, shard_cpus: float | None):
    """(one replica's resources, the cluster's, how many whole replicas it holds)."""
    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for bundle in replica_bundles(cfg, shard_cpus):
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v
    return need, total, min(int(total.get(k, 0.0) // v) for k, v in need.items() if v > 0)


def build_application(cfg: EngineConfig, spec: ReplicaSpec, server=None):
    """The bound Serve application (pass to serve.run)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from tpserve.serve.ingress import TPServeIngress
    from tpserve.serve.replica import TPReplica
    from tpserve.serve.router import TPServeRequestRouter

    bundles = replica_bundles(cfg, spec.shard_cpus)
    opts: dict = dict(
        name=REPLICA_DEPLOYMENT,
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        placement_group_bundles=bundles,
        placement_group_strategy=spec.placement_strategy,
        max_ongoing_requests=cfg.scheduler.max_concurrent_requests,
        health_check_period_s=spec.health_check_period_s,
        health_check_timeout_s=spec.health_check_timeout_s,
        # In-flight generations get this long to finish when a replica is stopped.
        graceful_shutdown_timeout_s=10,
        # No access log on the replicas: the ingress polls each one's status every second
        # (for /info and /metrics), which logged two lines per replica per second on the
        # launch terminal; the ingress's own access log still lists every HTTP request.
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class=TPServeRequestRouter,
            request_router_kwargs=dict(spec.router_kwargs or {}),
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0),
    )
    if spec.autoscaling:
        lo = spec.min_replicas if spec.min_replicas is not None else 1
        hi = spec.max_replicas if spec.max_replicas is not None else max(lo, spec.num_replicas)
        opts["autoscaling_config"] = {
            "min_replicas": lo, "max_replicas": hi,
            "initial_replicas": min(max(lo, spec.num_replicas), hi),
            # Requests in flight per replica that Serve aims for: a quarter of what one
            # replica admits, so a replica is added well before requests are refused.
            "target_ongoing_requests": max(1, cfg.scheduler.max_concurrent_requests // 4),
        }
    else:
        opts["num_replicas"] = spec.num_replicas
    replica = serve.deployment(TPReplica).options(**opts)
    ingress = serve.deployment(serve.ingress()(TPServeIngress)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)
    loopback = spec.grpc_on_loopback
    return ingress.bind(replica.bind(cfg, bundles, grpc_on_loopback=loopback),
                        cfg.model.tokenizer_path, server, spec.replicas_wanted,
                        grpc_on_loopback=loopback, model_path=cfg.model.path)


def run(cfg: EngineConfig, spec: ReplicaSpec, host: str, port: int,
        blocking: bool = False, server=None) -> str:
    """Start Serve's HTTP proxy on host:port and deploy; returns the base URL once every
    replica has loaded."""
    import socket

    from ray import serve

    if port == 0:  # Serve's proxy needs a concrete port: take a free one
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    if APP_NAME in serve.status().applications:
        # serve.run would redeploy over it, and its shutdown would stop it: refuse instead.
        raise AppExistsError(
            f"this Ray cluster already runs a tpserve deployment with replicas (the Serve "
            f"application {APP_NAME!r}); a second one would replace it, and stopping either "
            "would stop both. Stop that one first, or start this one on another Ray cluster "
            "(or without --address)")
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(cfg, spec, server), name=APP_NAME, route_prefix="/",
              blocking=blocking)
    return f"http://{host}:{port}"


def drain(timeout_s: float, cancel=None) -> int | None:
    """New requests get 503 at the ingress, those in flight get timeout_s to finish (before
    shutdown() stops the replicas, which would cut them); how many were left, None when
    `cancel` (a threading.Event) was set first or the ingress did not answer."""
    import time

    from ray import serve

    try:
        ref = serve.get_app_handle(APP_NAME).drain.remote(timeout_s)
        deadline = time.monotonic() + timeout_s + 10.0
        while cancel is None or not cancel.is_set():
            try:
                return ref.result(timeout_s=0.5)
            except TimeoutError:
                if time.monotonic() > deadline:
                    break
    except Exception:  # noqa: BLE001 - no ingress left to drain: shut down anyway
        log.warning("could not drain the ingress before shutting down", exc_info=True)
    return None


def shutdown() -> None:
    from ray import serve

    try:
        serve.delete(APP_NAME)
    finally:
        serve.shutdown()

"""Ray placement of one replica's shards: a placement group of tp bundles, checked against
the cluster's capacity first, and collision-free actor names.

--placement chooses the placement-group strategy:

pack           as few nodes as possible, spilling over when one node is full (Ray's PACK);
               the default: all-reduces stay inside a node when they can
spread         one shard per node as far as the nodes go (SPREAD, best effort)
strict-pack    all shards on one node, or no placement at all (STRICT_PACK)
strict-spread  every shard on a different node, or no placement at all (STRICT_SPREAD)

The torch.distributed rendezvous needs nothing from this: the workers meet at the rank-0
shard's node address on a free port there, wherever that shard was placed.
"""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from tpserve.engine.build_wait import report_wait

log = logging.getLogger(__name__)

# A placement not ready after this long is waiting for resources: said on GET /health.
WAIT_NOTICE_S = 2.0


def ray_bundle(device: str, cpus_per_shard: int) -> dict[str, float]:
    """What one shard asks of Ray: CPU cores, or one accelerator."""
    if device == "cpu":
        return {"CPU": float(cpus_per_shard)}
    # One GPU each: a CUDA GPU, or an Intel XPU tile (Ray counts Intel GPUs as "GPU" and sets
    # ZE_AFFINITY_MASK when dpctl is installed; see accelerator_index otherwise).
    return {"GPU": 1.0, "CPU": 1.0}


def place_shards(bundle: dict[str, float], tp: int, joined_cluster: bool,
                 timeout_s: float = 120.0, placement: str = "pack",
                 name: str | None = None) -> PlacementGroup:
    """A ready placement group of tp bundles placed as --placement says; raises with what is
    missing. `name`: what the Ray dashboard shows for it (group_name(shard names))."""
    strategy = ray_strategy(placement)
    why = ""
    try:
        nodes = cluster_nodes()
        check_capacity(bundle, tp, nodes)
        check_placement(placement, bundle, tp, nodes)
    except RuntimeError as exc:
        if not joined_cluster:
            raise
        # A joined cluster may autoscale: wait for the placement group instead.
        why = f" {exc}"
        log.warning("%s Waiting up to %.0fs in case the cluster scales up.", exc, timeout_s)
    pg = placement_group([bundle] * tp, strategy=strategy,
                         name=name or f"tpserve-{uuid.uuid4().hex[:8]}")
    try:
        _wait_ready(pg, bundle, tp, timeout_s, why)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        free = ray.available_resources()
        hint = why or (" Something else may hold them (`ray status`, `ray list actors`): stop "
                       "it, or lower --tp or --cpus-per-shard, or add nodes/devices.")
        raise RuntimeError(
            f"Ray could not place {tp} shard(s) of {_fmt(bundle)} each within {timeout_s:.0f}s"
            f" (free now: {_fmt({k: free.get(k, 0.0) for k in bundle})}).{hint}") from None
    return pg


def _wait_ready(pg: PlacementGroup, bundle: dict[str, float], tp: int, timeout_s: float,
                why: str) -> None:
    """ray.get(pg.ready()) within timeout_s; after WAIT_NOTICE_S, say what it waits for
    (report_wait: /health shows it while a rebuild or the first load waits)."""
    started = time.monotonic()
    try:
        ray.get(pg.ready(), timeout=min(WAIT_NOTICE_S, timeout_s))
        return
    except ray.exceptions.GetTimeoutError:
        if timeout_s <= WAIT_NOTICE_S:
            raise
    free = ray.available_resources()
    report_wait(
        f"waiting for cluster resources: Ray cannot place {tp} shard(s) of {_fmt(bundle)} "
        f"each yet (free now: {_fmt({k: free.get(k, 0.0) for k in bundle})}).{why} It goes "
        f"on by itself when they appear (a node joins or another job frees them), waiting "
        f"up to {timeout_s:.0f}s for this attempt")
    try:
        ray.get(pg.ready(), timeout=max(0.0, timeout_s - (time.monotonic() - started)))
    finally:
        report_wait(None)


def check_capacity(bundle: dict[str, float], tp: int, nodes: list[dict[str, float]]) -> None:
    """Refuse at once when the cluster could never hold tp shards (rather than wait for a
    placement group that cannot be placed): too few resources in all, or nodes too small for
    a shard each (a bundle is never split across nodes). `nodes`: cluster_nodes()."""
    total = {k: sum(n.get(k, 0.0) for n in nodes) for k in bundle}
    short = {k: (v * tp, total[k]) for k, v in bundle.items() if total[k] < v * tp}
    if short:
        need = ", ".join(f"{need:g} {k} (the cluster has {have:g})" for k, (need, have) in short.items())
        raise RuntimeError(
            f"--tp {tp} needs {need}: one shard takes {bundle}. Lower --tp or "
            "--cpus-per-shard, add nodes, or join a bigger cluster with --address.")
    held = sum(_shards_on(n, bundle) for n in nodes)
    if held < tp:
        biggest = max(nodes, key=lambda n: min(n.get(k, 0.0) / v for k, v in bundle.items()),
                      default={})
        raise RuntimeError(
            f"--tp {tp} needs {tp} shard(s) of {_fmt(bundle)}, each on one node, but the nodes "
            f"of this cluster hold only {held} (the largest has "
            f"{_fmt({k: biggest.get(k, 0.0) for k in bundle})}). Lower --cpus-per-shard or "
            "--tp, or add bigger nodes.")


def _shards_on(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many shards of `bundle` one node can hold at most."""
    return min(int(node.get(k, 0.0) // v) for k, v in bundle.items() if v > 0)


def shard_names(tp: int, namespace: str) -> list[str]:
    """Named actors must be unique per namespace: a second replica on the same cluster gets
    suffixed names rather than a collision; the suffix of its driver's name when it has one
    (the shards of `driver-1a2b3c` are `shard-<rank>-1a2b3c`)."""
    suffix = _driver_suffix()
    if not _name_free(f"shard-0{suffix}", namespace):
        suffix = f"-{uuid.uuid4().hex[:6]}"
    return [f"shard-{rank}{suffix}" for rank in range(tp)]


def group_name(names: list[str]) -> str:
    """The placement group of shards `shard-0-1a2b3c`...: `tpserve-shards-1a2b3c`, so the
    dashboard's placement groups name the deployment whose actors they hold (they were
    `tpserve-<random>`)."""
    return "tpserve-shards" + names[0][len("shard-0"):]


def driver_names() -> list[str]:
    """The names `tpserve launch` tries for its driver actor, in order: `driver`, then one
    with a suffix for a second deployment on the same cluster."""
    return ["driver", f"driver-{uuid.uuid4().hex[:6]}"]


def _driver_suffix() -> str:
    try:
        name = ray.get_runtime_context().get_actor_name() or ""
    except Exception:  # noqa: BLE001 - not in an actor (tests, the Python API)
        return ""
    return name[len("driver"):] if name.startswith("driver-") else ""


def _name_free(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return False
    except ValueError:
        return True

PLACEMENTS = {"pack": "PACK", "spread": "SPREAD", "strict-pack": "STRICT_PACK",
              "strict-spread": "STRICT_SPREAD"}


def ray_strategy(placement: str) -> str:
    """The Ray placement-group strategy of a --placement value."""
    try:
        return PLACEMENTS[placement]
    except KeyError:
        raise ValueError(f"--placement must be one of {', '.join(PLACEMENTS)}; "
                         f"got {placement!r}") from None


def check_placement(placement: str, bundle: dict[str, float], tp: int,
                    nodes: list[dict[str, float]]) -> None:
    """Refuse at once a strict placement that no node set of this cluster can ever hold.

    `nodes` is the total resources of each alive node (not what is free now: a placement
    that fits an idle cluster is worth waiting for)."""
    fits = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in bundle.items())]
    if placement == "strict-spread" and len(fits) < tp:
        raise RuntimeError(
            f"--placement strict-spread puts each of the {tp} shards on its own node, but only "
            f"{len(fits)} node(s) of this cluster can hold one shard ({_fmt(bundle)}). Add "
            "nodes, lower --tp, or use --placement spread (best effort) or pack.")
    if placement == "strict-pack":
        need = {k: v * tp for k, v in bundle.items()}
        if not any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
            biggest = max(nodes, key=lambda n: min(n.get(k, 0.0) / v for k, v in need.items()),
                          default={})
            have = {k: biggest.get(k, 0.0) for k in need}
            raise RuntimeError(
                f"--placement strict-pack puts all {tp} shards on one node, which needs "
                f"{_fmt(need)}; the largest node has {_fmt(have)}. Use --placement pack to "
                "spill over to other nodes, or lower --tp / --cpus-per-shard.")


def cluster_nodes() -> list[dict[str, float]]:
    """Total resources of each alive node of the connected Ray cluster."""
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())

"""Ray placement of one replica's shards: a placement group of tp bundles, checked against
the cluster's capacity first, and collision-free actor names."""

from __future__ import annotations

import logging
import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

log = logging.getLogger(__name__)


def place_shards(bundle: dict[str, float], tp: int, joined_cluster: bool,
                 timeout_s: float = 120.0) -> PlacementGroup:
    """A ready placement group of tp bundles packed together; raises with what is missing."""
    try:
        check_capacity(bundle, tp)
    except RuntimeError as exc:
        if not joined_cluster:
            raise
        # A joined cluster may autoscale: wait for the placement group instead.
        log.warning("%s Waiting up to %.0fs in case the cluster scales up.", exc, timeout_s)
    pg = placement_group([bundle] * tp, strategy="PACK", name=f"tpserve-{uuid.uuid4().hex[:8]}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {tp} shard(s) of {bundle} within {timeout_s:.0f}s;"
            f" the cluster has {ray.available_resources()}. Lower --tp, lower "
            "--cpus-per-shard, or add nodes/devices.") from None
    return pg


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


def shard_names(tp: int, namespace: str) -> list[str]:
    """Named actors must be unique per namespace: a second replica on the same cluster gets
    suffixed names rather than a collision."""
    suffix = "" if _name_free("shard-0", namespace) else f"-{uuid.uuid4().hex[:6]}"
    return [f"shard-{rank}{suffix}" for rank in range(tp)]


def _name_free(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return False
    except ValueError:
        return True

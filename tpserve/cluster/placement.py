"""--placement: where the shards of one replica go, as a Ray placement-group strategy.

pack           as few nodes as possible, spilling over when one node is full (Ray's PACK);
               the default: all-reduces stay inside a node when they can
spread         one shard per node as far as the nodes go (SPREAD, best effort)
strict-pack    all shards on one node, or no placement at all (STRICT_PACK)
strict-spread  every shard on a different node, or no placement at all (STRICT_SPREAD)

The torch.distributed rendezvous needs nothing from this: the workers meet at the rank-0
shard's node address on a free port there, wherever that shard was placed.
"""

from __future__ import annotations

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
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())

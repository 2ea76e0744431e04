"""Ray Serve's request router for tpserve replicas, over the pure policy in router_policy.py.

Serve runs one router per deployment handle (so one in each ingress replica). Each replica's
record_routing_stats() (queued plus running tokens, read by Serve's controller about once a
second) reaches the router as RunningReplica.routing_stats; what this router itself sent and
has not seen complete is counted at once. What it decides is exported as Ray metrics
(tpserve_router_requests, by replica and by whether a cached prefix decided it).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from tpserve.serve.router_policy import PolicyConfig, PrefixAwareLeastWork, estimate_tokens

log = logging.getLogger(__name__)


def request_prompt(pending: PendingRequest | None) -> tuple[str, int] | None:
    """(prompt, max_new_tokens) of a generate call; None for other calls (info, stats)."""
    if pending is None or pending.metadata.call_method != "generate" or not pending.args:
        return None
    prompt = pending.args[0]
    params = pending.args[1] if len(pending.args) > 1 else pending.kwargs.get("params")
    if not isinstance(prompt, str):
        return None
    return prompt, int(getattr(params, "max_new_tokens", 0) or 0)


class TPServeRequestRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: PolicyConfig fields (RequestRouterConfig.request_router_kwargs)."""
        self.policy = PrefixAwareLeastWork(PolicyConfig(**kwargs))
        self._routed: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, cost)
        self._counter = None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        reported = {rid: float((r.routing_stats or {}).get("work_tokens", 0.0))
                    for rid, r in by_id.items()}
        req = request_prompt(pending_request)
        ranked = self.policy.rank(req[0] if req else "", by_id, reported)
        # A replica that reported it cannot serve (a shard died) goes last until Serve's
        # health check replaces it.
        ranked.sort(key=lambda rid: (by_id[rid].routing_stats or {}).get("ready", 1.0) == 0.0)
        # One replica per rank: Serve tries the first and falls back to the next when a
        # replica is at max_ongoing_requests.
        return [[by_id[rid]] for rid in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        req = request_prompt(pending_request)
        if req is None:
            return
        cost = estimate_tokens(*req)
        hashes = self.policy.prefix_hashes(req[0])
        prefix_hit = self.policy.matched_chunks(replica_id.unique_id, hashes) > 0
        self.policy.on_routed(replica_id.unique_id, req[0], cost)
        self._count(replica_id.unique_id, prefix_hit)
        self._routed[pending_request.metadata.internal_request_id] = (replica_id.unique_id, cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            self.policy.on_completed(*routed)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {rid.unique_id for rid in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {r.replica_id.unique_id for r in replicas}:
            self.policy.forget(gone)

    def _count(self, replica: str, prefix_hit: bool) -> None:
        try:
            if self._counter is None:
                from ray.util.metrics import Counter

                self._counter = Counter(
                    "tpserve_router_requests", "Generations routed to each replica; "
                    "prefix=1 when the replica already held the request's prefix",
                    tag_keys=("replica", "prefix"))
            self._counter.inc(1.0, tags={"replica": replica, "prefix": str(int(prefix_hit))})
        except Exception:  # noqa: BLE001 - metrics must never stop routing
            log.debug("router metric failed", exc_info=True)

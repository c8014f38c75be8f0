"""KvpilotRouter: Ray Serve's RequestRouter driven by affinity.py (prefix-cache-aware, or round-robin).

Ray calls choose_replicas with the live candidates and takes the least-queued replica of the first rank that
has room (max_ongoing_requests), else tries the next rank: so the preferred replica goes alone in rank one
and the rest follow, least loaded first. The hooks keep the policy's in-flight counts and prefix table.
Configured with RequestRouterConfig(request_router_class=KvpilotRouter,
request_router_kwargs={"routing": "prefix" | "round_robin", "load_factor": 1.25}).
"""

from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from kvpilot.server.ray_app.affinity import PrefixAffinity, RoundRobin
from kvpilot.server.ray_app.forward import ForwardedRequest


def _route_key(pending_request: Optional[PendingRequest]) -> tuple[int, ...]:
    if pending_request is None:
        return ()
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        if isinstance(arg, ForwardedRequest):
            return arg.route_key
    return ()


class KvpilotRouter(RequestRouter):
    policy: Any = None

    def initialize_state(self, routing: str = "prefix", load_factor: float = 1.25, **_: Any) -> None:
        self.policy = PrefixAffinity(load_factor) if routing == "prefix" else RoundRobin()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if self.policy is None:  # Ray calls initialize_state; a router built without it routes by prefix
            self.initialize_state()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = self.policy.rank(_route_key(pending_request), list(by_id))
        if not ranked:
            return []
        if pending_request is not None:  # counts at once: the next request of a burst sees it
            self.policy.tracker.reserve(id(pending_request), ranked[0])
        return [[by_id[ranked[0]]]] + ([[by_id[r] for r in ranked[1:]]] if len(ranked) > 1 else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        if self.policy is not None:
            self.policy.tracker.settle(id(pending_request))
            self.policy.routed(_route_key(pending_request), replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.policy is not None:
            self.policy.completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if self.policy is not None:
            self.policy.forget(replica_id.unique_id)

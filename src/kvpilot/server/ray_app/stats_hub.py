"""StatsHub: a small named Ray actor where every replica posts its latest /metrics text and load, about once
a second, and the ingress reads them (Ray Serve cannot broadcast one call to all replicas of a pool).

Invariants: an entry is replaced only by a newer report of the same replica; `snapshot` leaves out replicas
that said goodbye or have not reported for `max_age_s` (dead or replaced), so aggregates never count a
vanished replica twice.
"""

from __future__ import annotations

import time
from typing import Any

import ray

HUB_NAMESPACE = "kvpilot"
MAX_AGE_S = 10.0


@ray.remote(num_cpus=0)
class StatsHub:
    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}

    def report(self, replica_id: str, lane: str, metrics_text: str, load: dict[str, Any]) -> None:
        self.reports[replica_id] = {"replica_id": replica_id, "lane": lane, "metrics_text": metrics_text,
                                    "load": load, "time": time.time()}

    def goodbye(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)

    def snapshot(self, max_age_s: float = MAX_AGE_S) -> list[dict[str, Any]]:
        now = time.time()
        for stale in [r for r, v in self.reports.items() if now - v["time"] > max_age_s]:
            del self.reports[stale]
        return sorted(self.reports.values(), key=lambda v: (v["lane"], v["replica_id"]))


def hub_name(app_name: str) -> str:
    return f"kvpilot-stats-{app_name}"


def get_hub(app_name: str) -> Any:
    """The app's hub, created by whoever asks first (detached: it outlives a replica that created it)."""
    return StatsHub.options(name=hub_name(app_name), namespace=HUB_NAMESPACE, get_if_exists=True,
                            lifetime="detached").remote()

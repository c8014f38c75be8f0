"""The JSON of /v1/kvpilot/replicas: each replica's load and prefix-cache counters (its engine's own), and
across replicas the aggregate hit rate and the load imbalance (max / mean of running + waiting)."""

from __future__ import annotations

import time
from typing import Any, Iterable

from kvpilot.server.ray_app.config import RayAppConfig


def replica_table(reports: Iterable[dict[str, Any]], config: RayAppConfig) -> dict[str, Any]:
    now = time.time()
    rows = []
    for report in reports:
        load = dict(report.get("load") or {})
        queries, hits = load.get("prefix_cache_queries", 0), load.get("prefix_cache_hits", 0)
        rows.append({"replica": report["replica_id"], "lane": report["lane"], **load,
                     "prefix_cache_hit_rate": hits / queries if queries else None,
                     "age_s": round(now - report["time"], 3)})
    loads = [r.get("num_running", 0) + r.get("num_waiting", 0) for r in rows]
    queries = sum(r.get("prefix_cache_queries", 0) for r in rows)
    hits = sum(r.get("prefix_cache_hits", 0) for r in rows)
    mean = sum(loads) / len(loads) if loads else 0.0
    return {"routing": config.routing, "lanes": [lane.name for lane in config.lanes], "replicas": rows,
            "num_replicas": len(rows), "prefix_cache_hit_rate": hits / queries if queries else None,
            "load_imbalance": max(loads) / mean if mean else None}


def lanes_scaled_to_zero(reports: Iterable[dict[str, Any]], config: RayAppConfig) -> list[str]:
    """Lanes whose autoscaling_config allows no replica (min_replicas 0) and that have none reporting. /health
    leaves them asleep: asking one would start a replica (tens of seconds) and time the probe out."""
    live = {report["lane"] for report in reports}
    return [lane.name for lane in config.lanes if lane.name not in live and lane.autoscaling_config
            and lane.autoscaling_config.get("min_replicas", 1) == 0]

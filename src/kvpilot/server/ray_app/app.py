"""The Ray Serve application: one KvpilotIngress in front of one deployment per lane (KvpilotReplica).

`serve run kvpilot.ray:app model=dummy:llama num_replicas=2 routing=prefix` (or `config=lanes.yaml`) calls
`app(args)`; `kvpilot serve --ray` builds the same application (launch.py). Each lane is its own Serve
deployment (own engine settings, own replica count or autoscaling_config, which Ray scales on ongoing
requests: the queue depth), routed by KvpilotRouter unless routing is power_of_two (Ray's default).

GPUs: a replica asks Ray for the GPUs its engine uses (`replica_gpus`: a lane's `gpus_per_replica`, else its
tensor_parallel_size when its engine's device is CUDA, or is auto on a cluster that has GPUs). Ray then sets the
replica's CUDA_VISIBLE_DEVICES; its tensor-parallel ranks are its own child processes and see the same GPUs, so
a replica of several GPUs reserves them as one bundle of a STRICT_PACK placement group: all on one node.
"""

from __future__ import annotations

from typing import Any, Mapping

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from kvpilot.server.ray_app.config import LaneConfig, RayAppConfig, parse_app_config
from kvpilot.server.ray_app.ingress import KvpilotIngress
from kvpilot.server.ray_app.replica import KvpilotReplica

ROUTER_CLASS = "kvpilot.server.ray_app.router:KvpilotRouter"
HEALTH_CHECK_PERIOD_S = 2.0  # a dead engine is noticed, and its replica replaced, within a few seconds


def lane_deployment_name(lane: LaneConfig) -> str:
    return f"lane-{lane.name}"


def replica_gpus(lane: LaneConfig, cluster_gpus: float) -> float:
    """The GPUs one replica of the lane asks Ray for (see the module docstring)."""
    if lane.gpus_per_replica is not None:
        return lane.gpus_per_replica
    args = lane.engine_args()
    device = (args.device or "auto").lower()
    on_gpu = device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)
    return float(args.tensor_parallel_size) if on_gpu else 0.0


def _cluster_gpus() -> float:
    """The GPUs of the Ray cluster this process is connected to (0 when it is not connected yet)."""
    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def _resource_options(lane: LaneConfig, cluster_gpus: float) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": lane.cpus_per_replica}
    gpus = replica_gpus(lane, cluster_gpus)
    if not gpus:
        return {"ray_actor_options": actor}
    actor["num_gpus"] = gpus
    if gpus <= 1:
        return {"ray_actor_options": actor}
    return {"ray_actor_options": actor, "placement_group_strategy": "STRICT_PACK",
            "placement_group_bundles": [{"CPU": lane.cpus_per_replica, "GPU": gpus}]}


def _lane_options(lane: LaneConfig, config: RayAppConfig, cluster_gpus: float = 0.0) -> dict[str, Any]:
    options: dict[str, Any] = {"name": lane_deployment_name(lane), **_resource_options(lane, cluster_gpus),
                               "max_ongoing_requests": lane.max_ongoing_requests,
                               "health_check_period_s": HEALTH_CHECK_PERIOD_S, "graceful_shutdown_timeout_s": 10}
    if lane.autoscaling_config:
        options["autoscaling_config"] = dict(lane.autoscaling_config)
    else:
        options["num_replicas"] = lane.num_replicas
    if config.routing != "power_of_two":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"routing": config.routing, "load_factor": config.load_factor})
    return options


def build_application(config: RayAppConfig) -> Application:
    gpus = _cluster_gpus()
    lanes = {lane.name: serve.deployment(KvpilotReplica).options(**_lane_options(lane, config, gpus))
             .bind(lane, config.served_model_names, config.name) for lane in config.lanes}
    return KvpilotIngress.bind(config, lanes)


def app(args: Mapping[str, Any]) -> Application:
    """The application builder of `serve run kvpilot.ray:app key=value ...` (keys: config.py)."""
    return build_application(parse_app_config(args))

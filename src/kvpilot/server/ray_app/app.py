"""The Ray Serve application: one KvpilotIngress in front of one deployment per lane (KvpilotReplica).

`serve run kvpilot.ray:app model=dummy:llama num_replicas=2 routing=prefix` (or `config=lanes.yaml`) calls
`app(args)`; `kvpilot serve --ray` builds the same application (launch.py). Each lane is its own Serve
deployment (own engine settings, own replica count or autoscaling_config, which Ray scales on ongoing
requests: the queue depth), routed by KvpilotRouter unless routing is power_of_two (Ray's default).
"""

from __future__ import annotations

from typing import Any, Mapping

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


def _lane_options(lane: LaneConfig, config: RayAppConfig) -> dict[str, Any]:
    options: dict[str, Any] = {"name": lane_deployment_name(lane),
                               "ray_actor_options": {"num_cpus": lane.cpus_per_replica},
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
    lanes = {lane.name: serve.deployment(KvpilotReplica).options(**_lane_options(lane, config))
             .bind(lane, config.served_model_names, config.name) for lane in config.lanes}
    return KvpilotIngress.bind(config, lanes)


def app(args: Mapping[str, Any]) -> Application:
    """The application builder of `serve run kvpilot.ray:app key=value ...` (keys: config.py)."""
    return build_application(parse_app_config(args))

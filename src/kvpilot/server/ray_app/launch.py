"""`kvpilot serve --ray`: starts (or joins) a Ray cluster, Serve's HTTP proxy on --host/--port, and the
application built from the serve flags and an optional --ray-config file; serves until SIGINT/SIGTERM.

Precedence, most specific first: a lane's own `engine:` in the file, then engine flags given on the command
line (those that differ from their defaults), then the file's shared `engine:`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

from kvpilot.launch.args import EngineArgs
from kvpilot.server.config import ServerArgs
from kvpilot.server.ray_app.config import RayAppConfig, RayConfigError, load_config_file, parse_app_config


@dataclass(frozen=True)
class RayLaunch:
    """The --ray flags. num_replicas / routing None: the file's (or the defaults: 1 replica, prefix)."""

    num_replicas: int | None = None
    config_path: str | None = None
    routing: str | None = None
    address: str | None = None  # an existing cluster ("auto", "ray://host:10001"); None: start a local one


def ray_app_args(engine_args: EngineArgs, server_args: ServerArgs, launch: RayLaunch) -> dict[str, Any]:
    """The builder args of the application these flags describe (see the module docstring)."""
    if engine_args.kv_events_config is not None:
        raise RayConfigError("--kv-events-config with --ray: every replica would bind the same ZMQ endpoint; "
                             "publish KV events from separately started `kvpilot serve` replicas instead")
    values = load_config_file(launch.config_path) if launch.config_path else {}
    defaults = EngineArgs()
    explicit = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)
                if getattr(engine_args, f.name) != getattr(defaults, f.name) and f.name != "usage_context"}
    values["engine"] = {**dict(values.get("engine") or {}), **explicit}
    values.setdefault("served_model_name", list(server_args.served_model_names))
    values.setdefault("max_request_body_bytes", server_args.max_request_body_bytes)
    if server_args.api_key is not None:
        values["api_key"] = server_args.api_key
    if launch.routing is not None:
        values["routing"] = launch.routing
    if launch.num_replicas is not None:
        if len(values.get("lanes") or [{}]) > 1:
            raise RayConfigError("--num-replicas sets the one lane's replica count: with several lanes in "
                                 f"{launch.config_path}, give each lane its num_replicas there")
        values["lanes"] = [{**(values.get("lanes") or [{}])[0], "num_replicas": launch.num_replicas}]
    if not server_args.engine_process:
        values["lanes"] = [{**lane, "engine_process": False} for lane in values.get("lanes") or [{}]]
    return values


def run_ray_server(engine_args: EngineArgs, server_args: ServerArgs, launch: RayLaunch) -> int:
    """Serves until SIGINT/SIGTERM; returns the exit code. RayConfigError for a wrong configuration."""
    config = parse_app_config(ray_app_args(engine_args, server_args, launch))
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise RayConfigError("--ray needs Ray Serve: pip install 'kvpilot[ray]'") from exc
    from kvpilot.server.ray_app.app import build_application

    init_ray(launch.address, include_dashboard=False, ignore_reinit_error=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init (it installs its own), before the app is up
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": server_args.host, "port": server_args.port})
    serve.run(build_application(config), name=config.name, route_prefix="/")
    print(f"kvpilot on Ray Serve: http://{server_args.host}:{server_args.port} ({_describe(config)})", flush=True)
    stop.wait()
    serve.delete(config.name)
    if launch.address is None:
        serve.shutdown()
        ray.shutdown()
    return 0


def init_ray(address: str | None, **kwargs: Any) -> None:
    """ray.init; a cluster it starts (`address` None) runs its workers, the replicas and their engines, at
    nice 0: at Ray's default nice 15 any busy process on the node took their CPU and every request stalled
    (RAY_worker_niceness, when set, still decides). A cluster joined keeps its own setting (docs/ray.md)."""
    import ray

    if address is None:
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=address, **kwargs)


def _describe(config: RayAppConfig) -> str:
    lanes = ", ".join(f"{lane.name}: {lane.num_replicas} replica(s)" for lane in config.lanes)
    return f"routing {config.routing}; {lanes}"

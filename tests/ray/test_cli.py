"""`kvpilot serve --ray` joining a running cluster (the tests' own): the flags become the application, it
serves, and SIGTERM removes it and exits 0. Also the flag/file precedence of `ray_app_args`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpilot.launch.args import EngineArgs
from kvpilot.server.config import ServerArgs
from kvpilot.server.ray_app.config import RayConfigError, parse_app_config
from kvpilot.server.ray_app.launch import RayLaunch, ray_app_args

ray = pytest.importorskip("ray")


def test_serve_ray_joins_a_cluster_serves_and_exits_on_sigterm(ray_serve: str, tiny_model: str) -> None:
    from ray import serve

    for app_name in list(serve.status().applications):
        serve.delete(app_name)
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "kvpilot.server", "--ray", "--ray-address", address, "--num-replicas", "1",
               "--routing", "round_robin", "--model", tiny_model, "--load-format", "dummy", "--dtype", "float32",
               "--max-model-len", "512", "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
               "--no-engine-process"]  # a flag that reaches the replicas (and spares a process spawn at start)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(ray_serve):
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            assert time.monotonic() < deadline, "kvpilot serve --ray did not become healthy in 120 s"
            time.sleep(0.5)
        r = httpx.post(f"{ray_serve}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        table = httpx.get(f"{ray_serve}/v1/kvpilot/replicas", timeout=30).json()
        assert table["routing"] == "round_robin" and table["lanes"] == ["default"]
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "kvpilot on Ray Serve: http://127.0.0.1:8000 (routing round_robin; default: 1 replica(s))" in output
    assert "kvpilot" not in serve.status().applications


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:  # the proxy holds a request while the app deploys
        return False


def test_flags_override_the_file_and_lanes_override_flags(tmp_path: Path) -> None:
    path = tmp_path / "lanes.yaml"
    path.write_text("engine: {max_num_seqs: 32, block_size: 32}\nrouting: round_robin\nlanes:\n"
                    "  - {name: short, max_prompt_chars: 500, engine: {max_num_batched_tokens: 256}}\n"
                    "  - {name: long, engine: {max_num_seqs: 4}}\n")
    engine = EngineArgs(model="m", max_num_seqs=64)
    args = ray_app_args(engine, ServerArgs(served_model_names=("m",), api_key="k"), RayLaunch(config_path=str(path)))
    config = parse_app_config(args)
    short, long = config.lanes
    assert short.engine == {"model": "m", "max_num_seqs": 64, "block_size": 32, "max_num_batched_tokens": 256}
    assert long.engine == {"model": "m", "max_num_seqs": 4, "block_size": 32}
    assert (config.routing, config.api_key, config.served_model_names) == ("round_robin", "k", ("m",))
    with pytest.raises(RayConfigError, match="give each lane its num_replicas there"):
        ray_app_args(engine, ServerArgs(), RayLaunch(num_replicas=2, config_path=str(path)))


def test_each_lane_is_a_deployment_with_its_options() -> None:
    from kvpilot.ray import build_application

    path = Path(__file__).parents[2] / "deploy" / "ray" / "lanes.yaml"
    ingress = build_application(parse_app_config({"config": str(path), "routing": "round_robin"}))._bound_deployment
    lanes = {name: app._bound_deployment for name, app in ingress.init_args[1].items()}
    assert {name: d.name for name, d in lanes.items()} == {"interactive": "lane-interactive", "long": "lane-long"}
    interactive, long = lanes["interactive"]._deployment_config, lanes["long"]._deployment_config
    assert interactive.num_replicas == 2 and interactive.autoscaling_config is None
    assert (long.autoscaling_config.min_replicas, long.autoscaling_config.max_replicas) == (1, 4)
    assert long.request_router_config.request_router_kwargs == {"routing": "round_robin", "load_factor": 1.25}
    assert lanes["long"].ray_actor_options["num_cpus"] == 1.0

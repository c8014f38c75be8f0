"""The Deployment against the server it runs: its arguments are `kvpilot serve` flags and values the server
accepts, its probes and scrape annotations name open routes on the container's port, its termination grace
outlasts the drain, and its memory covers what `kvpilot fit` predicts for those settings."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvpilot.cli import app
from tests.deploy.assets import container_env, one, server_container
from tests.deploy.docker_assets import entrypoint

TEST_KEY = "a-key-from-the-secret"
# The HTTP process of `kvpilot serve`: 325 MiB measured after a load test (docs/server.md)
HTTP_PROCESS_BYTES = 384 * 2**20
# After the drain: aborted requests get 5 s to flush (server/drain.py), uvicorn 5 s to close (server/cli.py)
FLUSH_AND_CLOSE_S = 10.0


@dataclass(frozen=True)
class Served:
    """What `kvpilot serve` made of the image's entrypoint + the container's args + its environment."""

    argv: list[str]
    engine_args: Any
    server_args: Any


def _serve_argv() -> list[str]:
    """["serve", ...]: Kubernetes appends a container's args to the image's ENTRYPOINT (no `command`)."""
    return entrypoint()[1:] + server_container()["args"]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """Runs the real `kvpilot serve` command line up to the point where it would start the server."""
    import kvpilot.server.cli as serve_cli

    captured: dict[str, Any] = {}

    def run_server(engine_args: Any, server_args: Any, uvicorn_log_level: str = "warning") -> int:
        captured.update(engine_args=engine_args, server_args=server_args)
        return 0

    argv = _serve_argv()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve_cli, "run_server", run_server)
        result = CliRunner().invoke(app, argv, env={"KVPILOT_API_KEY": TEST_KEY})
    assert result.exit_code == 0, f"`kvpilot {' '.join(argv)}` was refused: {result.output}"
    yield Served(argv, captured["engine_args"], captured["server_args"])


def test_container_keeps_the_image_entrypoint() -> None:
    assert "command" not in server_container(), "a `command` would replace `kvpilot serve --host 0.0.0.0`"


def test_every_flag_is_a_kvpilot_serve_flag() -> None:
    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    known = {opt for param in serve.params for opt in (*param.opts, *param.secondary_opts)}
    flags = [arg.split("=", 1)[0] for arg in _serve_argv() if arg.startswith("--")]
    assert flags and not set(flags) - known, f"not flags of `kvpilot serve --help`: {set(flags) - known}"


def test_api_key_comes_from_the_secret(served: Served) -> None:
    serve = get_command(app).commands["serve"]  # type: ignore[attr-defined]
    (api_key,) = [param for param in serve.params if "--api-key" in param.opts]
    assert "--api-key" not in served.argv, "a key in args is visible in the pod spec and in `ps`"
    ref = container_env(server_container())[api_key.envvar]["valueFrom"]["secretKeyRef"]
    secret = one("Secret").doc
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert served.server_args.api_key == TEST_KEY


def _routes() -> set[str]:
    from kvpilot.launch.args import EngineArgs
    from kvpilot.server import ServerArgs, create_app, engine_factory

    server_app = create_app(engine_factory(EngineArgs()), ServerArgs())  # routes only: nothing started
    server_app.state.kvpilot.tokenizer_pool.shutdown()
    return {route.path for route in server_app.routes if "GET" in getattr(route, "methods", ())}


def _open_paths(server_args: Any) -> frozenset[str]:
    from kvpilot.server.guards.auth import open_paths

    return open_paths(server_args.metrics_public)


def test_probes_call_an_open_route_on_the_server_port(served: Served) -> None:
    container = server_container()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["http"] == served.server_args.port
    assert served.server_args.host == "0.0.0.0"
    routes, open_paths = _routes(), _open_paths(served.server_args)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["path"] in routes, probe
        assert get["path"] in open_paths, f"{probe}: the kubelet sends no API key"
        assert ports.get(get["port"], get["port"]) == served.server_args.port, probe


def test_prometheus_scrapes_the_open_metrics_route(served: Served) -> None:
    annotations = one("Deployment").doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in _routes()
    assert int(annotations["prometheus.io/port"]) == served.server_args.port
    assert "/metrics" in _open_paths(served.server_args), \
        "with an API key, /metrics needs --metrics-public for Prometheus and an InferencePool's endpoint picker"


def test_termination_grace_outlasts_the_drain(served: Served) -> None:
    from kvpilot.server.core.engine_client import SHUTDOWN_TIMEOUT_S

    pod = one("Deployment").doc["spec"]["template"]["spec"]
    container = server_container()
    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_s = served.server_args.drain_timeout
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + FLUSH_AND_CLOSE_S + SHUTDOWN_TIMEOUT_S
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop_s + drain_s, \
        "/health is 503 while draining: liveness must not restart a draining pod"


def test_selectors_reach_the_pods_and_their_port(served: Served) -> None:
    deployment = one("Deployment").doc
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = one("Service").doc["spec"]
    assert service["selector"].items() <= pod_labels.items()
    assert {port["targetPort"] for port in service["ports"]} <= {p["name"] for p in server_container()["ports"]}
    pool = one("InferencePool").doc["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [port["number"] for port in pool["targetPorts"]] == [served.server_args.port]
    target = one("HorizontalPodAutoscaler").doc["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi)?$")


def _bytes(quantity: str) -> int:
    match = _QUANTITY.match(quantity)
    assert match, f"write memory as an integer with Ki/Mi/Gi, got {quantity!r}"
    return int(match[1]) * {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[match[2]]


def _fit_bytes(engine_args: Any) -> int:
    """`kvpilot fit` for the embedded model on CPU with the container's settings, in float32 (the upper
    bound: dtype auto is bfloat16, half of it, only on CPUs with native bf16)."""
    assert engine_args.model is None and engine_args.dtype in ("auto", "float32"), "size for this model"
    argv = ["fit", "smollm2-135m", "--gpu", "cpu", "--dtype", "fp32", "--weight-dtype", "fp32", "--json",
            "--kv-cache-memory", str(engine_args.kv_cache_memory), "--block-size", str(engine_args.block_size),
            "--max-num-seqs", str(engine_args.max_num_seqs), "--max-num-batched-tokens",
            str(engine_args.max_num_batched_tokens or max(2048, engine_args.max_num_seqs))]  # serve's default
    if engine_args.max_model_len is not None:
        argv += ["--max-model-len", str(engine_args.max_model_len)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    memory = json.loads(result.output)["memory"]
    assert memory["weights_fit"] and memory["max_model_len_fits"]
    return (memory["weight_bytes_per_device"] + memory["activation_bytes"] + memory["runtime_bytes"]
            + memory["kv_budget_bytes"])


def test_memory_covers_what_kvpilot_fit_predicts(served: Served) -> None:
    resources = server_container()["resources"]
    request, limit = _bytes(resources["requests"]["memory"]), _bytes(resources["limits"]["memory"])
    needed = _fit_bytes(served.engine_args) + HTTP_PROCESS_BYTES
    assert needed <= request <= limit, f"fit needs {needed / 2**20:.0f} MiB; request {request / 2**20:.0f} MiB"


def test_torch_threads_follow_the_cpu_request() -> None:
    env = container_env(server_container())
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu"

"""A local Ray cluster for the Ray Serve tests (started once per session, on this machine's CPUs), and a
tiny random-weight model with the embedded tokenizer, so the OpenAI SDK and text prompts work."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import httpx
import pytest

from kvpilot.fit.model_catalog import get_hf_config
from kvpilot.server.background import free_port

RAY_CPUS = 4  # logical: two 1-CPU replicas plus headroom; the ingress, proxy and controller take none


def smollm2_layers(tmp_path_factory: pytest.TempPathFactory, num_layers: int) -> str:
    """SmolLM2's architecture with `num_layers` layers: the embedded tokenizer fits its vocabulary."""
    config = get_hf_config("smollm2-135m")
    config["num_hidden_layers"] = num_layers
    path = tmp_path_factory.mktemp(f"smollm2-{num_layers}") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return smollm2_layers(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[str]:
    """The Serve HTTP address of a local Ray cluster started for these tests."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from kvpilot.server.ray_app.launch import init_ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # as `kvpilot serve --ray` starts its local cluster: workers at nice 0 (test_ray_serve checks)
    init_ray(None, num_cpus=RAY_CPUS, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
             log_to_driver=False)
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def engine_settings(model: str, **overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"model": model, "load_format": "dummy", "dtype": "float32", "max_model_len": 1024,
                                "kv_cache_memory": "16MiB", "served_model_name": "tiny"}
    settings.update(overrides)
    return settings


_RUNNING: dict[str, Any] = {}  # the application deploy() left on "/": {"name": ..., "args": ...}
PREFIX_PAIR_KEY = "sk-test"


def deploy(url: str, name: str, args: dict[str, Any]) -> str:
    """Runs the application (replacing any other on "/"), waits until /health says ok; returns its URL."""
    from ray import serve

    import kvpilot.ray

    for app_name in list(serve.status().applications):
        serve.delete(app_name)
    _RUNNING.clear()
    serve.run(kvpilot.ray.app({**args, "name": name}), name=name, route_prefix="/")
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the Ray app did not become healthy in 120 s"
        time.sleep(0.5)
    _RUNNING.update(name=name, args=args)
    return url


def prefix_pair_settings(model: str) -> dict[str, Any]:
    """2 replicas with prefix routing (the default), engines in the replicas (a faster start), a 5 MiB KV cache
    each (~1,700 tokens: test_routing's sizing) and an API key: test_routing's prefix-routing deployment and
    test_serve's, one deployment for both."""
    return {**engine_settings(model, kv_cache_memory="5MiB"), "num_replicas": 2, "routing": "prefix",
            "engine_process": False, "api_key": PREFIX_PAIR_KEY}


def prefix_pair(url: str, model: str) -> str:
    """The prefix_pair_settings application, deployed unless deploy() left it running (a replica another test
    killed has been replaced by then: Serve keeps 2)."""
    from ray import serve

    settings = prefix_pair_settings(model)
    if _RUNNING.get("name") == "prefix-pair" and _RUNNING.get("args") == settings \
            and "prefix-pair" in serve.status().applications:
        return url
    return deploy(url, "prefix-pair", settings)


def replica_stats(url: str, num_replicas: int, timeout_s: float = 30.0,
                  headers: dict[str, str] | None = None) -> dict[str, Any]:
    """/v1/kvpilot/replicas once `num_replicas` replicas are listed and every one of them has reported since
    this call, so after the caller's last request (reports: ~1 s; a replica's engine counters are current
    once its requests have answered: the core sends them with each step's outputs)."""
    since = time.monotonic()
    deadline = since + timeout_s
    while True:
        asked = time.monotonic()
        table = httpx.get(f"{url}/v1/kvpilot/replicas", headers=headers, timeout=30).json()
        # a row's age_s is its report's age when the ingress built the table, after `asked`
        fresh = all(row["age_s"] < asked - since for row in table["replicas"])
        if (table["num_replicas"] == num_replicas and fresh) or time.monotonic() > deadline:
            return table
        time.sleep(0.2)

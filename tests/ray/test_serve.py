"""kvpilot on a local Ray cluster: 2 replicas of a tiny model behind the Ray Serve application.

Shown here (#15): the OpenAI SDK works through it, token for token as kvpilot's own engine; a replica killed
mid-run is replaced and only the requests it held fail (prefix routing: test_routing.py).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.ray.conftest import PREFIX_PAIR_KEY, prefix_pair, replica_stats

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")


AUTH = {"Authorization": f"Bearer {PREFIX_PAIR_KEY}"}


@pytest.fixture(scope="module")
def two_replicas(ray_serve: str, tiny_model: str) -> str:
    """2 replicas, prefix routing, an API key (test_routing's deployment, still up after it): the SDK test, then
    the kill test (last: it kills one)."""
    return prefix_pair(ray_serve, tiny_model)


def test_openai_sdk_through_ray_matches_the_engine(two_replicas: str, tiny_model: str) -> None:
    from openai import OpenAI

    from kvpilot import LLM, SamplingParams

    url = two_replicas
    client = OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
    prompt = "The harbor at dawn was quiet, and the boats"
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=6, temperature=0)
    llm = LLM(model=tiny_model, load_format="dummy", dtype="float32", max_model_len=1024, kv_cache_memory="16MiB")
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert got.choices[0].text == streamed == want.text
    assert got.usage.completion_tokens == len(want.token_ids) == 12
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6

    raw = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-test", "X-Request-Id": "trace-7"},
                     json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert raw.status_code == 200 and raw.headers["x-kvpilot-lane"] == "default"
    assert raw.headers["x-request-id"] == "trace-7" and raw.json()["id"].endswith("trace-7")
    table = replica_stats(url, 2, headers=AUTH)
    assert raw.headers["x-kvpilot-replica"] in {r["replica"] for r in table["replicas"]}
    denied = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "invalid_api_key"
    lane = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-test", "X-Lane": "bulk"},
                      json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert lane.status_code == 400 and "use one of default" in lane.json()["error"]["message"]

    merged = _samples(httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text, "vllm:prompt_tokens_total")
    by_replica = httpx.get(f"{url}/metrics/replicas", headers=AUTH, timeout=30).text
    per_replica = _samples(by_replica, "vllm:prompt_tokens_total")
    assert sum(per_replica) == merged[0] > 0
    assert {f'replica="{r["replica"]}"' for r in table["replicas"]} == set(re.findall(r'replica="[^"]+"', by_replica))


def _samples(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]


def _stream(url: str, index: int, out: dict[int, dict[str, Any]], started: threading.Event) -> None:
    body = {"model": "tiny", "prompt": f"story {index}: once upon a time", "max_tokens": 300, "ignore_eos": True,
            "stream": True, "temperature": 0}
    result: dict[str, Any] = {"chunks": 0, "finish": None, "error": None}
    out[index] = result
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            result["replica"] = r.headers.get("x-kvpilot-replica")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    result["chunks"] += 1
                    started.set()
                    if '"error"' in line:
                        result["error"] = line
                    elif '"finish_reason":"length"' in line.replace(" ", ""):
                        result["finish"] = "length"
    except httpx.HTTPError as exc:  # a cut connection counts as the error the client saw
        result["error"] = repr(exc)


def test_a_killed_replica_is_replaced_and_only_its_requests_fail(two_replicas: str) -> None:
    """Prompts shorter than one routing chunk carry no prefix key: the router spreads them by load."""
    url = two_replicas
    before = {r["replica"] for r in replica_stats(url, 2, headers=AUTH)["replicas"]}
    out: dict[int, dict[str, Any]] = {}
    events = [threading.Event() for _ in range(6)]
    threads = [threading.Thread(target=_stream, args=(url, i, out, events[i])) for i in range(6)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(60), "a stream did not start"
    victim = out[0]["replica"]
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{victim}"))
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for t in threads:
        t.join(120)
    held = [r for r in out.values() if r["replica"] == victim]
    others = [r for r in out.values() if r["replica"] != victim]
    assert held and others  # the load bound put requests on both replicas
    assert all(r["error"] is not None and r["finish"] is None for r in held)
    assert all(r["error"] is None and r["finish"] == "length" for r in others)

    after = [httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"after {i}", "max_tokens": 2},
                        headers=AUTH, timeout=60).status_code for i in range(8)]
    assert after == [200] * 8  # a request routed to the dead replica before Ray noticed is retried
    deadline = time.monotonic() + 120
    while True:
        now = {r["replica"] for r in replica_stats(url, 2, headers=AUTH)["replicas"]}
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {now}"
    assert len(now - before) == 1  # one new replica, the survivor kept


def test_the_local_cluster_runs_its_workers_at_the_drivers_priority(ray_serve: str) -> None:
    """A cluster kvpilot starts runs the replicas' workers at nice 0 as their driver, not at Ray's default 15
    (server/ray_app/launch.init_ray): there a busy neighbour process left them next to no CPU."""
    import os

    worker_nice = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote(), timeout=120)
    assert worker_nice == os.nice(0)

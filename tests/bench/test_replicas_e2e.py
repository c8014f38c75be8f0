"""`kvpilot bench` across two real kvpilot servers (2-layer dummy SmolLM2, engine in a thread): with
`--replica-url` twice and no `--base-url` it spreads the load round-robin itself; through a double of the Ray
app's contract (`x-kvpilot-replica`, `/metrics/replicas`) it reads the serving replica from each response.
Either way every per-replica number must equal what that server's own /metrics counters moved by."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from kvpilot.bench.api import BenchConfig, run_bench
from kvpilot.bench.cli import bench_command
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.server.background import BackgroundServer
from tests.bench.replica_gateway import ReplicaGateway
from tests.server.tiny_server import MODEL, tiny_server, write_tiny_config

COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
            "vllm:prompt_tokens_total")
SHARED = ["--dataset", "shared-prefix", "--num-prefixes", "2", "--num-suffixes", "4", "--prefix-len", "48",
          "--input-len", "64", "--output-len", "2", "--ignore-eos", "--num-requests", "8", "--concurrency", "2"]


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[BackgroundServer]]:
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config) as a, tiny_server(config) as b:
        yield [a, b]


def counters(url: str) -> dict[str, float]:
    """The server's own counters, summed over label sets (parsed here, not by bench)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in COUNTERS}


def assert_matches_server(row: dict, delta: dict[str, float], prompt_tokens: int) -> None:
    assert row["prefix_hits"] == delta["vllm:prefix_cache_hits_total"]
    assert row["prefix_queries"] == delta["vllm:prefix_cache_queries_total"] > 0
    assert row["prompt_tokens"] == delta["vllm:prompt_tokens_total"] == prompt_tokens
    assert row["prefix_hit_rate"] == pytest.approx(row["prefix_hits"] / row["prefix_queries"])


def test_replica_urls_without_base_url_round_robin(two_servers: list[BackgroundServer], tmp_path: Path) -> None:
    urls = [s.url for s in two_servers]
    before = [counters(u) for u in urls]
    app = typer.Typer()
    app.command("bench")(bench_command)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["--replica-url", urls[0], "--replica-url", urls[1] + "/", *SHARED,
                                      "--model", MODEL, "--scrape-interval", "0.2", "--no-progress",
                                      "--output", str(out), "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    deltas = [moved(b, counters(u)) for b, u in zip(before, urls, strict=True)]
    doc = json.loads(out.read_text())
    assert doc["config"]["replicas"] == {"labelled_url": None, "urls": urls, "route": True}
    run = doc["runs"][0]
    requests = run["requests"]
    assert [r["replica"] for r in requests] == [urls[i % 2] for i in range(8)]  # round-robin in send order
    rep = run["replicas"]
    assert rep["routed"] is True and rep["num_replicas"] == 2 and rep["imbalance"] == 1.0
    assert [(r["replica"], r["num_requests"], r["requests_source"]) for r in rep["per_replica"]] == [
        (urls[0], 4, "client round-robin"), (urls[1], 4, "client round-robin")]
    for row, delta, url in zip(rep["per_replica"], deltas, urls, strict=True):
        assert delta["vllm:request_success_total"] == 4  # the load really reached each server
        assert_matches_server(row, delta, sum(r["num_prompt_tokens"] for r in requests if r["replica"] == url))
    groups: dict[str, set[str]] = {}
    for r in requests:
        groups.setdefault(r["group_id"], set()).add(r["replica"])
    assert rep["prefix_spread"] == sum(len(g) for g in groups.values()) / len(groups)
    hits = sum(d["vllm:prefix_cache_hits_total"] for d in deltas)
    assert rep["hit_rate"] == pytest.approx(hits / sum(d["vllm:prefix_cache_queries_total"] for d in deltas))
    # the deployment-wide summary is the replicas' sum
    assert run["server_metrics"]["summary"]["prefix_cache_hit_rate"] == pytest.approx(rep["hit_rate"])
    assert "Replicas (" in result.output and "round-robin" in result.output
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Replicas: " in page and f"<td>{urls[1]}</td><td>-</td><td>4</td>" in page


def test_ray_contract_header_and_labelled_metrics(two_servers: list[BackgroundServer]) -> None:
    urls = [s.url for s in two_servers]
    with ReplicaGateway(urls) as gateway:
        before = [counters(u) for u in urls]
        outcome = run_bench(BenchConfig(
            target=Target(gateway.url, MODEL, ignore_eos=True),
            dataset=DatasetConfig(kind="shared-prefix", input_len=64, output_len=2, num_prefixes=2,
                                  num_suffixes=4, prefix_len=48, seed=7),
            load=LoadShape(concurrency=2, num_requests=8), scrape_interval_s=0.2, progress=False))
        deltas = [moved(b, counters(u)) for b, u in zip(before, urls, strict=True)]
    assert outcome.result["config"]["replicas"]["labelled_url"] == gateway.url + "/metrics/replicas"
    run = outcome.result["runs"][0]
    assert all(r["ok"] for r in run["requests"])
    rep = run["replicas"]
    assert rep["routed"] is False and rep["source"] == gateway.url + "/metrics/replicas"
    rows = rep["per_replica"]
    assert [(r["replica"], r["lane"], r["requests_source"]) for r in rows] == [
        ("replica-0", "interactive", "x-kvpilot-replica"), ("replica-1", "interactive", "x-kvpilot-replica")]
    for row, delta, rid in zip(rows, deltas, gateway.ids, strict=True):
        served = [r for r in run["requests"] if r["replica"] == rid]
        assert row["num_requests"] == len(served) == delta["vllm:request_success_total"] == 4
        assert_matches_server(row, delta, sum(r["num_prompt_tokens"] for r in served))
    assert rep["imbalance"] == 1.0

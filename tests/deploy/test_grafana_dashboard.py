"""deploy/grafana/kvpilot-dashboard.json: every metric its PromQL reads, and every label it matches on, is one
a live kvpilot server exports (the real HTTP stack and engine on a 2-layer dummy-weight model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.assets import DEPLOY
from tests.deploy.promql_names import label_values_metric, metric_labels
from tests.server.tiny_server import AUTH, KEY, MODEL, tiny_server, write_tiny_config

DASHBOARD = DEPLOY / "grafana" / "kvpilot-dashboard.json"
GRID_COLUMNS = 24
# What the dashboard must show (issue 14): a metric for each, by name.
REQUIRED = {"vllm:request_success_total", "vllm:num_requests_waiting", "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:request_queue_time_seconds_sum", "kvpilot:tokenization_time_seconds_sum",
            "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
            "vllm:num_preemptions_total", "kvpilot:requests_rejected_total", "vllm:generation_tokens_total",
            "vllm:prompt_tokens_total"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    nested = [p for row in dashboard["panels"] if row["type"] == "row" for p in row.get("panels", [])]
    return dashboard["panels"] + nested


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target."""
    return [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in _panels(dashboard)
            for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def live_series(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, set[str]]]:
    """Sample name -> its label names, scraped after a request (so every histogram has series) and one
    rejected request (so the rejection counter has one)."""
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config, api_key=KEY) as server, \
            httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4,
                                                  "ignore_eos": True})
        assert done.status_code == 200
        assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        text = http.get("/metrics").text
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    yield series


def test_every_metric_and_label_the_dashboard_reads_is_exported(dashboard, live_series) -> None:
    used: dict[str, set[str]] = {}
    for where, expr in _queries(dashboard):
        names = metric_labels(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name, labels in names.items():
            assert name in live_series, f"{where}: {name} is not in the server's /metrics"
            assert labels <= live_series[name], f"{where}: {name} has no label {labels - live_series[name]}"
            used.setdefault(name, set()).update(labels)
    assert REQUIRED <= set(used), f"not on the dashboard: {sorted(REQUIRED - set(used))}"
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert label_values_metric(variable["query"]["query"]) in live_series, variable["name"]


def test_model_filtered_selectors_use_the_model_variable(dashboard, live_series) -> None:
    """Series with a model_name label are filtered by the dashboard's $model_name; the unlabelled memory
    series are not (a matcher on a missing label would hide them)."""
    for where, expr in _queries(dashboard):
        for name, labels in metric_labels(expr).items():
            assert ("model_name" in labels) == ("model_name" in live_series[name]), f"{where}: {name}"
        if "model_name" in expr:
            assert 'model_name=~"$model_name"' in expr, where


def test_the_dashboard_is_importable(dashboard) -> None:
    panels = _panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels)
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= names
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]

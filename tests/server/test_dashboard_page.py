"""GET /dashboard in headless Chromium against a live server (the real HTTP stack and engine on a 2-layer
dummy-weight model): the numbers the page renders are the ones /metrics gives, and it draws offline."""

from __future__ import annotations

import re
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from kvpilot.launch.args import EngineArgs
from kvpilot.server import ServerArgs, create_app, engine_factory
from kvpilot.server.background import BackgroundServer
from tests.server.headless_chromium import chromium_path, dump_dom, screenshot
from tests.server.metrics_text import samples, value
from tests.server.tiny_server import AUTH, KEY, MODEL, tiny_server, write_tiny_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STAGES = ("queue", "tokenize", "prefill", "decode")
STAGE_METRICS = {"queue": "vllm:request_queue_time_seconds", "tokenize": "kvpilot:tokenization_time_seconds",
                 "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds"}
needs_chromium = pytest.mark.skipif(chromium_path() is None,
                                    reason="chromium is not installed: run scripts/install_chromium.sh")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """With an API key and --metrics-public: the browser, which sends no key, may open the dashboard."""
    config = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    with tiny_server(config, api_key=KEY, metrics_public=True) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def _generate(http: httpx.Client, count: int, max_tokens: int = 6) -> None:
    for k in range(count):
        body = {"model": MODEL, "prompt": f"request {k}: " + "word " * (3 * k + 1), "max_tokens": max_tokens,
                "ignore_eos": True, "stream": k % 2 == 1}
        assert http.post("/v1/completions", json=body).status_code == 200


def _rendered(dom: str) -> dict[str, str]:
    """Element id -> its text, for the elements that hold only text."""
    return dict(re.findall(r'id="([a-z0-9-]+)"[^>]*>([^<]*)<', dom))


def test_the_page_is_one_self_contained_file(server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as keyless:  # --metrics-public opens the dashboard only
        page = keyless.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)\s*=", page.text, re.I)  # nothing to fetch
        assert not re.search(r"https?://", page.text)
        assert keyless.get("/v1/kvpilot/dashboard").status_code == 200
        assert keyless.post("/v1/completions", json={"prompt": "x"}).status_code == 401


def test_without_metrics_public_the_dashboard_needs_the_key() -> None:
    app = create_app(engine_factory(EngineArgs()), ServerArgs(api_key=KEY))  # routes only: the engine never starts
    try:
        client = TestClient(app)
        for path in ("/dashboard", "/v1/kvpilot/dashboard"):
            assert client.get(path).status_code == 401
        assert client.get("/dashboard", headers=AUTH).status_code == 200
        before_start = client.get("/v1/kvpilot/dashboard", headers=AUTH).json()
        assert before_start["gauges"] == {"running": None, "waiting": None, "kv_cache_usage": None}
        assert before_start["counters"]["requests_finished"] == 0
    finally:
        app.state.kvpilot.tokenizer_pool.shutdown()


def _within(shown: str, before: float, after: float, digits: int) -> None:
    """The rendered number equals /metrics' value at some moment between the two scrapes (counters and
    gauges only move between them while requests finish), up to the page's rounding."""
    slack = 0.5 * 10 ** -digits + 1e-9
    assert min(before, after) - slack <= float(shown) <= max(before, after) + slack, (shown, before, after)


@needs_chromium
def test_the_rendered_numbers_are_the_metrics(server: BackgroundServer, http: httpx.Client) -> None:
    _generate(http, 4)
    assert http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404  # rejected
    before = samples(http)
    shown = _rendered(dump_dom(f"{server.url}/dashboard?interval=300"))
    after = samples(http)
    assert shown["status"].startswith("updated"), shown["status"]
    assert shown["model"] == MODEL
    for element, name, scale, digits in (("running", "vllm:num_requests_running", 1, 0),
                                         ("waiting", "vllm:num_requests_waiting", 1, 0),
                                         ("kv-usage", "vllm:kv_cache_usage_perc", 100, 2),
                                         ("requests-finished", "vllm:request_success_total", 1, 0),
                                         ("requests-rejected", "kvpilot:requests_rejected_total", 1, 0),
                                         ("preemptions", "vllm:num_preemptions_total", 1, 0),
                                         ("generation-tokens", "vllm:generation_tokens_total", 1, 0),
                                         ("prompt-tokens", "vllm:prompt_tokens_total", 1, 0)):
        _within(shown[element], scale * value(before, name), scale * value(after, name), digits)
    assert int(shown["kv-blocks-total"]) == value(after, "kvpilot:kv_cache_blocks", state="total") > 0
    assert int(shown["requests-finished"]) >= 4 and int(shown["requests-rejected"]) >= 1
    assert float(shown["generation-tps"]) >= 0 and float(shown["prompt-tps"]) >= 0
    for stage in STAGES:
        name = STAGE_METRICS[stage]
        count = value(after, name + "_count")
        assert count >= 4 and int(shown[f"stage-{stage}-count"]) == count == value(before, name + "_count")
        mean_ms = 1000 * value(after, name + "_sum") / count
        assert float(shown[f"stage-{stage}-mean-ms"]) == pytest.approx(mean_ms, abs=0.0005 + 1e-9), stage


@needs_chromium
def test_a_screenshot_under_load_is_a_png(server: BackgroundServer, http: httpx.Client, tmp_path: Path) -> None:
    """Requests run while the page polls, so the charts have lines; the PNG is kept in tmp_path to look at."""
    load = threading.Thread(target=_generate, args=(http, 6, 12), daemon=True)
    load.start()
    path = screenshot(f"{server.url}/dashboard?interval=250", tmp_path / "dashboard.png", 1400, 1000,
                      budget_ms=6000)
    load.join(120)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1400, 1000)
    assert len(data) > 20_000  # drawn, not blank: a uniform 1400x1000 PNG compresses to a few KB
    print(f"\ndashboard screenshot: {path}")

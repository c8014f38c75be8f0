"""Lanes (seed 002: long and short prompts in separate pools): with a long/short mix, short requests' TTFT
p50 through two pools (1 interactive replica + 1 long-prompt replica) is at least 2x better than through one
pool of the same total size (2 replicas), measured by `kvpilot bench` against the Ray application."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvpilot.bench.api import BenchConfig, run_bench
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from tests.ray.conftest import deploy, engine_settings, smollm2_layers

pytestmark = pytest.mark.slow
pytest.importorskip("ray")
SHORT_LANE_CHARS = 2000  # ~400 tokens of bench's random text: every short prompt, no long one


def _warm_up(url: str) -> None:
    """A short and a long prompt, one at a time: each replica (round-robin, or its lane) pays its first
    steps' costs (new GEMM shapes, allocator growth) before the timed run, as a server up for a while has."""
    for words in (20, 700):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "warm " * words, "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text


def _short_ttft_p50(url: str, tmp_path: Path, name: str) -> tuple[float, float]:
    _warm_up(url)
    dataset = DatasetConfig(kind="long-short", input_len=32, output_len=8, long_fraction=0.3, long_input_len=900,
                            seed=3)
    target = Target(base_url=url, model="tiny", ignore_eos=True, endpoint="completions")
    outcome = run_bench(BenchConfig(target=target, dataset=dataset, load=LoadShape(concurrency=8, num_requests=32),
                                    tokenizer="embedded", progress=False, json_path=str(tmp_path / f"{name}.json")))
    run = outcome.runs[0]
    assert all(r.ok for r in run.output.records), [r.error for r in run.output.records if not r.ok]
    groups = run.aggregates.groups_ms
    assert groups is not None
    return groups["short"]["ttft"].median, groups["long"]["ttft"].median


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Deep enough that a long prompt's prefill (the head-of-line blocker) costs far more than Ray's hops."""
    return smollm2_layers(tmp_path_factory, 8)


def test_two_lanes_cut_short_requests_ttft(ray_serve: str, model: str, tmp_path: Path) -> None:
    # engines in the replicas, in both setups alike: a replica starts without spawning an engine process
    # (lanes route between replicas; where a replica runs its engine is not what is compared here)
    long_engine = {"max_num_batched_tokens": 2048}
    one_pool = {**engine_settings(model, **long_engine), "num_replicas": 2, "routing": "round_robin",
                "engine_process": False}
    url = deploy(ray_serve, "one-pool", one_pool)
    pooled_short, pooled_long = _short_ttft_p50(url, tmp_path, "one-pool")

    lanes = {**engine_settings(model), "routing": "round_robin", "lanes": [
        {"name": "interactive", "max_prompt_chars": SHORT_LANE_CHARS, "num_replicas": 1, "engine_process": False,
         "engine": {"max_num_batched_tokens": 256}},
        {"name": "long", "num_replicas": 1, "engine_process": False, "engine": long_engine}]}
    url = deploy(ray_serve, "two-lanes", lanes)
    laned_short, laned_long = _short_ttft_p50(url, tmp_path, "two-lanes")
    print(f"short TTFT p50: one pool {pooled_short:.1f} ms, two lanes {laned_short:.1f} ms "
          f"({pooled_short / laned_short:.2f}x); long TTFT p50: {pooled_long:.1f} -> {laned_long:.1f} ms")
    assert pooled_short >= 2 * laned_short

"""Prefix-aware routing on a local Ray cluster (#15): on a shared-prefix workload it gets at least 2x the
prefix-cache hit rate of round-robin, by the engines' own counters."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from tests.ray.conftest import PREFIX_PAIR_KEY, deploy, engine_settings, prefix_pair, replica_stats

pytestmark = pytest.mark.slow
pytest.importorskip("ray")
WORDS = ("river apple stone cloud market silver garden window engine paper forest yellow music winter copper "
         "bridge candle harbor lemon planet rocket saddle tunnel velvet wagon anchor basket cactus dragon").split()


def _shared_prefix_prompts(num_groups: int, num_rounds: int) -> list[str]:
    """num_groups prefixes of 250 words, each sent num_rounds times (groups in turn) with a new suffix."""
    rng = random.Random(7)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(250)) for _ in range(num_groups)]
    return [f"{prefixes[g]} question {r}-{g}: {rng.choice(WORDS)} {rng.choice(WORDS)}?"
            for r in range(num_rounds) for g in range(num_groups)]


def _hit_rate(url: str, prompts: list[str], headers: dict[str, str]) -> tuple[float, dict[str, Any]]:
    for prompt in prompts:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                       headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert 250 <= r.json()["usage"]["prompt_tokens"] <= 300  # the KV sizing below assumes this
    table = replica_stats(url, 2, headers=headers)
    return table["prefix_cache_hit_rate"], table


def test_prefix_routing_doubles_the_prefix_cache_hit_rate(ray_serve: str, tiny_model: str) -> None:
    """7 prefix groups of ~260 tokens; each replica's KV cache (5 MiB: ~1,700 tokens) holds about 6 of them.
    Round-robin sends every group to both replicas (7 is odd): each cycles through 7 groups and LRU evicts
    each before its reuse. Prefix routing pins each group to one replica: 3 or 4 groups each, all cached."""
    prompts = _shared_prefix_prompts(num_groups=7, num_rounds=4)
    rates = {}
    # round-robin first: the prefix-routing application stays up for test_serve.py (fresh counters here: the
    # replicas start with this test's requests)
    rr = {**engine_settings(tiny_model, kv_cache_memory="5MiB"), "num_replicas": 2, "routing": "round_robin",
          "engine_process": False}  # as prefix_pair's, routing aside
    rates["round_robin"], table = _hit_rate(deploy(ray_serve, "routing-round-robin", rr), prompts, {})
    assert table["routing"] == "round_robin"
    auth = {"Authorization": f"Bearer {PREFIX_PAIR_KEY}"}
    rates["prefix"], table = _hit_rate(prefix_pair(ray_serve, tiny_model), prompts, auth)
    assert table["routing"] == "prefix"
    print(f"prefix-cache hit rate: prefix routing {rates['prefix']:.3f}, round-robin {rates['round_robin']:.3f}")
    assert rates["prefix"] >= 0.5  # 3 of 4 rounds reuse ~240 of ~260 tokens: ~0.7
    assert rates["prefix"] >= 2 * rates["round_robin"]

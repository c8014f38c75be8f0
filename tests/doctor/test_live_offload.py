"""Issue #49 item 4 on the real kvpilot server: `kvpilot bench --dataset multi-turn` against a KV pool too small
to keep the sessions between turns. Without an offload tier the returning turns recompute their history and the
doctor names "prefix recomputed: KV offload would save X s"; with `--kv-offloading-size` the bench reports the
turns' prefixes copied back from the tier (cached_tokens / tier_cached_tokens of each response, and the server's
vllm:external_prefix_cache_hits)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from tests.doctor.bench_worker import BenchWorker
from tests.doctor.live_staging import bench, doctor, kvpilot_server, ranked

pytestmark = pytest.mark.slow

# 3 sessions at once of 3 turns (24 words a turn, 4 out): a returning turn resends ~60-100 tokens of history,
# three sessions need ~300 tokens; the pool holds 11 blocks of 16 (8 MiB of float32 KV), so the turns evict
# each other's history between turns.
SESSIONS = DatasetConfig(kind="multi-turn", input_len=24, output_len=4, num_turns=3, seed=5)
LOAD = LoadShape(concurrency=3, num_requests=12)
SMALL_POOL = dict(kv_cache_memory="8MiB", max_model_len=160)


@pytest.fixture(scope="module")
def worker() -> Iterator[BenchWorker]:
    with BenchWorker() as w:
        yield w


def test_recomputed_sessions_are_named_and_the_tier_brings_them_back(llm_fp32, worker: BenchWorker) -> None:
    with kvpilot_server(llm_fp32.loaded, **SMALL_POOL) as server:
        plain = bench(worker, server.url, SESSIONS, LOAD, "multi-turn")
    report = doctor(plain)
    found = [f for f in report.findings if f.rule_id == "prefix-recomputed"]
    assert found, ranked(report)
    assert found[0].title.startswith("Prefix recomputed: KV offload would save")
    assert found[0].fixes[0].kvpilot.startswith("--kv-offloading-size")
    cache = plain.result["runs"][0]["cache"]
    assert cache["returning"]["num_requests"] >= 6 and cache["returning"]["num_tier_cached_tokens"] == 0
    with kvpilot_server(llm_fp32.loaded, kv_offloading_size="64MiB", **SMALL_POOL) as server:
        offload = bench(worker, server.url, SESSIONS, LOAD, "multi-turn, offload")
    cache = offload.result["runs"][0]["cache"]
    assert cache["returning"]["num_tier_cached_tokens"] > 0 and (cache["server_tier_hits"] or 0) > 0, cache
    assert cache["returning"]["num_cached_tokens"] > plain.result["runs"][0]["cache"]["returning"]["num_cached_tokens"]
    assert "prefix-recomputed" not in [f.rule_id for f in doctor(offload).findings]

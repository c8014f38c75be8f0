"""`kvpilot bench` end to end against the real kvpilot server, one run per dataset kind: every request
succeeds, the server's own timings come back, and the per-request split (network + queue + tokenize +
prefill + decode + serialize) accounts for the client's end-to-end latency within a few percent."""

from __future__ import annotations

import json

import pytest

from kvpilot.bench.api import BenchConfig, run_bench
from kvpilot.bench.breakdown import stage_breakdown
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow
NAMED_STAGES = ("network", "queue", "tokenize", "prefill", "decode", "serialize")


def _dataset(kind: str, tmp_path) -> DatasetConfig:
    if kind == "jsonl":
        path = tmp_path / "prompts.jsonl"
        rows = [{"prompt": "Tell me about the sea.", "max_tokens": 6},
                {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6}] * 3
        path.write_text("\n".join(json.dumps(r) for r in rows))
        return DatasetConfig(kind="jsonl", path=str(path), output_len=6)
    if kind == "trace":
        path = tmp_path / "trace.jsonl"
        path.write_text("\n".join(json.dumps({"timestamp": 0.05 * i, "input_len": 24, "output_len": 6})
                                  for i in range(6)))
        return DatasetConfig(kind="trace", path=str(path))
    return DatasetConfig(kind=kind, input_len=48, output_len=6, num_prefixes=2, num_suffixes=3, prefix_len=96,
                         long_fraction=0.34, long_input_len=400, num_turns=2)


@pytest.mark.parametrize("kind", ["random", "shared-prefix", "long-short", "multi-turn", "jsonl", "trace"])
def test_bench_against_the_real_server(kind, live_server, tmp_path):
    target = Target(base_url=live_server.url, model=MODEL, api_key=API_KEY, ignore_eos=True,
                    endpoint="chat" if kind == "multi-turn" else "completions")
    load = LoadShape(num_requests=6) if kind == "trace" else LoadShape(concurrency=3, num_requests=6)
    outcome = run_bench(BenchConfig(target=target, dataset=_dataset(kind, tmp_path), load=load,
                                    tokenizer="embedded", progress=False, json_path=str(tmp_path / "r.json")))
    records = outcome.runs[0].output.records
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records]
    for record in records:
        assert record.server is not None and record.num_output_tokens == 6
        split = stage_breakdown(record)
        assert all(split[s] >= 0 for s in NAMED_STAGES), split
        named = sum(split[s] for s in NAMED_STAGES)
        assert abs(record.e2e_ms - named) <= 0.03 * record.e2e_ms + 2.0, split  # "other" within a few %
    if kind == "shared-prefix":
        assert max(r.server.num_cached_tokens for r in records) >= 80  # later requests hit the shared prefix
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["schema_version"] == 1 and len(saved["runs"][0]["requests"]) == 6

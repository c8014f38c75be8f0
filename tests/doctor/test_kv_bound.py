"""A KV pool llama-server does not report, bounded from the requests it failed for a full buffer
(kvpilot.doctor.rules.kv_bound), on results written by the bench's code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.findings import Severity
from kvpilot.doctor.inputs import inputs_from_documents, load_metrics, read_result
from kvpilot.doctor.server_config import ServerConfig
from tests.doctor.builders import llama_metrics, req, run, samples, write

PROMPT, SLOT_CONTEXT = 400, 1024


def _round(num_ok: int) -> list[RequestRecord]:
    """``num_ok`` requests of 400 prompt tokens sent together, first token at 100 ms and one every 10 ms after; one
    more sent with them fails at 155 ms for a full KV buffer (llama-server's words)."""
    ok = [dataclasses.replace(req(i, 0.0, queue=0.0, tokenize=0.0, prefill=100.0, itl=10.0, num_out=8, net=0.0,
                                  prompt=PROMPT, server=False), server_prompt_ms=100.0) for i in range(num_ok)]
    failed = dataclasses.replace(ok[0], request_index=num_ok, item_id=num_ok, ok=False, status=500,
                                 error_kind="http_500", error="failed to find free space in the KV cache",
                                 ttft_ms=None, e2e_ms=155.0, itl_ms=(), num_output_tokens=0, num_chunks=0)
    return [*ok, failed]


def _report(tmp_path: Path, num_ok: int, foreign_tokens: int = 0):
    records = _round(num_ok)
    result = write(tmp_path / "r.json", [run("concurrency=4", records, concurrency=num_ok + 1,
                                              metrics=samples(0.2, running=num_ok + 1, waiting=0, kv=0.0))])
    sent = PROMPT * len(records)
    before = llama_metrics(tmp_path / "before.txt", prompt_tokens=0, prompt_seconds=0)
    after = llama_metrics(tmp_path / "after.txt", prompt_tokens=sent + foreign_tokens, prompt_seconds=1.0)
    config = ServerConfig(source="/props", max_model_len=SLOT_CONTEXT, max_num_seqs=4, engine="llamacpp")
    inputs = inputs_from_documents([(read_result(result), result)], load_metrics([before, after]),
                                   server_config=config)
    return diagnose(inputs)


def test_failures_with_little_in_flight_bound_the_pool_below_the_context(tmp_path: Path) -> None:
    """Three requests held 3 x 406 tokens when the fourth (401 needed) failed: the buffer holds under 1,619 tokens,
    1.58 requests of the 1,024-token slot context: kv-pool-too-small, high and first; the full-buffer finding
    defers to it."""
    report = _report(tmp_path, num_ok=3)
    first = report.findings[0]
    assert first.rule_id == "kv-pool-too-small" and first.severity is Severity.HIGH, \
        [(f.rule_id, f.severity) for f in report.findings]
    bound = next(e for e in first.evidence if e.name.startswith("KV buffer, at most"))
    assert bound.value == 3 * (PROMPT + 6) + PROMPT + 1
    full = next(f for f in report.findings if f.rule_id == "kv-cache-pressure")
    assert full.defers_to == "kv-pool-too-small"


def test_other_clients_traffic_leaves_the_pool_unbounded(tmp_path: Path) -> None:
    """The server counted 5,000 prompt tokens the probe did not send: their KV was in the buffer unseen, so the
    failures bound nothing; the full-buffer finding stands alone."""
    report = _report(tmp_path, num_ok=3, foreign_tokens=5000)
    assert report.findings[0].rule_id == "kv-cache-pressure"
    assert not any(f.rule_id == "kv-pool-too-small" for f in report.findings)


@pytest.mark.parametrize("num_ok", [12])
def test_a_pool_that_held_many_contexts_is_not_too_small(tmp_path: Path, num_ok: int) -> None:
    """Twelve requests in flight (4,873 tokens, 4.8 contexts) when one failed: no kv-pool-too-small."""
    report = _report(tmp_path, num_ok=num_ok)
    assert not any(f.rule_id == "kv-pool-too-small" for f in report.findings)

"""llama-server's per-request prompt time (``timings.prompt_ms``): static batching and a slow hop read from what
requests spent outside their prompt (kvpilot.doctor.rules.prompt_gap), on results written by the bench's code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvpilot.bench.client import engine_prompt_ms
from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.findings import Severity
from kvpilot.doctor.inputs import load_inputs
from tests.doctor.builders import closed_loop, llama_metrics, req, run, samples, write

PREFILL_MS, TPOT_MS = 20.0, 12.0


def _llama(i: int, sent_s: float, *, wait_ms: float = 0.5, net_ms: float = 2.0) -> RequestRecord:
    """A request as llama-server answers it: no kvpilot timings, its prompt's own time on the final chunk;
    ``wait_ms`` before the prompt ran (a slot or the running batch), ``net_ms`` on the path."""
    r = req(i, sent_s, queue=wait_ms, tokenize=0.5, prefill=PREFILL_MS, itl=TPOT_MS, num_out=16, net=net_ms,
            prompt=64, server=False)
    return dataclasses.replace(r, server_prompt_ms=PREFILL_MS)


def _diagnose(tmp_path: Path, *, loaded_wait_ms: float, net_ms: float = 2.0, waiting: float = 0.0) -> DoctorReport:
    """A baseline at one in flight and a loaded run of 8 closed-loop clients, both of short uniform prompts (the
    probe's baseline and ramp), the server's waiting gauge at ``waiting`` under load (0 at one in flight)."""
    base = closed_loop(6, 1, lambda i, t: _llama(i, t, net_ms=net_ms))
    loaded = closed_loop(32, 8, lambda i, t: _llama(i, t, wait_ms=loaded_wait_ms, net_ms=net_ms))
    end = max(r.sent_s + (r.e2e_ms or 0) / 1000 for r in loaded)
    paths = [write(tmp_path / "base.json", [run("concurrency=1", base, concurrency=1,
                                                metrics=samples(2.0, running=1, waiting=0, kv=0.1))]),
             write(tmp_path / "loaded.json", [run("concurrency=8", loaded, concurrency=8,
                                                  metrics=samples(end, running=8, waiting=waiting, kv=0.3))])]
    return diagnose(load_inputs(paths))


def _first(report: DoctorReport) -> str | None:
    above = [f.rule_id for f in report.findings if f.severity is not Severity.LOW]
    return above[0] if above else None


def test_requests_held_for_the_running_batch_are_static_batching(tmp_path: Path) -> None:
    """Under load each request waited ~the batch's remaining answer (15 steps of 12 ms) before its prompt ran, with
    nothing waiting for a slot: llama-server --no-cont-batching. Named first, with the wait and the flag."""
    report = _diagnose(tmp_path, loaded_wait_ms=180.0)
    assert _first(report) == "static-batching", [(f.rule_id, f.severity) for f in report.findings]
    finding = report.findings[0]
    assert finding.severity is Severity.HIGH and finding.title.startswith("New requests wait for the running batch")
    assert finding.explains is not None and finding.explains.part_ms == pytest.approx(180.0, abs=5.0)
    assert finding.fixes[0].engine_flags == "--cont-batching"


def test_a_wait_of_one_step_is_continuous_batching(tmp_path: Path) -> None:
    """A continuously batching server adds a new request to its next step: a wait of about one TPOT is normal."""
    report = _diagnose(tmp_path, loaded_wait_ms=TPOT_MS)
    assert all(f.rule_id != "static-batching" or f.severity is Severity.LOW for f in report.findings)


def test_requests_that_waited_for_a_slot_are_not_static_batching(tmp_path: Path) -> None:
    """The same waits while the server's waiting gauge counted requests: they waited for a slot (queueing)."""
    report = _diagnose(tmp_path, loaded_wait_ms=180.0, waiting=3.0)
    assert not any(f.title.startswith("New requests wait for the running batch") for f in report.findings)


def test_a_slow_hop_is_network_overhead_not_static_batching(tmp_path: Path) -> None:
    """Every request spends 150 ms on the path, at one in flight as under load: network-overhead, first and high;
    the loaded requests' gap is no larger than the quickest ones', so no static batching."""
    report = _diagnose(tmp_path, loaded_wait_ms=TPOT_MS / 2, net_ms=150.0)
    assert _first(report) == "network-overhead", [(f.rule_id, f.severity) for f in report.findings]
    network = report.findings[0]
    assert network.severity is Severity.HIGH
    assert any("nothing waiting for a slot" in e.source for e in network.evidence)
    assert all(f.rule_id != "static-batching" or f.severity is Severity.LOW for f in report.findings)


def test_engine_prompt_ms_reads_llama_server_timings() -> None:
    assert engine_prompt_ms({"timings": {"prompt_n": 12, "prompt_ms": 31.5, "predicted_ms": 80.0}}) == 31.5
    assert engine_prompt_ms({"timings": {"prompt_ms": "fast"}}) is None
    assert engine_prompt_ms({"usage": {"prompt_tokens": 3}}) is None
    assert engine_prompt_ms({"timings": {"prompt_ms": True}}) is None


@pytest.mark.parametrize("longest", [2100.0, 70.0])
def test_other_clients_long_prompts_seen_in_llama_server_counters(tmp_path: Path, longest: float) -> None:
    """llama-server exports no prompt histogram: the prompt tokens it processed beyond the probe's own (12 of
    ~2,000), the seconds spent on them and its longest sequence (n_tokens_max) show another client's long prompts,
    prefilled in the steps the probe's requests decode in: prefill-interrupts-decode, first. When the longest
    sequence is no longer than the probe's prompts, the same token count is short traffic: no such finding."""
    records = closed_loop(32, 8, lambda i, t: _llama(i, t, wait_ms=5.0))
    end = max(r.sent_s + (r.e2e_ms or 0) / 1000 for r in records)
    result = write(tmp_path / "loaded.json", [run("concurrency=8", records, concurrency=8,
                                                  metrics=samples(end, running=8, waiting=0, kv=0.3))])
    own = sum(r.num_prompt_tokens or 0 for r in records)
    before = llama_metrics(tmp_path / "before.txt", prompt_tokens=1000, prompt_seconds=5, predicted=100,
                            predicted_seconds=2, longest=longest)
    after = llama_metrics(tmp_path / "after.txt", prompt_tokens=1000 + own + 12 * 2000,
                           prompt_seconds=5 + 0.9 * end, predicted=100 + 16 * 32, predicted_seconds=2 + 0.5 * end,
                           longest=longest)
    report = diagnose(load_inputs([result], [before, after]))
    found = next((f for f in report.findings if f.rule_id == "prefill-interrupts-decode"), None)
    if longest < 100:
        assert found is None
        return
    assert found is not None and _first(report) == "prefill-interrupts-decode", \
        [(f.rule_id, f.severity) for f in report.findings]
    counted = next(e for e in found.evidence if e.name == "prompts longer than any measured request's")
    assert counted.value == pytest.approx(12 * 2000 / longest) and "llamacpp:n_tokens_max" in counted.source

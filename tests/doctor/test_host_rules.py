"""Configuration and host rules: each names its staged cause first, with the numbers and the fix;
the deferrals, the client's relative-lag bar and the inherent long/short delay."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.findings import Finding, Severity
from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.prometheus import parse_prometheus_text
from kvpilot.doctor.server_config import from_capacity, from_metrics, from_serve_flags, merge
from tests.doctor.builders import closed_loop, jitter, req, run, samples, write
from tests.doctor.host_scenarios import HOST_SCENARIOS, capacity_json
from tests.doctor.scenarios import FIXTURES, SCENARIOS, _decoding_shorts


def _finding(report_findings: tuple[Finding, ...], rule_id: str) -> Finding:
    return next(f for f in report_findings if f.rule_id == rule_id)


@pytest.mark.parametrize("rule_id", sorted(set(HOST_SCENARIOS) - {"prefix-caching-off"}))
def test_host_scenario_names_its_cause_first(tmp_path: Path, rule_id: str) -> None:
    report = diagnose(HOST_SCENARIOS[rule_id](tmp_path))
    ranked = [(f.rule_id, f.severity.value) for f in report.findings]
    assert ranked and ranked[0][0] == rule_id, ranked
    top = report.findings[0]
    assert top.severity in (Severity.HIGH, Severity.MEDIUM) and top.evidence and top.fixes
    assert report.exit_code == 1


def test_tiny_pool_is_high_with_the_numbers_and_the_flag(tmp_path: Path) -> None:
    report = diagnose(HOST_SCENARIOS["kv-pool-too-small"](tmp_path))
    top = report.findings[0]
    assert top.severity is Severity.HIGH
    held = next(e.value for e in top.evidence if e.name == "max_model_len requests the pool holds")
    assert 1.0 <= held < 1.1  # 34 blocks of 16 tokens against 512
    # room for 4 requests of 512 tokens: 128 blocks of 720 KiB
    assert top.fixes[0].kvpilot == "--kv-cache-memory 90MiB"
    assert any(line.startswith("KV pool 544 tokens: 1.1 requests of max_model_len 512") for line in report.headroom)


def test_a_grouped_pool_counts_each_groups_blocks() -> None:
    """A kvpilot server with KV groups (Gemma-style: a full group and a sliding one of 256 tokens): a request of
    max_model_len holds all its blocks in the full group and the window's in the sliding one."""
    cfg = from_capacity(capacity_json(24, 4096, num_blocks=600, kv_group_windows=[None, 256]))
    assert cfg.kv_group_windows == (None, 256)
    assert cfg.blocks_for(4096) == 256 + 17 and cfg.blocks_for(100) == 7 + 7
    assert cfg.max_len_requests == pytest.approx(600 / 273)
    assert cfg.num_kv_tokens == 600 * 16 // 2
    assert from_capacity(capacity_json(24, 4096, kv_group_windows="bad")).kv_group_windows == ()


def _full_pool(tmp: Path) -> DoctorInputs:
    rng = random.Random(5)
    recs = closed_loop(30, 8, lambda i, t: req(i, t, prompt=48, num_out=8, prefill=jitter(rng, 40), queue=300.0))
    return load_inputs([write(tmp / "full.json", [run("concurrency=8", recs, concurrency=8,
                                                      metrics=samples(2, running=8, waiting=3, kv=0.97))])])


def test_a_pool_below_two_long_requests_is_the_cause_of_the_measured_pressure(tmp_path: Path) -> None:
    """1.06 requests of max_model_len: the configuration is why the pool is full; the measured
    pressure (and the queue it causes) rank below it and say so."""
    inputs = HOST_SCENARIOS["kv-pool-too-small"](tmp_path)
    report = diagnose(replace(_full_pool(tmp_path), server_config=inputs.server_config))
    ids = [f.rule_id for f in report.findings]
    assert ids[0] == "kv-pool-too-small" and report.findings[0].severity is Severity.HIGH, ids
    pressure = _finding(report.findings, "kv-cache-pressure")
    assert "see kv-pool-too-small" in pressure.summary and pressure.confidence <= 0.4


def test_measured_pressure_leads_a_pool_of_a_few_long_requests(tmp_path: Path) -> None:
    """3 requests of max_model_len is a medium configuration note; the full pool measured leads."""
    config = from_capacity(capacity_json(64, 512))  # 91 blocks: 1456 tokens, 2.8 requests of 512
    report = diagnose(replace(_full_pool(tmp_path), server_config=config))
    assert report.findings[0].rule_id == "kv-cache-pressure"
    assert _finding(report.findings, "kv-pool-too-small").severity is Severity.MEDIUM


def test_sequence_cap_below_reach_is_a_low_note(tmp_path: Path) -> None:
    inputs = HOST_SCENARIOS["max-num-seqs-over-kv"](tmp_path)
    quiet = load_inputs([write(tmp_path / "q.json", [run("concurrency=2", list(inputs.runs[0].records)[:10],
                                                         concurrency=2)])])
    report = diagnose(replace(quiet, server_config=inputs.server_config))
    note = _finding(report.findings, "max-num-seqs-over-kv")
    assert note.severity is Severity.LOW and report.healthy
    assert note.fixes[0].kvpilot == "--max-num-seqs 22"


def test_prefix_caching_off_is_low_alone_and_disabled_under_shared_prefixes(tmp_path: Path) -> None:
    report = diagnose(HOST_SCENARIOS["prefix-caching-off"](tmp_path))
    assert [(f.rule_id, f.severity) for f in report.findings] == [("prefix-caching-off", Severity.LOW)]
    shared = load_inputs(*SCENARIOS["prefix-cache-miss"](tmp_path)[:2])
    config = from_capacity(capacity_json(4096, 1024, enable_prefix_caching=False))
    report = diagnose(replace(shared, server_config=config))
    miss = report.findings[0]
    assert miss.rule_id == "prefix-cache-miss" and "prefix caching is disabled" in miss.summary
    assert "prefix-caching-off" not in [f.rule_id for f in report.findings]  # one finding per cause


def test_starvation_ranks_above_the_slow_steps_it_causes(tmp_path: Path) -> None:
    report = diagnose(HOST_SCENARIOS["cpu-starvation"](tmp_path))
    top = report.findings[0]
    assert top.rule_id == "cpu-starvation" and top.severity is Severity.HIGH
    assert "spin (pid 200" in top.summary
    decode = _finding(report.findings, "decode-bound")
    assert decode.confidence <= 0.4 and "cpu-starvation" in decode.summary


def test_wait_from_the_servers_own_threads_is_not_starvation(tmp_path: Path) -> None:
    inputs = HOST_SCENARIOS["cpu-starvation"](tmp_path)
    alone = replace(inputs.resources, server_cores=1.9, host_busy_share=1.0, doctor_cores=0.05, competitors=())
    report = diagnose(replace(inputs, resources=alone))
    assert "cpu-starvation" not in [f.rule_id for f in report.findings]
    assert report.findings[0].rule_id == "decode-bound"


def _lagged_run(tmp: Path, lag_ms: float, itl: float, concurrency: int | None, rate: float) -> DoctorInputs:
    rng = random.Random(6)
    recs = closed_loop(20, 4, lambda i, t: req(i, t, prefill=jitter(rng, itl), itl=itl, num_out=8))
    lag = [(k * 0.01, lag_ms if k % 20 == 0 else 0.5) for k in range(400)]
    return load_inputs([write(tmp / "r.json", [run("load", recs, concurrency=concurrency, request_rate=rate,
                                                    loop_lag=lag)])])


def test_client_lag_small_next_to_the_latencies_is_not_client_overload(tmp_path: Path) -> None:
    """The issue's case: a 14 ms stall next to a 1,400 ms TPOT (the bench itself said "overloaded")."""
    inputs = _lagged_run(tmp_path, 14.0, 1400.0, 4, float("inf"))
    assert inputs.runs[0].client_lag and inputs.runs[0].client_lag["overloaded"]
    assert "client-overload" not in [f.rule_id for f in diagnose(inputs).findings]


def test_client_overload_fixes_fit_the_loop(tmp_path: Path) -> None:
    closed = _finding(diagnose(_lagged_run(tmp_path, 40.0, 12.0, 4, float("inf"))).findings, "client-overload")
    assert closed.fixes and not any("--request-rate" in f.kvpilot for f in closed.fixes)
    opened = _finding(diagnose(_lagged_run(tmp_path, 40.0, 12.0, None, 50.0)).findings, "client-overload")
    assert "--request-rate" in opened.fixes[0].kvpilot


def test_one_step_long_prefill_is_a_headroom_note_not_a_finding(tmp_path: Path) -> None:
    """Long prompts of 512 tokens (one step at the default budget, one chunk of the proposed fix):
    shorts arriving during one wait about that step; the size is a note, the run stays healthy."""
    rng = random.Random(7)
    recs, longs = [], [(k * 1.0 + 0.3, k * 1.0 + 0.6) for k in range(3)]
    for i in range(60):
        sent = i * 0.05
        wait = next(((b - sent) * 1000 for a, b in longs if a <= sent < b), 0.0)
        recs.append(req(i, sent, prompt=64, prefill=jitter(rng, 30) + wait, num_out=1, group="short"))
    recs += [req(60 + k, a, prompt=512, prefill=(b - a) * 1000 - 3.5, num_out=1, group="long")
             for k, (a, b) in enumerate(longs)]
    inputs = load_inputs([write(tmp_path / "r.json", [run("mixed", recs, concurrency=None, request_rate=20.0,
                                                          metrics=samples(3, running=3, waiting=0, kv=0.3))])])
    report = diagnose(inputs)
    assert "long-short-mixing" not in [f.rule_id for f in report.findings] and report.healthy
    assert any(line.startswith("a 512-token prompt is prefilled in one step") for line in report.headroom)


def test_config_sources_parse_and_merge() -> None:
    flags = from_serve_flags(["kvpilot", "serve", "--max-num-seqs", "1", "--max-model-len=512",
                              "--no-enable-prefix-caching"])
    assert (flags.max_num_seqs, flags.max_model_len, flags.enable_prefix_caching) == (1, 512, False)
    vllm = from_metrics(parse_prometheus_text((FIXTURES / "vllm_v0_swapping.txt").read_text()))
    assert vllm is not None and (vllm.num_blocks, vllm.block_size, vllm.enable_prefix_caching) == (27264, 16, False)
    kvpilot = from_metrics(parse_prometheus_text(
        '# TYPE kvpilot:kv_cache_blocks gauge\nkvpilot:kv_cache_blocks{model_name="m",state="free"} 30.0\n'
        'kvpilot:kv_cache_blocks{model_name="m",state="total"} 34.0\n'))
    assert kvpilot is not None and kvpilot.num_blocks == 34
    merged = merge(kvpilot, flags)
    assert merged is not None and (merged.num_blocks, merged.max_model_len) == (34, 512)
    assert json.dumps(merged.to_json())


def test_stalls_of_a_one_chunk_prefill_are_a_note(tmp_path: Path) -> None:
    """The prefill-interrupts-decode scenario with 512-token long prompts (one chunk of the fix):
    the streams' pause is the step that computes them, so it is a headroom note with its size."""
    rng = random.Random(8)
    windows = [(1.0, 1.6), (2.2, 2.8)]
    recs = _decoding_shorts(rng, windows)
    recs += [req(7 + k, a, prompt=512, prefill=(b - a) * 1000 - 3.5, itl=15.0, num_out=20)
             for k, (a, b) in enumerate(windows)]
    report = diagnose(load_inputs([write(tmp_path / "r.json", [run("concurrency=9", recs, concurrency=9)])]))
    assert "prefill-interrupts-decode" not in [f.rule_id for f in report.findings]
    assert any(line.startswith("token streams paused") and "512-token prompt" in line for line in report.headroom)


def test_prefix_caching_off_still_noted_when_the_shared_prefix_loss_could_not_be_measured(tmp_path: Path) -> None:
    """A starved probe: its four shared-prefix requests all ran at once, so no reuse was achievable and
    prefix-cache-miss stays silent; the configuration note must not vanish with it."""
    rng = random.Random(3)
    recs = closed_loop(4, 4, lambda i, t: req(i, t, prompt=256, prefill=jitter(rng, 60), group=f"prefix-{i % 2}"))
    dataset = DatasetConfig(kind="shared-prefix", input_len=256, prefix_len=192, num_prefixes=2, num_suffixes=2)
    shared = load_inputs([write(tmp_path / "r.json", [run("concurrency=4", recs)], dataset=dataset)])
    config = from_capacity(capacity_json(4096, 1024, enable_prefix_caching=False))
    ids = [f.rule_id for f in diagnose(replace(shared, server_config=config)).findings]
    assert "prefix-cache-miss" not in ids and "prefix-caching-off" in ids

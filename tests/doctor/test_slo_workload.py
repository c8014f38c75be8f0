"""`--slo` and `--workload`: TPOT growing with the batch is a trade (a low note) until an SLO says it is too
slow; then the doctor names the batch cap where the SLO held. `--workload` recommends flags for its goal."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.findings import Finding, Severity
from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.server_config import ServerConfig
from kvpilot.doctor.slo import WORKLOADS, Goal, resolve_goal
from kvpilot.doctor.verify import THROUGHPUT, WITHIN_SLOS, _candidates, metric_for
from tests.doctor.builders import closed_loop, jitter, req, run, write


def _growth(tmp: Path, high_tpot: float = 36.0, slos: dict[str, float] | None = None) -> DoctorInputs:
    """TPOT 17 ms at 1 in flight, `high_tpot` at 8 (the 2-core CPU's bf16 server under --quick)."""
    rng = random.Random(3)
    one = closed_loop(12, 1, lambda i, t: req(i, t, prompt=64, itl=jitter(rng, 17, 0.03), num_out=8))
    eight = closed_loop(40, 8, lambda i, t: req(i, t, prompt=64, itl=jitter(rng, high_tpot, 0.03), num_out=8))
    return load_inputs([write(tmp / "c1.json", [run("c1", one, concurrency=1)], slos=slos),
                        write(tmp / "c8.json", [run("c8", eight, concurrency=8)], slos=slos)])


def _decode(inputs: DoctorInputs) -> Finding:
    return next(f for f in diagnose(inputs).findings if f.rule_id == "decode-bound")


def test_tpot_growth_without_an_slo_is_a_low_note_and_healthy(tmp_path: Path) -> None:
    report = diagnose(_growth(tmp_path))
    decode = next(f for f in report.findings if f.rule_id == "decode-bound")
    assert decode.severity is Severity.LOW and report.healthy and report.exit_code == 0
    assert "a trade rather than a fault" in decode.summary and "--slo tpot=" in decode.summary
    gain = next(e.value for e in decode.evidence if e.name.startswith("output throughput gain"))
    assert gain > 3.0  # 8x the streams at about 2.1x the TPOT


def test_an_slo_that_held_at_low_load_and_broke_at_high_names_the_cap(tmp_path: Path) -> None:
    decode = _decode(Goal(None, {"tpot": 25.0}).apply(_growth(tmp_path)))
    assert decode.severity is Severity.MEDIUM
    assert "breaking the SLO (tpot <= 25 ms) that held up to 1 in flight" in decode.summary
    assert decode.fixes[0].kvpilot == "--max-num-seqs 1"


def test_bench_slos_in_the_result_files_count_too(tmp_path: Path) -> None:
    decode = _decode(_growth(tmp_path, slos={"tpot": 25.0}))
    assert decode.severity is Severity.MEDIUM and decode.fixes[0].kvpilot == "--max-num-seqs 1"


def test_an_slo_met_at_every_load_keeps_growth_a_note(tmp_path: Path) -> None:
    decode = _decode(Goal("chat", dict(WORKLOADS["chat"].slos_ms)).apply(_growth(tmp_path)))
    assert decode.severity is Severity.LOW and "holds at the highest load" in decode.summary


def test_missing_the_slo_even_alone_is_a_finding(tmp_path: Path) -> None:
    decode = _decode(Goal(None, {"tpot": 10.0}).apply(_growth(tmp_path)))
    assert decode.severity is Severity.MEDIUM and "even at 1.0 in flight" in decode.summary
    assert _decode(Goal(None, {"tpot": 8.0}).apply(_growth(tmp_path))).severity is Severity.HIGH  # 17 ms: 2x over


def test_batch_workload_never_treats_growth_as_a_fault(tmp_path: Path) -> None:
    decode = _decode(Goal("batch", {}).apply(_growth(tmp_path, high_tpot=80.0)))
    assert decode.severity is Severity.LOW


def test_slo_headroom_line_gives_the_capacity_at_the_goal(tmp_path: Path) -> None:
    report = diagnose(Goal(None, {"tpot": 25.0}).apply(_growth(tmp_path)))
    line = next(h for h in report.headroom if h.startswith("SLOs (tpot <= 25 ms)"))
    assert "100% at 1.0 in flight" in line and "0% at 7.9 in flight" in line and "met up to 1.0 in flight" in line
    assert report.to_json()["slos_ms"] == {"tpot": 25.0}


def _with_config(inputs: DoctorInputs, **kw: object) -> DoctorInputs:
    base = dict(source="capacity endpoint", num_blocks=4096, max_model_len=8192, block_size=16,
                max_num_seqs=8, max_num_batched_tokens=2048, enable_prefix_caching=True)
    return replace(inputs, server_config=ServerConfig(**{**base, **kw}))  # type: ignore[arg-type]


def test_batch_workload_recommends_more_sequences_and_a_larger_budget(tmp_path: Path) -> None:
    inputs = Goal("batch", {}).apply(_with_config(_growth(tmp_path)))
    report = diagnose(inputs)
    tuning = next(f for f in report.findings if f.rule_id == "workload-tuning")
    assert tuning.severity is Severity.LOW and report.healthy
    # 65,536 KV tokens / (64 prompt + 8 output) = 910 requests: capped at 256.
    assert tuning.fixes[0].kvpilot == "--max-num-seqs 256 --max-num-batched-tokens 8192"
    assert [flags for _, flags in _candidates(report, "kvpilot")] == [
        ["--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]]
    assert metric_for("workload-tuning", "batch") is THROUGHPUT


def test_chat_workload_caps_the_batch_where_the_slos_held(tmp_path: Path) -> None:
    inputs = Goal("chat", {"ttft": 1000.0, "tpot": 25.0}).apply(
        _with_config(_growth(tmp_path), enable_prefix_caching=False))
    tuning = next(f for f in diagnose(inputs).findings if f.rule_id == "workload-tuning")
    assert tuning.fixes[0].kvpilot == "--max-num-seqs 1 --enable-prefix-caching"
    assert metric_for("workload-tuning", "chat") is WITHIN_SLOS
    assert WITHIN_SLOS.measure(inputs) == 0.0  # nobody at 8 in flight met tpot <= 25 ms


def test_goal_resolution_merges_presets_and_explicit_targets() -> None:
    assert resolve_goal("chat", "tpot=40ms") == Goal("chat", {"ttft": 1000.0, "tpot": 40.0})
    assert resolve_goal(None, "itl=0.2s") == Goal(None, {"itl": 200.0})
    assert resolve_goal("BATCH", None) == Goal("batch", {})
    with pytest.raises(DoctorInputError, match="use one of chat, agent, batch"):
        resolve_goal("gaming", None)
    with pytest.raises(DoctorInputError, match="--slo: bad SLO"):
        resolve_goal(None, "latency=fast")


def _uniform(tmp: Path, prefill_ms: float) -> DoctorInputs:
    """Uniform 512-token prompts at 1 and 4 in flight, each prefilled in `prefill_ms` (no length spread, so
    prefill-bound cannot speak), the server saying prefix caching is on."""
    rng = random.Random(5)
    one = closed_loop(12, 1, lambda i, t: req(i, t, prompt=512, prefill=jitter(rng, prefill_ms, 0.03), num_out=8))
    four = closed_loop(30, 4, lambda i, t: req(i, t, prompt=512, prefill=jitter(rng, prefill_ms, 0.03), num_out=8))
    inputs = load_inputs([write(tmp / "c1.json", [run("c1", one, concurrency=1)]),
                          write(tmp / "c4.json", [run("c4", four, concurrency=4)])])
    return replace(inputs, server_config=ServerConfig(source="test", enable_prefix_caching=True))


def test_a_ttft_slo_missed_with_one_request_in_flight_is_named_not_healthy(tmp_path: Path) -> None:
    """TTFT over its SLO on uniform prompts at the lightest load: no scheduling setting can help, and the
    verdict must not say healthy (it used to: the miss showed only in the headroom line)."""
    report = diagnose(Goal(None, {"ttft": 300.0}).apply(_uniform(tmp_path, prefill_ms=700.0)))
    floor = next(f for f in report.findings if f.rule_id == "slo-floor")
    assert floor.severity is Severity.HIGH and not report.healthy and report.exit_code == 1
    assert "median TTFT" in floor.summary and "against 300 ms" in floor.summary
    assert [f.kvpilot for f in floor.fixes if f.kvpilot] == []  # prefix caching is on: nothing to restart with
    assert all(finding.rule_id != "slo-floor" for finding, _ in _candidates(report, "kvpilot"))


def test_a_ttft_slo_met_at_the_lightest_load_raises_no_floor(tmp_path: Path) -> None:
    report = diagnose(Goal(None, {"ttft": 2000.0}).apply(_uniform(tmp_path, prefill_ms=700.0)))
    assert all(f.rule_id != "slo-floor" for f in report.findings)


def test_a_tpot_slo_is_left_to_decode_bound(tmp_path: Path) -> None:
    report = diagnose(Goal(None, {"tpot": 5.0}).apply(_uniform(tmp_path, prefill_ms=700.0)))
    assert all(f.rule_id != "slo-floor" for f in report.findings)

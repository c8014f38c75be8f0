"""Verify mode's pure parts: which flags a fix sets on the server command, which fixes are tried, and how a
trial is judged (on recorded probes: the restarts themselves run in test_live_host.py)."""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from rich.console import Console

from kvpilot.doctor import verify
from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.findings import Fix
from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.probe_plan import QUICK
from kvpilot.doctor.serve import engine_of, with_port
from kvpilot.doctor.verify import DEFAULT_METRIC, METRICS, _candidates, _helped, apply_flags, fix_flags
from tests.doctor.host_scenarios import HOST_SCENARIOS
from tests.doctor.scenarios import SCENARIOS


def test_fix_flags_only_for_concrete_flag_changes() -> None:
    seqs = Fix("x", kvpilot="--max-num-seqs 2", vllm="--max-num-seqs 2")
    assert fix_flags(seqs, "kvpilot") == ["--max-num-seqs", "2"]
    assert fix_flags(Fix("x", kvpilot="--kv-cache-memory <larger>"), "kvpilot") is None
    assert fix_flags(Fix("x", kvpilot="run another `kvpilot serve` replica"), "kvpilot") is None
    assert fix_flags(Fix("x", kvpilot="--a 1", vllm="--gpu-memory-utilization 0.95"), "vllm") == \
        ["--gpu-memory-utilization", "0.95"]


def test_other_engines_get_the_fix_the_diagnosis_translated_for_them() -> None:
    """llama-server, SGLang, TGI: the flags localize_fixes gave the fix for the engine it probed; none when it
    was translated for another engine or has no counterpart there."""
    slots = Fix("x", kvpilot="--max-num-seqs 4", vllm="--max-num-seqs 4", engine="llama.cpp",
                engine_flags="--parallel 4 --ctx-size 8192")
    assert fix_flags(slots, "llama.cpp") == ["--parallel", "4", "--ctx-size", "8192"]
    assert fix_flags(slots, "sglang") is None and fix_flags(slots, "vllm") == ["--max-num-seqs", "4"]
    assert fix_flags(Fix("x", vllm="--data-parallel-size 2", engine="llama.cpp"), "llama.cpp") is None
    argv = ["/opt/llama-server", "--model", "m.gguf", "--parallel", "1", "--ctx-size", "2048", "--metrics"]
    assert apply_flags(argv, ["--parallel", "4", "--ctx-size", "8192"]) == \
        ["/opt/llama-server", "--model", "m.gguf", "--metrics", "--parallel", "4", "--ctx-size", "8192"]


def test_apply_flags_replaces_values_and_boolean_forms() -> None:
    argv = ["kvpilot", "serve", "--max-num-seqs", "1", "--no-enable-prefix-caching", "--port=9"]
    assert apply_flags(argv, ["--max-num-seqs", "2"]) == \
        ["kvpilot", "serve", "--no-enable-prefix-caching", "--port=9", "--max-num-seqs", "2"]
    assert apply_flags(argv, ["--enable-prefix-caching"]) == \
        ["kvpilot", "serve", "--max-num-seqs", "1", "--port=9", "--enable-prefix-caching"]


def test_serve_command_gets_a_port_and_its_engine() -> None:
    argv, port = with_port(["kvpilot", "serve"])
    assert argv[-2:] == ["--port", str(port)] and port > 0
    assert with_port(["vllm", "serve", "m", "--port", "8123"]) == (["vllm", "serve", "m", "--port", "8123"], 8123)
    assert engine_of(["vllm", "serve", "m"]) == "vllm" and engine_of(["kvpilot", "serve"]) == "kvpilot"
    assert engine_of(["env", "VLLM_CPU_KVCACHE_SPACE=2", "/opt/venv/bin/vllm", "serve", "m"]) == "vllm"
    assert engine_of(["env", "A=1", "kvpilot", "serve"]) == "kvpilot"
    assert engine_of(["/root/llama-build/bin/llama-server", "--model", "m.gguf"]) == "llama.cpp"
    assert engine_of(["python", "-m", "sglang.launch_server", "--model-path", "m"]) == "sglang"
    assert engine_of(["text-generation-launcher", "--model-id", "m"]) == "tgi"


def test_candidates_follow_the_ranking_and_metrics_say_which_way_is_better(tmp_path: Path) -> None:
    report = diagnose(load_inputs(*SCENARIOS["queueing"](tmp_path)[:2]))
    candidates = _candidates(report, "kvpilot")
    assert candidates[0][0].rule_id == "queueing" and candidates[0][1] == ["--max-num-seqs", "2"]
    throughput = METRICS["static-batching"]  # a batch cap limits work done: higher is better
    assert not throughput.lower_is_better and _helped(throughput, 10.0, 11.5) and not _helped(throughput, 10.0, 10.5)
    assert METRICS["queueing"].lower_is_better  # the queue wait is inside TTFT: lower is better
    ttft = METRICS["prefix-cache-miss"]
    assert ttft.lower_is_better and _helped(ttft, 1000.0, 850.0) and not _helped(ttft, 1000.0, 950.0)
    assert not _helped(ttft, 1000.0, None) and DEFAULT_METRIC.lower_is_better


@dataclass
class _RecordedProbe:
    """What run_verify needs of a probe session: its inputs (a recorded scenario) and its phases (none)."""

    recorded: DoctorInputs
    phases: tuple = ()

    def inputs(self, *_: object) -> DoctorInputs:
        return self.recorded


def _shared_prefix_probe(tmp_path: Path, ttft_scale: float, starved: bool) -> tuple[_RecordedProbe, DoctorReport]:
    """The prefix-cache-miss scenario as the probe's shared-prefix phase (its TTFTs times ``ttft_scale``), its
    diagnosis with the cpu-starvation finding of a starved host added when ``starved``."""
    inputs = load_inputs(*SCENARIOS["prefix-cache-miss"](tmp_path)[:2])
    runs = tuple(replace(run, source="probe:shared-prefix", records=tuple(
        replace(r, ttft_ms=r.ttft_ms * ttft_scale) for r in run.records)) for run in inputs.runs)
    inputs = replace(inputs, runs=runs)
    report = diagnose(inputs)
    if starved:
        starvation = next(f for f in diagnose(HOST_SCENARIOS["cpu-starvation"](tmp_path)).findings
                          if f.rule_id == "cpu-starvation")
        report = replace(report, findings=(starvation, *report.findings))
    return _RecordedProbe(inputs), report


@pytest.mark.parametrize("starved", [False, True])
def test_no_gain_on_a_starved_host_is_undecided_not_withdrawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              starved: bool) -> None:
    """The fix changes nothing measurable: withdrawn (and the next fix tried) on a quiet host; on a host the
    doctor found starved, undecided, and verify stops there (no before/after on it can show a fix's gain)."""
    probes = [_shared_prefix_probe(tmp_path, 1.0, starved), _shared_prefix_probe(tmp_path, 0.98, starved)]
    calls = []

    def recorded(argv: list[str], *_: object) -> tuple[_RecordedProbe, DoctorReport]:
        calls.append(argv)
        return probes[min(len(calls), len(probes)) - 1]

    monkeypatch.setattr(verify, "_probe", recorded)
    result = verify.run_verify(["kvpilot", "serve", "--no-enable-prefix-caching"], QUICK, Console(file=io.StringIO()),
                               seed=1, budget_s=1e9, serve_timeout_s=1.0)
    first = result.trials[0]
    assert first.flags == ("--enable-prefix-caching",) and not first.kept
    assert first.undecided is starved and first.host_busy == (("before", "after") if starved else ())
    if starved:
        assert len(result.trials) == 1 and result.stopped.startswith("host too busy to judge")
        assert result.to_json()["trials"][0]["undecided"] is True
        out = io.StringIO()
        verify.print_verify(Console(file=out, width=200), result)
        assert "undecided: the CPU was starved in the before and after probe" in out.getvalue()
    else:
        assert not result.stopped.startswith("host too busy")


@pytest.mark.parametrize(("again", "kept"), [(0.85, True), (1.05, False)])
def test_a_change_within_the_noise_band_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          again: float, kept: bool) -> None:
    """A 15% gain (inside NOISE_BAND) gets a second before and after probe and is judged on the means: kept when
    the second after repeats it, withdrawn when the second after is worse than before."""
    scales = iter([1.0, 0.85, 1.0, again, 1.0, 1.0, 1.0, 1.0])  # baseline, after, before again, after again, ...
    argvs: list[list[str]] = []

    def recorded(argv: list[str], *_: object) -> tuple[_RecordedProbe, DoctorReport]:
        argvs.append(argv)
        return _shared_prefix_probe(tmp_path, next(scales), False)

    monkeypatch.setattr(verify, "_probe", recorded)
    result = verify.run_verify(["kvpilot", "serve", "--no-enable-prefix-caching"], QUICK, Console(file=io.StringIO()),
                               seed=1, budget_s=1e9, serve_timeout_s=1.0)
    first = result.trials[0]
    assert first.num_probes == 2 and first.kept is kept
    assert [("--enable-prefix-caching" in argv) for argv in argvs[:4]] == [False, True, False, True]
    assert first.change == pytest.approx((0.85 + again) / 2 - 1, abs=0.02)
    out = io.StringIO()
    verify.print_verify(Console(file=out, width=200), result)
    assert "(means of 2 probes each)" in out.getvalue() and result.to_json()["trials"][0]["probes"] == 2


def test_a_chunk_cap_is_judged_by_the_streams_longest_gaps(tmp_path: Path) -> None:
    """prefill-interrupts-decode is judged by the p99 inter-token gap (at the busiest load when other clients'
    prompts stalled it, in the long-short phase when the probe's own did): a cap on the prefill per step turns one
    1.3 s stall into four of 0.33 s, which moves a median TPOT by ~10% (the same prefill work) and the p99 gap
    four-fold."""
    from tests.doctor.builders import req, run, write  # noqa: PLC0415

    def probe(stall_ms: float, stalls: int, label: str = "probe:ramp-8") -> DoctorInputs:
        gaps = [25.0] * (60 - stalls) + [stall_ms] * stalls
        records = [req(i, 0.01 * i, itl=gaps, num_out=61) for i in range(8)]
        inputs = load_inputs([write(tmp_path / f"p{stall_ms:.0f}.json", [run(label, records, concurrency=8)])], [])
        return replace(inputs, runs=tuple(replace(r, source=label) for r in inputs.runs))  # as the probe names them

    # other clients' prompts (the server's metrics) stall the busiest load; the probe's own, its long-short phase
    for metric, label in ((verify.metric_for("prefill-interrupts-decode", judged_by="peak-itl-p99"), "probe:ramp-8"),
                          (verify.metric_for("prefill-interrupts-decode"), "probe:long-short")):
        unchunked, chunked = metric.measure(probe(1300.0, 3, label)), metric.measure(probe(330.0, 12, label))
        assert unchunked == pytest.approx(1300.0) and chunked == pytest.approx(330.0)
        assert _helped(metric, unchunked, chunked)
    few = load_inputs([write(tmp_path / "few.json", [run("x", [req(0, 0.0, itl=[25.0] * 5, num_out=6)])])], [])
    assert metric.measure(replace(few, runs=tuple(replace(r, source=label) for r in few.runs))) is None  # 5 gaps

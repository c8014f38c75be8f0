"""Verify mode's pure parts: which flags a fix sets on the server command, and which fixes are tried."""

from __future__ import annotations

from pathlib import Path

from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.findings import Fix
from kvpilot.doctor.inputs import load_inputs
from kvpilot.doctor.serve import engine_of, with_port
from kvpilot.doctor.verify import DEFAULT_METRIC, METRICS, _candidates, _helped, apply_flags, fix_flags
from tests.doctor.scenarios import SCENARIOS


def test_fix_flags_only_for_concrete_flag_changes() -> None:
    seqs = Fix("x", kvpilot="--max-num-seqs 2", vllm="--max-num-seqs 2")
    assert fix_flags(seqs, "kvpilot") == ["--max-num-seqs", "2"]
    assert fix_flags(Fix("x", kvpilot="--kv-cache-memory <larger>"), "kvpilot") is None
    assert fix_flags(Fix("x", kvpilot="run another `kvpilot serve` replica"), "kvpilot") is None
    assert fix_flags(Fix("x", kvpilot="--a 1", vllm="--gpu-memory-utilization 0.95"), "vllm") == \
        ["--gpu-memory-utilization", "0.95"]


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


def test_candidates_follow_the_ranking_and_metrics_say_which_way_is_better(tmp_path: Path) -> None:
    report = diagnose(load_inputs(*SCENARIOS["queueing"](tmp_path)[:2]))
    candidates = _candidates(report, "kvpilot")
    assert candidates[0][0].rule_id == "queueing" and candidates[0][1] == ["--max-num-seqs", "2"]
    throughput = METRICS["queueing"]  # a batch cap limits work done: higher is better
    assert not throughput.lower_is_better and _helped(throughput, 10.0, 11.5) and not _helped(throughput, 10.0, 10.5)
    ttft = METRICS["prefix-cache-miss"]
    assert ttft.lower_is_better and _helped(ttft, 1000.0, 850.0) and not _helped(ttft, 1000.0, 950.0)
    assert not _helped(ttft, 1000.0, None) and DEFAULT_METRIC.lower_is_better

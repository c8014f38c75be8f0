"""benchmarks/doctor_peers.py without starting a server: every planted fault of the matrix has the peers' keywords,
the keywords read the peers' real headlines as a person would, and the comparison lines count what they say."""

from __future__ import annotations

import pytest

import doctor_peers as dp
from peers.doctor_tools import ToolRun, judge, keyword_matcher
from peers.fault_matrix import FAULTS, fault


def test_every_planted_fault_has_peer_keywords():
    assert {f.name for f in FAULTS if not f.healthy} == set(dp.PEER_CAUSES)
    assert dp.peer_matcher(fault("healthy")) is None


@pytest.mark.parametrize(("cause", "headline", "names_it"), [
    # inference-profiler 0.1.0's headlines (analysis.py), inferpilot's and vllm-doctor's titles
    ("queueing", "Requests wait ≈2.10s in queue vs ≈0.05s of prefill at concurrency 8", True),
    ("queueing", "Throughput saturates near concurrency 2: raising it to 4 adds 3%", True),
    ("queueing", "Heavy latency tail at concurrency 8: P99 is 3.1× P50 (2.00s vs 0.65s)", False),
    ("static-batching", "Batching is under-filled at concurrency 8 (mean batch 1.0)", True),
    ("kv-pool", "KV-BOUND & PREEMPTING", True),
    ("kv-pool", "NEAR CAPACITY", True),
    ("kv-pool", "COMPUTE / OTHER-BOUND", False),
    ("prefix-caching", "Low prefix cache hit rate", True),
    ("long-prompts", "Requests wait ≈1.20s in queue vs ≈0.90s of prefill at concurrency 8", True),
    ("long-prompts", "Heavy latency tail at concurrency 8: P99 is 5.0× P50 (4.00s vs 0.80s)", False),
    ("cpu-starvation", "Low throughput", False),
    ("network", "Heavy latency tail at concurrency 8: P99 is 1.2× P50", False),
    ("client", "Queue pressure", False),
])
def test_peer_keywords_read_headlines(cause, headline, names_it):
    assert keyword_matcher(cause)(headline) is names_it


def _run(cell: str) -> ToolRun:
    return ToolRun([], cell=cell)


def test_against_peers_counts_each_side():
    results = {
        "one-slot": {"kvpilot": _run("yes"), "vllm-doctor": _run("yes")},
        "tiny-kv-pool": {"kvpilot": _run("yes"), "vllm-doctor": _run("no (Low throughput)")},
        "slow-network": {"kvpilot": _run("no (queueing)"), "vllm-doctor": _run("yes")},
        "healthy": {"kvpilot": _run("yes"), "vllm-doctor": _run("not run: server did not start")},
    }
    [line] = dp.against_peers(results, ["kvpilot", "vllm-doctor"])
    assert "on 3 faults: both right 1, only kvpilot 1 (tiny-kv-pool), only vllm-doctor 1 (slow-network)" in line
    assert line.endswith("both wrong 0")


def test_kvpilot_is_judged_strictly_by_its_first_finding_above_low():
    planted = fault("tiny-kv-pool")
    statements = [dp.Statement("low", "queueing"), dp.Statement("high", "cpu-starvation"),
                  dp.Statement("high", "kv-cache-pressure")]
    assert judge(statements, planted.expected.__contains__)[0] == "no (cpu-starvation)"
    assert judge(statements[:1], None)[0] == "yes"  # healthy: a LOW note is not a finding


def test_parse_args_checks_subsets_and_fills_the_matrix_defaults():
    args = dp.parse_args(["--faults", "healthy,one-slot", "--tools", "kvpilot"])
    assert args.engines == ["kvpilot"] and args.faults == ["healthy", "one-slot"]
    assert args.phase_seconds is None and args.max_concurrency is None
    with pytest.raises(SystemExit):
        dp.parse_args(["--faults", "no-such-fault"])


def test_stop_group_stops_a_process_group_that_ignores_the_first_signal():
    """The staged loads are stopped by their group: SIGINT first (bench prints its summary), SIGKILL after."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from peers.doctor_tools import stop_group  # noqa: PLC0415

    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert process.stdout.readline() == b"up\n"
    stop_group(process, signal.SIGINT, wait_s=0.5)
    assert process.poll() == -signal.SIGKILL

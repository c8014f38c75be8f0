"""Staged faults on the real kvpilot server, one per rule: the doctor must name the staged cause first.

Every server runs the real engine on the session's weights (``llm_fp32.loaded``) with one setting
changed, or an honest fault in front of it (a delaying TCP proxy, an OpenAI-only gateway that hides
kvpilot's timings and metrics, a slow tokenizer in the server, a busy load generator). The load
comes from ``run_bench`` in a worker process (see bench_worker.py). Delays and arrival times that
must dominate are sized from what the same server measured moments before, so the scenarios hold on
a slower or faster machine. docs/doctor.md has the table.
``memory-spillover`` is staged in test_live_spillover.py: it needs a `kvpilot serve` process of its
own under a memory cgroup with a swap file (root), not a server in this process.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.load import LoadShape
from kvpilot.doctor.diagnose import DoctorReport
from kvpilot.doctor.findings import Finding, Severity
from kvpilot.doctor.inputs import inputs_from_documents
from kvpilot.doctor.rules.context import RuleContext
from kvpilot.doctor.rules.prefill import measure_stalls
from kvpilot.doctor.thresholds import Thresholds
from kvpilot.fit.kv_cache import kv_cache_bytes_per_block
from kvpilot.server.background import BackgroundServer
from tests.doctor.bench_worker import BenchWorker
from tests.doctor.fault_staging import DelayProxy
from tests.doctor.live_staging import (Measured, bench, doctor, kvpilot_server, measured_until, ranked,
                                      slow_tokenizer)
from tests.doctor.openai_gateway import openai_gateway

pytestmark = pytest.mark.slow
SHORT = DatasetConfig(kind="random", input_len=32, output_len=8, seed=7)
TINY = DatasetConfig(kind="random", input_len=24, output_len=4, seed=8)
# Served one at a time, a request of 4 tokens (~120 ms) made the throughput gain of 8 queued clients over one
# 1.1-1.3x: the lone client's HTTP round trip between requests is not overlapped, and on a noisy 2-core box that
# crossed the 1.3x "flat" bar (a CI failure; 2 in 4 runs of the unchanged code). 16 tokens (~360 ms) each keep
# that round trip a small share.
ONE_AT_A_TIME = DatasetConfig(kind="random", input_len=24, output_len=16, seed=8)
LONG_LEN = 1024


def _client_lagged(*runs: Measured) -> bool:
    return any(r["client_lag"]["overloaded"] for m in runs for r in m.result["runs"])


def _lag_share(m: Measured) -> float:
    """The worst run's p99 client lag over its median TTFT (the latency a stall shifts by its whole length)."""
    shares = []
    for run in m.result["runs"]:
        lag = run["client_lag"]
        worst = max(lag["dispatch_lag_ms"]["p99"] or 0.0, lag["loop_lag_ms"]["p99"] or 0.0)
        ok = [r for r in run["requests"] if r["ok"]]
        shares.append(worst / statistics.median(r["ttft_ms"] for r in ok))
    return max(shares)


def _host_verdicts(report: DoctorReport, *runs: Measured) -> set[str]:
    """Findings a starved CI machine may rightly put first: the bench's own client lagged (``client-overload``),
    or the server ran far below this machine's speed (``degraded-run``: these scenarios measure no host, so the
    doctor cannot name the starvation itself)."""
    return {"degraded-run"} | ({"client-overload"} if _client_lagged(*runs) else set())


def _first_after_host(report: DoctorReport, rule_id: str, *runs: Measured) -> bool:
    """Whether ``rule_id`` is the top finding after any of the host verdicts the doctor explains."""
    ids, host = [f.rule_id for f in report.findings], _host_verdicts(report, *runs)
    while ids[:1] and ids[0] in host and ids[0] != rule_id:
        ids = ids[1:]
    return ids[:1] == [rule_id] and report.exit_code == 1


def assert_first(report: DoctorReport, rule_id: str, *runs: Measured) -> None:
    """``rule_id`` is the top finding, after any of the host verdicts the doctor explains (_host_verdicts)."""
    assert _first_after_host(report, rule_id, *runs), ranked(report)


def finding(report: DoctorReport, rule_id: str) -> Finding:
    """The finding of `rule_id` (assert_first may have let client-overload rank above it)."""
    return next(f for f in report.findings if f.rule_id == rule_id)


def _has(report: DoctorReport, rule_id: str) -> bool:
    return any(f.rule_id == rule_id for f in report.findings)


def _gain(low: Measured, high: Measured) -> float:
    """Output throughput at the higher load over the lower one (what static-batching judges)."""
    rate = [inputs_from_documents([(m.result, m.label)]).runs[0].output_throughput for m in (low, high)]
    return (rate[1] or 0.0) / (rate[0] or 1.0)


def _median(m: Measured, key: str, group: str | None = None) -> float:
    reqs = [r for run in m.result["runs"] for r in run["requests"] if r["ok"]]
    return statistics.median(r[key] for r in reqs if group is None or r["group_id"] == group)


def _server_ttft_s(m: Measured) -> float:
    reqs = [r for run in m.result["runs"] for r in run["requests"] if r["ok"] and r["server"]]
    return statistics.median(r["server"]["ttft_ms"] for r in reqs) / 1000.0


def _trace(path: Path, rows: list[dict[str, Any]]) -> DatasetConfig:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return DatasetConfig(kind="trace", path=str(path))


@pytest.fixture(scope="module")
def worker() -> Iterator[BenchWorker]:
    with BenchWorker() as w:
        yield w


@pytest.fixture(scope="module")
def healthy_server(llm_fp32) -> Iterator[BackgroundServer]:
    """Well configured for this traffic: prefix caching, continuous batching, room in the KV cache."""
    with kvpilot_server(llm_fp32.loaded) as server:
        yield server


@pytest.fixture(scope="module")
def healthy_runs(healthy_server: BackgroundServer, worker: BenchWorker) -> tuple[Measured, Measured]:
    """Concurrency 1 and 3 with chat-sized prompts (also the calibration of the other scenarios).
    Not 4: on a 2-core CPU four streams already make each decode step compute-bound, and TPOT
    doubling from 1 to 4 in flight is the decode-bound scenario below."""
    low = bench(worker, healthy_server.url, SHORT, LoadShape(concurrency=1, num_requests=5), "concurrency=1")
    high = bench(worker, healthy_server.url, SHORT, LoadShape(concurrency=3, num_requests=6), "concurrency=3")
    return low, high


def test_healthy_server_has_no_finding_above_low(healthy_runs: tuple[Measured, Measured]) -> None:
    report = doctor(*healthy_runs)
    above_low = {f.rule_id for f in report.findings if f.severity is not Severity.LOW}
    # a starved machine: only the host verdicts may be above low (the client, when its lag matters next to the
    # latencies; a server far below this machine's speed)
    assert above_low <= _host_verdicts(report, *healthy_runs), ranked(report)
    assert all(s.source == "server timings" for s in report.splits)


def test_tpot_growth_under_load_is_decode_bound(healthy_server: BackgroundServer, worker: BenchWorker) -> None:
    """24 streams on a 2-core CPU: each decode step computes 24 tokens, TPOT grows several-fold. That is a
    trade (a low note) until a TPOT SLO that one stream meets says it is too slow: then decode-bound leads
    and names the batch cap where the SLO held. (16 streams grew float32 TPOT only 2.2-3.5x on this box, and
    under 2x, the rule's bar, in one CI run.) The lone stream is measured right before the 24, not reused from
    the module's first runs: on a shared box the other jobs' load changes within a minute, and a lone stream
    timed during a busier moment than the 24 shrank the growth under the bar."""
    def measure() -> tuple[tuple[DoctorReport, float], str | None]:
        low = bench(worker, healthy_server.url, SHORT, LoadShape(concurrency=1, num_requests=5), "concurrency=1")
        high = bench(worker, healthy_server.url, SHORT, LoadShape(concurrency=24, num_requests=24), "concurrency=24")
        growth = _median(high, "tpot_ms") / _median(low, "tpot_ms")
        plain, report = doctor(low, high), doctor(low, high, slos_ms={"tpot": _slo_met_alone(low)})
        if not _has(plain, "decode-bound") or not _first_after_host(report, "decode-bound", low, high):
            return (report, growth), f"TPOT growth {growth:.2f}x: {ranked(plain)}, with the SLO {ranked(report)}"
        note = finding(plain, "decode-bound")
        assert note.severity is Severity.LOW and "a trade rather than a fault" in note.summary
        return (report, growth), None

    report, growth = measured_until(measure, "decode-bound from 1 to 24 streams, first under a TPOT SLO")
    named = next(e.value for e in finding(report, "decode-bound").evidence if e.name.startswith("TPOT growth"))
    assert named >= 2.0 and finding(report, "decode-bound").fixes[0].kvpilot == "--max-num-seqs 1", \
        f"TPOT growth {named:.2f}x from 1 to 24 in flight (medians {growth:.2f}x)"


def _slo_met_alone(low: Measured) -> float:
    """A TPOT SLO the lone stream meets: 1.5x its median, or above the TPOT 90% of its requests kept (the rule's
    bar) where a descheduled moment stretched the tail (a CI run: the cap then read "<lower>")."""
    alone = inputs_from_documents([(low.result, low.label)]).runs[0]
    tpots = sorted(r.tpot_ms for r in alone.ok if r.tpot_ms is not None)
    return max(1.5 * statistics.median(tpots), 1.05 * tpots[math.ceil(0.9 * len(tpots)) - 1])


def test_delaying_proxy_is_network_overhead(healthy_server: BackgroundServer, worker: BenchWorker,
                                            healthy_runs: tuple[Measured, Measured]) -> None:
    """A gateway on a long path: every byte arrives one server-TTFT late, each way."""
    delay_s = max(0.05, _server_ttft_s(healthy_runs[0]))
    with DelayProxy(healthy_server.port, delay_s) as proxy:
        measured = bench(worker, proxy.url, TINY, LoadShape(concurrency=2, num_requests=6), "via proxy")
    report = doctor(measured)
    assert_first(report, "network-overhead", measured)
    evidence = finding(report, "network-overhead").evidence
    gap = next(e.value for e in evidence if e.name.startswith("median client TTFT -"))
    assert gap >= 1.5 * delay_s * 1000  # both directions, minus nothing: the proxy only adds


def test_slow_tokenizer_is_tokenization(healthy_server: BackgroundServer, worker: BenchWorker,
                                        healthy_runs: tuple[Measured, Measured]) -> None:
    """The server's tokenizer sleeps one server-TTFT per prompt (a slow preprocessing hook)."""
    delay_s = max(0.02, _server_ttft_s(healthy_runs[0]))
    with slow_tokenizer(healthy_server, delay_s):
        measured = bench(worker, healthy_server.url, TINY, LoadShape(concurrency=1, num_requests=5), "slow tok")
    report = doctor(measured)
    assert_first(report, "tokenization", measured)
    tok_ms = next(e.value for e in finding(report, "tokenization").evidence if e.name.endswith("tokenize time"))
    assert tok_ms >= delay_s * 1000


def test_busy_load_generator_is_client_overload(healthy_server: BackgroundServer, worker: BenchWorker) -> None:
    """The bench shares its process with a CPU-bound thread: its event loop runs late."""
    measured = bench(worker, healthy_server.url, TINY, LoadShape(concurrency=2, num_requests=6), "busy client",
                     busy_client=True)
    report = doctor(measured)
    assert _client_lagged(measured)
    above_low = [f.rule_id for f in report.findings if f.severity is not Severity.LOW]
    if "client-overload" not in above_low:
        # A starved host makes the server so slow that the client's lag is a small share of what it measured:
        # then it does not taint the latencies (nothing), or, beside the server on 127.0.0.1, it is a caveat
        # (low) until it explains most of the time.
        assert _lag_share(measured) < Thresholds().client_lag_share_most, ranked(report)
        return
    assert [f.rule_id for f in report.findings][:1] == ["client-overload"], ranked(report)


@pytest.fixture(scope="module")
def one_seq_server(llm_fp32) -> Iterator[BackgroundServer]:
    """`--max-num-seqs 1`: one request runs at a time, the others wait for its slot."""
    with kvpilot_server(llm_fp32.loaded, max_num_seqs=1) as server:
        yield server


def test_one_sequence_at_a_time_is_queueing_then_static_batching(one_seq_server: BackgroundServer,
                                                                 worker: BenchWorker) -> None:
    """`--max-num-seqs 1` under 8 clients. Throughput stays flat too (static-batching), but that rule
    defers to queueing by design: the queue is the cause it sees, and kvpilot reports it per request."""
    # 8 requests alone, as the gateway test below: among 5, one slow request moved the lone client's throughput
    # enough that the flat-throughput finding did not come (a CI run, 2026-11-27)
    def measure() -> tuple[tuple[DoctorReport, Measured, Measured], str | None]:
        low = bench(worker, one_seq_server.url, ONE_AT_A_TIME, LoadShape(concurrency=1, num_requests=8),
                    "concurrency=1")
        high = bench(worker, one_seq_server.url, ONE_AT_A_TIME, LoadShape(concurrency=8, num_requests=8),
                     "concurrency=8")
        report = doctor(low, high)
        both = _first_after_host(report, "queueing", low, high) and _has(report, "static-batching")
        return (report, low, high), None if both else f"{_gain(low, high):.2f}x throughput: {ranked(report)}"

    report, low, high = measured_until(measure, "queueing first, static-batching below it")
    assert_first(report, "queueing", low, high)
    static = next(f for f in report.findings if f.rule_id == "static-batching")
    gain = next(e.value for e in static.evidence if e.name == "throughput gain")
    assert gain < 1.3 and static.confidence < finding(report, "queueing").confidence
    assert "one request at a time" in static.summary


def test_one_sequence_at_a_time_behind_an_openai_only_gateway_is_static_batching(
        one_seq_server: BackgroundServer, worker: BenchWorker) -> None:
    """The same server behind a gateway that exposes only the OpenAI API (openai_gateway.py: no
    "kvpilot" timings, no Server-Timing, /metrics 404). The queue is now invisible: the client sees
    only that throughput stays flat while 8 requests are in flight, which is static batching."""
    # 8 requests alone (one slow request among 5 could move the lone client's throughput by 1.3x), then 12 at
    # concurrency 8: served one after another, they average 5.7 in flight (8 would average 4.5), well clear of
    # the 4x load-ratio bar.
    def measure() -> tuple[tuple[DoctorReport, Measured, Measured], str | None]:
        with openai_gateway(one_seq_server.url) as gateway:
            low = bench(worker, gateway.url, ONE_AT_A_TIME, LoadShape(concurrency=1, num_requests=8),
                        "concurrency=1")
            high = bench(worker, gateway.url, ONE_AT_A_TIME, LoadShape(concurrency=8, num_requests=12),
                         "concurrency=8")
        report = doctor(low, high)
        named = _first_after_host(report, "static-batching", low, high)
        return (report, low, high), None if named else f"{_gain(low, high):.2f}x throughput: {ranked(report)}"

    report, low, high = measured_until(measure, "static-batching first behind the gateway")
    runs = [run for m in (low, high) for run in m.result["runs"]]
    assert all(r["ok"] and not r["server"] for run in runs for r in run["requests"])  # the timings were hidden
    assert all(run["server_metrics"]["summary"] is None for run in runs)  # and /metrics too
    assert "queueing" not in [f.rule_id for f in report.findings], ranked(report)
    assert all(s.source == "client only" for s in report.splits)
    static = next(f for f in report.findings if f.rule_id == "static-batching")
    assert next(e.value for e in static.evidence if e.name == "throughput gain") < 1.3


def test_prefix_caching_off_is_prefix_cache_miss(llm_fp32, worker: BenchWorker) -> None:
    with kvpilot_server(llm_fp32.loaded, enable_prefix_caching=False) as server:
        measured = bench(worker, server.url, DatasetConfig(kind="shared-prefix", input_len=128, prefix_len=96,
                                                           num_prefixes=2, num_suffixes=4, output_len=4, seed=9),
                         LoadShape(concurrency=2, num_requests=8), "shared prefixes")
    report = doctor(measured)
    assert_first(report, "prefix-cache-miss", measured)
    evidence = finding(report, "prefix-cache-miss").evidence
    assert next(e.value for e in evidence if e.name.startswith("measured")) == 0.0


@pytest.fixture(scope="module")
def big_budget_server(llm_fp32) -> Iterator[BackgroundServer]:
    """A token budget larger than any prompt: a long prompt is prefilled in one step, whole."""
    with kvpilot_server(llm_fp32.loaded, max_num_batched_tokens=4096, max_model_len=2048,
                        kv_cache_memory="384MiB") as server:  # 4.3 requests of 2048 (live_staging.engine_args)
        yield server


@pytest.fixture(scope="module")
def one_at_a_time(big_budget_server: BackgroundServer, worker: BenchWorker) -> Measured:
    """Long and short prompts, one request at a time: only the prompt length differs."""
    dataset = DatasetConfig(kind="long-short", input_len=32, long_input_len=LONG_LEN, long_fraction=0.34,
                            output_len=2, seed=10)
    return bench(worker, big_budget_server.url, dataset, LoadShape(concurrency=1, num_requests=6), "sequential",
                 slos={"ttft": 200.0})  # a chat product's TTFT target


def test_long_prompts_alone_are_prefill_bound(one_at_a_time: Measured) -> None:
    report = doctor(one_at_a_time)
    assert_first(report, "prefill-bound", one_at_a_time)
    corr = next(e.value for e in finding(report, "prefill-bound").evidence if e.name.startswith("correlation"))
    assert corr >= 0.9


def test_short_prompts_behind_a_long_prefill_are_long_short_mixing(
        big_budget_server: BackgroundServer, worker: BenchWorker, one_at_a_time: Measured, tmp_path: Path) -> None:
    """Three short prompts arrive while a long one is prefilled (they wait for its step); seven more
    come in pairs when the server is idle. One long among eleven: the length spread is one outlier,
    so prefill-bound (p90 vs p10 length) stays out of it."""
    t_long = _median(one_at_a_time, "ttft_ms", "long") / 1000
    t_short = _median(one_at_a_time, "ttft_ms", "short") / 1000
    rows = [{"timestamp": 0.0, "input_len": LONG_LEN, "output_len": 1}]
    rows += [{"timestamp": f * t_long, "input_len": 24, "output_len": 1} for f in (0.05, 0.1, 0.15)]
    idle = 2 * t_long + 0.5  # the long request is done by then, even on a machine twice as slow now
    rows += [{"timestamp": idle + (i // 2) * 3 * t_short, "input_len": 24, "output_len": 1} for i in range(7)]
    measured = bench(worker, big_budget_server.url, _trace(tmp_path / "mix.jsonl", rows),
                     LoadShape(num_requests=len(rows)), "long + short")
    report = doctor(measured)
    assert_first(report, "long-short-mixing", measured)
    assert next(e.value for e in finding(report, "long-short-mixing").evidence if e.name == "inflation") >= 2.0


def test_long_prefill_between_decode_steps_is_prefill_interrupts_decode(
        big_budget_server: BackgroundServer, worker: BenchWorker, one_at_a_time: Measured, tmp_path: Path) -> None:
    """Ten streams decode; one long prompt arrives and is prefilled in a single step with their
    decodes, so every stream's next token waits for it."""
    t_long = _median(one_at_a_time, "ttft_ms", "long") / 1000
    # The long prompt comes one long-prefill time after the streams (their prefill, 240 tokens in all, is done
    # by then even when the first batched steps are slow), and the streams decode long enough to still run
    # then: at 0.6x with 16 tokens a slow CI machine prefilled it with the last streams' prompts (no stall).
    rows = [{"timestamp": 0.0, "input_len": 24, "output_len": 48} for _ in range(10)]
    rows.append({"timestamp": t_long, "input_len": LONG_LEN, "output_len": 2})
    trace = _trace(tmp_path / "stall.jsonl", rows)

    def measure() -> tuple[tuple[DoctorReport, Measured], str | None]:
        measured = bench(worker, big_budget_server.url, trace, LoadShape(num_requests=len(rows)), "streams + long")
        report = doctor(measured)
        if _first_after_host(report, "prefill-interrupts-decode", measured):
            return (report, measured), None
        inputs = inputs_from_documents([(measured.result, measured.label)])
        return (report, measured), f"{ranked(report)}: {measure_stalls(RuleContext.build(inputs, Thresholds()))}"

    # A busy neighbour that pauses the server once while the streams decode stalls all ten at once, as many
    # stalls as the long prefill makes, and halves the share the rule judges: the likely cause of the one
    # failure seen before the second measurement (1 of 3 two-worker CI runs; not reproduced alone beside
    # `yes` x2 or bursty spinners, 10 runs).
    report, _ = measured_until(measure, f"prefill-interrupts-decode first (long prompt sent at {t_long:.2f} s)")
    stalls = finding(report, "prefill-interrupts-decode").evidence
    share = next(e.value for e in stalls if e.name == "stalls during a long prefill")
    assert share >= 0.5


def test_cli_probe_of_a_tiny_kv_cache_is_kv_cache_pressure(llm_fp32) -> None:
    """End to end: `kvpilot doctor --url ... --quick --json` in its own process against a server whose
    KV pool holds 12 blocks (192 tokens): the ramp's 8 clients cannot all fit. 3-second phases (8 by default;
    here each phase sent its whole cap of 24 requests in ~4.5 s): 9 to 22 requests a phase still press the pool
    (kv-cache-pressure came, pointing to kv-pool-too-small, in every run measured)."""
    block = kv_cache_bytes_per_block(llm_fp32.loaded.config, 16, 4)  # float32 K and V, 16 tokens
    with kvpilot_server(llm_fp32.loaded, kv_cache_memory=str(12 * block), max_model_len=128) as server:
        cli = [sys.executable, "-c", "from kvpilot.cli import main; main()"]
        proc = subprocess.run([*cli, "doctor", "--url", server.url, "--quick", "--json", "--phase-seconds", "3"],
                              capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    ids = [f["rule_id"] for f in doc["findings"]]
    while ids[:1] in (["client-overload"], ["cpu-starvation"]):  # measured host causes (test_live_host.py)
        ids = ids[1:]
    # The pool holds 1.5 requests of max_model_len (GET /v1/kvpilot/capacity): that configuration is the
    # cause, named first with the exact --kv-cache-memory; the pressure the probe measured (when a starved
    # host let it fill the pool) ranks below it and points to it.
    assert ids[:1] == ["kv-pool-too-small"], [(f["rule_id"], f["severity"]) for f in doc["findings"]]
    pressure = [f for f in doc["findings"] if f["rule_id"] == "kv-cache-pressure" and f["severity"] != "low"]
    assert all("see kv-pool-too-small" in f["summary"] for f in pressure)
    assert doc["probe"]["url"] == server.url and doc["probe"]["mode"] == "quick"
    assert [p["name"] for p in doc["probe"]["phases"]] == ["baseline", "long-short", "shared-prefix", "ramp-8"]
    assert "[1] baseline" in proc.stderr  # progress goes to stderr, stdout is the JSON alone

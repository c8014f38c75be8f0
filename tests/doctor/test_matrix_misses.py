"""The fault-matrix cells the doctor got wrong (docs/doctor.md, "The kvpilot column"), staged as the inputs the
doctor saw there: a client whose own stalls are most of the latency (slow-client), a pool too small for the
traffic's shared prefixes (tiny-kv-pool), another user's long prompts prefilled in one step (long-prompts), and
returning multi-turn sessions whose prefixes the pool evicted with no offload tier (issue #49 item 4)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvpilot.bench.datasets import DatasetConfig
from kvpilot.bench.records import RequestRecord
from kvpilot.doctor.diagnose import DoctorReport, diagnose
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.inputs import load_inputs
from kvpilot.model.default_model import default_model_path
from tests.doctor.builders import closed_loop, jitter, req, run, samples, write
from tests.doctor.host_scenarios import capacity_json
from tests.doctor.scenarios import multi_turn_sessions


def _ids(report: DoctorReport) -> list[tuple[str, str]]:
    return [(f.rule_id, f.severity.value) for f in report.findings]


def _stalls(stall_ms: float, seconds: float, every: int = 50) -> list[tuple[float, float]]:
    """Event-loop lag of one sample per 10 ms tick, with a ``stall_ms`` stall every ``every`` ticks (half a
    second by default)."""
    return [(k * 0.01, stall_ms if k % every == 0 else 0.4) for k in range(int(seconds * 100))]


def _slow_client(tmp: Path, stall_ms: float, stalls: tuple[float, float], every: int = 50) -> list[str]:
    """A healthy server on 127.0.0.1 probed by a client that stalls ``stall_ms`` every ``every`` ticks: each first
    token waits in the socket through ``stalls`` (low, high) of them (client TTFT = server TTFT + that)."""
    rng = random.Random(11)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prefill=jitter(rng, 40), num_out=8,
                                               net=2.0 + stall_ms * rng.uniform(*stalls)))
    return [write(tmp / f"slow-client-{stall_ms:g}-{every}.json",
                  [run("ramp-4", recs, loop_lag=_stalls(stall_ms, 8, every),
                       metrics=samples(4, running=4, waiting=0, kv=0.1))])]


def test_a_client_whose_stalls_are_most_of_the_latency_leads(tmp_path: Path) -> None:
    """The slow-client cell: 370 ms stalls beside 45 ms server TTFTs; the GIL-bound client reads most first
    tokens one or two stalls late, so its median TTFT (~870 ms) is more than twice the lag, which made the lag a
    LOW caveat "too small to explain it". But the time clients saw beyond the server's own TTFT is most of their
    p90 TTFT and the lag covers it: client-overload is the headline, with that share. A 15 ms stall on the same
    healthy server stays a caveat."""
    report = diagnose(load_inputs(_slow_client(tmp_path, 370.0, (1.5, 3.0))))
    first = report.findings[0]
    assert (first.rule_id, first.severity.value) == ("client-overload", "high"), _ids(report)
    assert first.explains is not None and first.explains.share > 0.5 and "beyond the server" in first.explains.of
    mild = diagnose(load_inputs(_slow_client(tmp_path, 15.0, (0.0, 1.0))))
    assert all(f.severity.value == "low" for f in mild.findings), _ids(mild)


def test_rare_long_stalls_are_not_hidden_by_a_per_tick_p99(tmp_path: Path) -> None:
    """The live slow-client cell (issue #51): a GIL-holding thread stalls the probe's loop ~300 ms once a second
    while its ticks run a little slow, so one tick in ~120 is late (under 1%: the per-tick p99 said 5 ms and
    client-overload never fired). The loop is stalled a fifth of the time: judged at p99 of the run's time, the
    stall is seen and leads where it is most of the latency. Short rare stalls on a healthy server stay clean."""
    report = diagnose(load_inputs(_slow_client(tmp_path, 300.0, (1.0, 2.0), every=120)))
    first = report.findings[0]
    assert (first.rule_id, first.severity.value) == ("client-overload", "high"), _ids(report)
    assert "300 ms" in first.summary
    quiet = diagnose(load_inputs(_slow_client(tmp_path, 25.0, (0.0, 0.3), every=120)))
    assert all(f.severity.value == "low" for f in quiet.findings), _ids(quiet)


def _some_requests_late(tmp: Path, late_ms: float) -> DoctorReport:
    """A healthy server on 127.0.0.1, probed at 1 and at 4 in flight (first token after ~150 and ~750 ms: the
    busiest phase's median TTFT is the delay judged), whose client stalls ~200 ms once a second: every fifth
    first token reaches it ``late_ms`` late, the others after the 2 ms loopback hop."""
    rng = random.Random(13)
    runs = []
    for label, concurrency, server_ms in (("c1", 1, 150.0), ("c4", 4, 750.0)):
        recs = closed_loop(40, concurrency, lambda i, t: req(i, t, prefill=jitter(rng, server_ms), num_out=8,
                                                             net=late_ms if i % 5 == 2 else 2.0))
        runs.append(run(label, recs, concurrency=concurrency, loop_lag=_stalls(200.0, 12, every=100),
                        metrics=samples(4, running=concurrency, waiting=0, kv=0.05)))
    return diagnose(load_inputs([write(tmp / f"late-{late_ms:g}.json", runs)]))


def test_a_client_that_delays_a_fifth_of_its_requests_leads_beside_a_healthy_server(tmp_path: Path) -> None:
    """The live slow-client cell on a quiet box: the server healthy, the client's stalls of two TTFTs once a
    second delay a fifth of the first tokens, less than half the p90 TTFT (so not "most of the latency"), but
    the only delay measured that the server does not explain: client-overload leads, medium, with its share.
    A client that is late by a loopback hop's few milliseconds stays clean."""
    report = _some_requests_late(tmp_path, 120.0)
    first = report.findings[0]
    assert (first.rule_id, first.severity.value) == ("client-overload", "medium"), _ids(report)
    assert first.explains is not None and 0.25 <= first.explains.share < 0.5
    assert "nothing on the server explains that delay" in first.summary
    punctual = _some_requests_late(tmp_path, 12.0)
    assert all(f.severity.value == "low" for f in punctual.findings), _ids(punctual)


def _vllm_ttft_histogram(path: Path, mean_ms: float, count: int) -> str:
    """A vLLM /metrics file whose TTFT histogram holds ``count`` first tokens of mean ``mean_ms`` (the server's
    own TTFT, from arrival: a co-located client's stalls are not in it)."""
    name = "vllm:time_to_first_token_seconds"
    lines = [f"# TYPE {name} histogram", f'{name}_bucket{{le="+Inf",model_name="m"}} {count}',
             f'{name}_count{{model_name="m"}} {count}', f'{name}_sum{{model_name="m"}} {count * mean_ms / 1000:.6f}']
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _stalled_vllm_probe(tmp: Path, added_ms: float, starved: float | None) -> DoctorReport:
    """A probe beside vLLM on one 2-core box (the vLLM column): no per-request server timings, the probe's loop
    stalled ~150 ms a fifth of the time, ``starved`` of that lateness spent waiting for a CPU, each first token
    read ``added_ms`` (mean) after the server sent it; the server's TTFT histogram holds the server's ~200 ms."""
    rng = random.Random(17)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prefill=jitter(rng, 200.0), num_out=8, server=False,
                                               net=2.0 + 2 * added_ms * rng.random()))
    result = write(tmp / f"vllm-{added_ms:g}-{starved}.json",
                   [run("ramp-4", recs, loop_lag=_stalls(150.0, 8, every=50), run_delay_share=starved,
                        metrics=samples(4, running=4, waiting=0, kv=0.1))])
    client_mean = sum(r.ttft_ms or 0.0 for r in recs) / len(recs)
    metrics = _vllm_ttft_histogram(tmp / f"vllm-{added_ms:g}.txt", client_mean - added_ms - 2.0, len(recs))
    return diagnose(load_inputs([result], [metrics]))


def test_a_probe_beside_vllm_is_judged_by_the_servers_ttft_histogram(tmp_path: Path) -> None:
    """A server that times no request (vLLM): client-overload states what the probe's stalls added to its mean
    TTFT against the server's TTFT histogram, and the share of the stalls its thread spent waiting for a CPU.
    Where the stalls add most of the mean TTFT it leads high (histogram_tail), as kvpilot's p90 does; a stall
    that adds a tenth is judged by its lag as before."""
    most = _stalled_vllm_probe(tmp_path, 400.0, starved=0.9)
    first = most.findings[0]
    assert (first.rule_id, first.severity.value) == ("client-overload", "high"), _ids(most)
    assert first.explains is not None and first.explains.share > 0.5 and "histogram" in first.explains.of
    assert "on average" in first.summary
    evidence = {e.name: e.value for e in first.evidence}
    assert evidence["of that, waiting for a CPU (other processes held the cores)"] == pytest.approx(0.9)
    little = _stalled_vllm_probe(tmp_path, 20.0, starved=None)
    client = next(f for f in little.findings if f.rule_id == "client-overload")
    evidence = {e.name: e.value for e in client.evidence}
    assert 0.05 < evidence["share of client mean TTFT"] < 0.15
    assert "of that, waiting for a CPU (other processes held the cores)" not in evidence
    assert client.explains is not None and "histogram" not in client.explains.of


def _tiny_pool(tmp: Path, kv: float, hits: float) -> list[str]:
    """The tiny-kv-pool cell's shared-prefix phase: `--kv-cache-memory 48MiB --max-model-len 256` (68 blocks of 16
    float32 tokens: 1,088) while other users' 200-token prompts keep it ``kv`` full; 4 prefix groups of 96 of 128
    tokens, ``hits`` of prompt tokens served from the cache."""
    rng = random.Random(12)
    recs = closed_loop(40, 4, lambda i, t: req(i, t, prompt=128, prefill=jitter(rng, 60), num_out=8,
                                               group=f"prefix-{i % 4}"))
    dataset = DatasetConfig(kind="shared-prefix", input_len=128, prefix_len=96, num_prefixes=4, num_suffixes=10)
    metrics = samples(3, running=10, waiting=0, kv=kv, prefix_queries=40 * 128, prefix_hits=hits * 40 * 128)
    return [write(tmp / f"tiny-{kv:g}-{hits:g}.json", [run("shared-prefix", recs, metrics=metrics)],
                  dataset=dataset, capacity=capacity_json(48, 256))]


def test_a_full_pool_outranks_the_prefix_miss_it_causes(tmp_path: Path) -> None:
    """The tiny-kv-pool cell: the pool 86% full, no preemption, 6% prefix hits where ~70% were reusable. The miss
    is the full pool's symptom: kv-cache-pressure leads with the numbers (hit vs achievable, room left at the peak)
    and the offload fix; prefix-cache-miss follows, deferring to it. A roomy pool with the same misses is a cache
    problem: prefix-cache-miss leads and kv-cache-pressure is absent."""
    report = diagnose(load_inputs(_tiny_pool(tmp_path, 0.86, 0.06)))
    ids = [f.rule_id for f in report.findings]
    assert _ids(report)[0] == ("kv-cache-pressure", "high"), _ids(report)
    first = report.findings[0]
    assert "evicted the traffic's cached prompt prefixes" in first.summary and "6%" in first.summary
    names = {e.name: e.value for e in first.evidence}
    assert names["measured prefix-cache hit rate"] < 0.1 and names["achievable hit rate"] > 0.5
    assert names["KV tokens free or cached at the peak"] < 0.15 * 1088 < 4 * 96  # room for less than the 4 prefixes
    assert "--kv-offloading-size" in first.fixes[0].kvpilot
    miss = report.findings[ids.index("prefix-cache-miss")]
    assert miss.defers_to == "kv-cache-pressure" and ids.index("prefix-cache-miss") > 0
    roomy = diagnose(load_inputs(_tiny_pool(tmp_path, 0.3, 0.06)))
    assert _ids(roomy)[0] == ("prefix-cache-miss", "high") and "kv-cache-pressure" not in [
        f.rule_id for f in roomy.findings]


def test_the_snapshot_reads_kvpilots_pool_occupancy() -> None:
    """kvpilot's own /metrics text (ServerMetrics over a scheduler snapshot): free and cached blocks reach the
    engine-neutral snapshot beside the total and vLLM's usage gauge."""
    from kvpilot.doctor.prometheus import parse_prometheus_text  # noqa: PLC0415
    from kvpilot.engine.scheduler_stats import SchedulerStats  # noqa: PLC0415
    from kvpilot.server.observe.metrics import ServerMetrics  # noqa: PLC0415

    stats = SchedulerStats(num_running=6, num_waiting=0, kv_cache_usage=60 / 68, prefix_cache_queries=5120,
                           prefix_cache_hits=307, num_preemptions=0, num_free_blocks=6, num_cached_blocks=2,
                           num_used_blocks=60, num_total_blocks=68)
    text = ServerMetrics("m", lambda: stats, memory=None).render().decode()
    snap = parse_prometheus_text(text)
    assert (snap.get("kv_blocks_free"), snap.get("kv_blocks_cached"), snap.get("kv_blocks_total")) == (6, 2, 68)
    assert abs((snap.get("kv_usage") or 0) - 60 / 68) < 1e-9


def _server_metrics(tmp: Path, name: str, prompts: list[tuple[int, float]], steps: list[int]) -> str:
    """kvpilot's /metrics text (its own ServerMetrics, vLLM's names and buckets) after requests of (prompt tokens,
    prefill seconds) and engine steps of those token counts."""
    from kvpilot.server.observe.metrics import ServerMetrics  # noqa: PLC0415

    m = ServerMetrics("m", lambda: None, memory=None)
    for tokens, prefill_s in prompts:
        m.request_prompt_tokens.labels("m").observe(tokens)
        m.prefill.labels("m").observe(prefill_s)
    for tokens in steps:
        m.iteration_tokens.labels("m").observe(tokens)
    path = tmp / name
    path.write_bytes(m.render())
    return str(path)


def _long_prompts(tmp: Path, num_foreign: int, queue_ms: float = 0.5) -> tuple[list[str], list[str]]:
    """The long-prompts cell: the probe's 48 short chats (64 tokens, 8 out) at 8 in flight decode a token every
    ~600 ms on a default kvpilot server (the embedded GGUF on a CPU), while another client's ``num_foreign``
    2,000-token prompts are each prefilled in one 1.2 s step. The probe sees none of them; the server's two
    scrapes (before and after) count them. ``queue_ms``: what each probe request waited before it ran (for the
    step under way: the waiting gauge stays 0, at most 7 of a cap of 256 run)."""
    rng = random.Random(13)
    recs = closed_loop(48, 8, lambda i, t: req(i, t, prompt=64, prefill=jitter(rng, 100), num_out=8, queue=queue_ms,
                                               itl=[jitter(rng, 600, 0.3) for _ in range(7)]))
    capacity = capacity_json(2048, 8192, fit_model=str(default_model_path()), fit_device="cpu", dtype="bfloat16",
                             quantization="gguf", weight_bits=5.74, max_num_batched_tokens=4096)
    end = max(r.sent_s + (r.e2e_ms or 0) / 1000 for r in recs)
    result = write(tmp / f"long-{num_foreign}.json",
                   [run("ramp-8", recs, concurrency=8, metrics=samples(end, running=7, waiting=0, kv=0.2))],
                   capacity=capacity)
    before = _server_metrics(tmp, "before.txt", [(64, 0.05)] * 5, [64] * 5)
    probe = [(64, 0.1)] * 48
    foreign = [(2000, 1.2)] * num_foreign
    steps = [8 + 64] * 48 + [8] * 300 + [2000 + 8] * num_foreign
    after = _server_metrics(tmp, f"after-{num_foreign}.txt", [(64, 0.05)] * 5 + probe + foreign,
                            [64] * 5 + steps)
    return [result], [before, after]


def test_other_clients_long_prompts_are_named_from_the_servers_metrics(tmp_path: Path) -> None:
    """The long-prompts cell ranked degraded-run ("something else had the machine"): the something else is in the
    server's prompt-token and step histograms. Named first with the numbers and the running engine's fixes (cap
    the chunk; disaggregate prefill and decode), degraded-run deferring to it. Without the foreign prompts the
    same probe has no such finding."""
    results, metrics = _long_prompts(tmp_path, 12)
    report = diagnose(load_inputs(results, metrics))
    first = report.findings[0]
    assert (first.rule_id, first.title) == ("prefill-interrupts-decode", "Long prompts stall decodes"), _ids(report)
    assert first.judged_by == "peak-itl-p99"  # --verify judges a chunk cap by the streams' longest gaps
    names = {e.name: e.value for e in first.evidence}
    assert names["prompts longer than any measured request's"] == 12
    assert abs(names["their mean length (estimated)"] - 2000) < 1 and names["steps over 1000 tokens"] == 12
    assert first.explains is not None and first.explains.share >= 0.3
    assert first.fixes[0].kvpilot == "--max-num-batched-tokens 512"
    assert "--long-prefill-token-threshold" in first.fixes[0].vllm and "--kv-role prefill" in first.fixes[1].kvpilot
    degraded = [f for f in report.findings if f.rule_id == "degraded-run"]
    assert all(f.defers_to == "prefill-interrupts-decode" for f in degraded)
    quiet = diagnose(load_inputs(*_long_prompts(tmp_path, 0)))
    assert "Long prompts stall decodes" not in [f.title for f in quiet.findings]


def test_recomputed_history_names_the_offload_saving(tmp_path: Path) -> None:
    """Issue #49 item 4: returning turns recomputed their whole history on a full pool without an offload tier:
    "prefix recomputed: KV offload would save X s of prefill", X from the recomputed tokens and the measured
    prefill rate, with --kv-offloading-size (kvpilot's and vLLM's flag). Not with a tier serving them, nor when
    the history was cached, nor on a pool with room (then nothing evicted it)."""
    report = diagnose(load_inputs(multi_turn_sessions(tmp_path, cached_share=0.0, tier=False, kv=0.95)))
    found = next(f for f in report.findings if f.rule_id == "prefix-recomputed")
    recomputed = sum(80 * turn for turn in range(4)) * 8  # every returning turn's history, 8 sessions
    names = {e.name: e.value for e in found.evidence}
    assert names["recomputed prefix tokens"] == recomputed and names["returning turns"] == 24
    assert abs(names["estimated prefill saved"] - recomputed * 0.5) < 1
    assert found.title == f"Prefix recomputed: KV offload would save {recomputed * 0.5 / 1000:,.1f} s of prefill"
    assert found.fixes[0].kvpilot == found.fixes[0].vllm == "--kv-offloading-size 2"
    for quiet in (dict(cached_share=1.0, tier=True, kv=0.95), dict(cached_share=0.9, tier=False, kv=0.95),
                  dict(cached_share=0.0, tier=False, kv=0.2)):
        other = diagnose(load_inputs(multi_turn_sessions(tmp_path, **quiet)))
        assert "prefix-recomputed" not in [f.rule_id for f in other.findings], (quiet, _ids(other))


def test_verify_judges_an_offload_fix_by_the_turns_that_reuse_a_prefix() -> None:
    from kvpilot.doctor.verify import PEAK_ITL_P99, REUSE_TTFT, metric_for  # noqa: PLC0415

    assert metric_for("prefix-recomputed") is REUSE_TTFT
    assert metric_for("kv-cache-pressure", None, ["--kv-offloading-size", "2"]) is REUSE_TTFT
    assert metric_for("kv-cache-pressure").name == "median E2E at the highest load"  # preemptions come after TTFT
    # other clients' long prompts are judged where they stall the probe's decodes, not in its long-short phase
    assert metric_for("prefill-interrupts-decode").name == "p99 inter-token gap beside long prompts"
    assert metric_for("prefill-interrupts-decode", judged_by="peak-itl-p99") is PEAK_ITL_P99


def _refused(i: int, sent_s: float, error: str) -> RequestRecord:
    """A request the server failed with HTTP 500 and `error` (llama-server's JSON error body, as bench keeps it)."""
    return replace(req(i, sent_s, server=False), ok=False, status=500, error_kind="http", error=error, ttft_ms=None,
                   e2e_ms=5.0, itl_ms=(), num_output_tokens=0, num_chunks=0)


def test_a_full_kv_buffer_failing_every_request_is_a_kv_finding_not_an_input_error(tmp_path: Path) -> None:
    """llama-server's unified KV buffer full (matrix cell tiny-kv-pool on llama.cpp): it answers 500 "Context size
    has been exceeded" to every request of the probe's baseline. That is the diagnosis, kv-cache-pressure HIGH
    with the KV fixes, not "every request failed" (exit 2); failures of another kind still are an input error."""
    body = "{'code': 500, 'message': 'Context size has been exceeded.', 'type': 'server_error'}"
    full = write(tmp_path / "full.json", [run("baseline", [_refused(i, 0.1 * i, body) for i in range(4)],
                                              concurrency=1)])
    report = diagnose(load_inputs([full], []))
    top = report.findings[0]
    assert (top.rule_id, top.severity.value) == ("kv-cache-pressure", "high") and report.exit_code == 1
    assert '4 of 4 requests failed with "Context size has been exceeded"' in top.summary
    assert any("--ctx-size" in fix.action for fix in top.fixes)
    down = write(tmp_path / "down.json", [run("baseline", [_refused(i, 0.1 * i, "connection refused")
                                                           for i in range(4)], concurrency=1)])
    with pytest.raises(DoctorInputError, match="no successful request"):
        load_inputs([down], [])


def test_refusals_beside_successes_lead_the_report(tmp_path: Path) -> None:
    """Some requests served, some failed for a full KV buffer: the failures are the first finding."""
    rng = random.Random(5)
    records = closed_loop(12, 4, lambda i, t: req(i, t, prefill=jitter(rng, 40), num_out=8, server=False))
    records += [_refused(12 + i, 1.0 + 0.1 * i, "Context size has been exceeded.") for i in range(6)]
    path = write(tmp_path / "mixed.json", [run("ramp-4", records, metrics=samples(4, running=4, waiting=0, kv=0.3))])
    top = diagnose(load_inputs([path], [])).findings[0]
    assert top.rule_id == "kv-cache-pressure" and top.severity.value == "high" and "6 of 18" in top.summary


def test_histories_that_outgrow_the_pools_blocks_were_evicted() -> None:
    """The pool holds whole blocks: three histories of 58 tokens take 12 blocks of 16, more than a pool of 11 holds,
    though their 174 tokens are fewer than its 176 (the live offload test's case whenever the 0.5 s scrapes missed
    the full pool); with 12 blocks nothing had to go."""
    from types import SimpleNamespace  # noqa: PLC0415

    from kvpilot.doctor.rules.offload import Recompute, _evicting  # noqa: PLC0415
    from kvpilot.doctor.server_config import ServerConfig  # noqa: PLC0415
    from kvpilot.doctor.thresholds import Thresholds  # noqa: PLC0415

    def ctx(config: ServerConfig | None) -> SimpleNamespace:
        view = SimpleNamespace(kv_usage_max=0.55, num_preemptions=0.0)  # scrapes that saw no full pool
        return SimpleNamespace(view=view, th=Thresholds(), inputs=SimpleNamespace(server_config=config))

    turns = Recompute(6, 258, 146, 0, 0.5, 40.0, (58, 58, 58))
    assert turns.num_history_tokens == 174
    assert _evicting(ctx(ServerConfig("capacity", num_blocks=11, block_size=16)), turns)
    assert not _evicting(ctx(ServerConfig("capacity", num_blocks=12, block_size=16)), turns)
    assert not _evicting(ctx(None), turns)


def test_a_queue_wait_for_other_clients_long_steps_defers_to_them(tmp_path: Path) -> None:
    """The long-prompts cell once ranked queueing first: each probe request waited ~2.7 s before it ran, while no
    request waited in the server's queue and 7 of a cap of 256 ran: they waited for the steps another client's
    long prompts made long. queueing then says so and defers to prefill-interrupts-decode, which leads."""
    results, metrics = _long_prompts(tmp_path, 12, queue_ms=2700.0)
    report = diagnose(load_inputs(results, metrics))
    assert report.findings[0].rule_id == "prefill-interrupts-decode", _ids(report)
    queueing = next(f for f in report.findings if f.rule_id == "queueing")
    assert queueing.defers_to == "prefill-interrupts-decode" and "long prompts" in queueing.summary
    alone = diagnose(load_inputs(*_long_prompts(tmp_path, 0, queue_ms=2700.0)))
    assert next(f for f in alone.findings if f.rule_id == "queueing").defers_to == ""

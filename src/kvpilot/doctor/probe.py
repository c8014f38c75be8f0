"""Live probing for ``kvpilot doctor --url``: short bench workloads against a running server.

Checks the endpoint, runs a single-request baseline, sizes the other phases from it (see
:mod:`kvpilot.doctor.probe_plan`), runs them with :func:`kvpilot.bench.api.run_bench` and scrapes
``/metrics`` before the first and after the last phase. The result documents are the bench's own, so
the doctor diagnoses them exactly like saved ``--from`` files.
"""

from __future__ import annotations

import io
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
from rich.console import Console

from kvpilot.bench.api import BenchConfig, BenchError, run_bench
from kvpilot.bench.arrivals import LoadShapeError
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetError
from kvpilot.bench.tokens import Tokenizer, TokenizerError, load_tokenizer
from kvpilot.doctor.engine_config import fetch_engine_config
from kvpilot.doctor.engines import detect_engine
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.inputs import DoctorInputs, inputs_from_documents, kv_full_phrase, runs_from_result
from kvpilot.doctor.probe_plan import (Baseline, ProbeLimits, ProbePhase, RampPoint, baseline_phase,
                                       knee_reason, plan_after_baseline)
from kvpilot.doctor.prometheus import MetricsSnapshot, metrics_delta, parse_prometheus_text
from kvpilot.doctor.resources import ResourceUsage, meter_for, remote_usage
from kvpilot.doctor.rules.client_lag import RunClientLag, lag_is_most, run_client_lag
from kvpilot.doctor.server_config import ServerConfig, fetch_capacity, merge
from kvpilot.doctor.server_config import from_metrics as config_from_metrics
from kvpilot.doctor.thresholds import Thresholds

BENCH_ERRORS = (BenchError, DatasetError, LoadShapeError, TokenizerError)


@dataclass(frozen=True)
class Endpoint:
    """A checked server: it answered ``GET /v1/models`` with at least one model.
    ``max_model_len`` is None when the server does not report it; ``owned_by`` and ``server_header`` are what
    that answer said about the engine (kvpilot.doctor.engines)."""

    base_url: str
    model: str
    max_model_len: int | None
    api_key: str | None = None
    owned_by: str | None = None
    server_header: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _models_error(url: str, detail: str) -> DoctorInputError:
    return DoctorInputError(f"cannot probe {url}: {detail}. Start the server (e.g. `kvpilot serve`) or pass the "
                            "base URL without /v1 (and --api-key if it needs one)")


def check_endpoint(base_url: str, api_key: str | None = None, model_name: str | None = None,
                   timeout_s: float = 10.0) -> Endpoint:
    """``GET /v1/models``; raises :class:`DoctorInputError` (exit 2) when the server is unreachable,
    refuses the key, lists no model, or does not list ``model_name``."""
    base = base_url.rstrip("/").removesuffix("/v1")
    url = base + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _models_error(url, f"{type(exc).__name__}: {exc}") from exc
    if resp.status_code in (401, 403):
        raise DoctorInputError(f"{url} refused the request (HTTP {resp.status_code}): pass the server's key "
                               "with --api-key")
    try:
        resp.raise_for_status()
        entries = [m for m in resp.json()["data"] if isinstance(m, dict) and m.get("id")]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise _models_error(url, f"no OpenAI model list ({type(exc).__name__}: {exc})") from exc
    if not entries:
        raise _models_error(url, "the server lists no model (still loading?)")
    entry = entries[0] if model_name is None else next((m for m in entries if m["id"] == model_name), None)
    if entry is None:
        raise DoctorInputError(f"{url} does not serve --model-name {model_name!r}; it serves "
                               f"{', '.join(str(m['id']) for m in entries)}")
    # kvpilot, vLLM and SGLang report max_model_len; llama-server the context of one slot as meta.n_ctx
    max_len = entry.get("max_model_len") or (entry.get("meta") or {}).get("n_ctx")
    return Endpoint(base, str(entry["id"]), int(max_len) if isinstance(max_len, int) and max_len > 0 else None,
                    api_key, owned_by=str(entry["owned_by"]) if entry.get("owned_by") else None,
                    server_header=resp.headers.get("server"))


def scrape_metrics(endpoint: Endpoint, timeout_s: float = 10.0) -> tuple[MetricsSnapshot | None, str | None]:
    """One ``/metrics`` scrape: (snapshot, None) or (None, why not). Never raises: a server without
    Prometheus metrics can still be probed (fewer rules apply)."""
    try:
        resp = httpx.get(endpoint.base_url + "/metrics", headers=endpoint.headers(), timeout=timeout_s)
        resp.raise_for_status()
        return parse_prometheus_text(resp.text), None
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except DoctorInputError as exc:
        return None, str(exc)


@dataclass(frozen=True)
class PhaseResult:
    """One phase as run: the bench result document plus what the console line reports."""

    phase: ProbePhase
    result: dict[str, Any]
    wall_s: float
    num_ok: int
    num_sent: int
    ttft_p50_ms: float | None
    num_tries: int = 1
    set_aside: dict[str, Any] | None = None  # the first try's result document, when a second try replaced it

    def to_json(self) -> dict[str, Any]:
        return {"name": self.phase.name, "looks_for": self.phase.looks_for, "wall_s": round(self.wall_s, 2),
                "num_ok": self.num_ok, "num_sent": self.num_sent, "ttft_p50_ms": self.ttft_p50_ms,
                "concurrency": self.phase.load.concurrency, "dataset": self.phase.dataset.kind,
                "num_tries": self.num_tries}


@dataclass(frozen=True)
class ProbeSession:
    """Everything one ``--url`` probe measured. Invariant: ``phases[0]`` is the baseline and has at
    least one successful request; ``metrics`` is the before/after delta of ``/metrics`` (None when the
    server has none: ``metrics_error`` says why)."""

    endpoint: Endpoint
    limits: ProbeLimits
    phases: tuple[PhaseResult, ...]
    metrics: MetricsSnapshot | None
    metrics_error: str | None
    wall_s: float
    seed: int
    notes: tuple[str, ...] = ()
    server_config: ServerConfig | None = None
    resources: ResourceUsage | None = None
    engine: str | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(f"live probe '{p.phase.name}' of {self.endpoint.base_url}" for p in self.phases)

    def documents(self) -> list[tuple[dict[str, Any], str]]:
        return [(p.result, f"probe:{p.phase.name}") for p in self.phases]

    def inputs(self, model: str | None = None, gpu: str | None = None) -> DoctorInputs:
        """The doctor's inputs: every phase's runs plus the metrics delta (same path as ``--from``)."""
        aside = [(p.set_aside, f"probe:{p.phase.name} (first try)") for p in self.phases if p.set_aside is not None]
        return inputs_from_documents(self.documents(), self.metrics, model, gpu, self.sources,
                                     self.server_config, self.resources, engine=self.engine, set_aside=aside)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.endpoint.base_url, "model": self.endpoint.model,
                "max_model_len": self.endpoint.max_model_len, "mode": self.limits.name, "seed": self.seed,
                "wall_s": round(self.wall_s, 2), "metrics_error": self.metrics_error,
                "max_in_flight": self.limits.max_in_flight, "phases": [p.to_json() for p in self.phases],
                "notes": list(self.notes), "engine": self.engine,
                "server_config": self.server_config.to_json() if self.server_config is not None else None,
                "resources": self.resources.to_json() if self.resources is not None else None}


def run_phase(endpoint: Endpoint, phase: ProbePhase, tok: Tokenizer, timeout_s: float,
              scrape_interval_s: float = 0.5) -> PhaseResult:
    """One ``run_bench`` call; its own summary tables are not printed (the doctor reports instead)."""
    target = Target(endpoint.base_url, endpoint.model, "completions", endpoint.api_key, stream=True,
                    ignore_eos=True, timeout_s=timeout_s)
    cfg = BenchConfig(target=target, dataset=phase.dataset, load=phase.load, tokenizer=tok,
                      scrape_interval_s=scrape_interval_s, progress=False)
    started = time.perf_counter()
    try:
        outcome = run_bench(cfg, Console(file=io.StringIO()))
    except BENCH_ERRORS as exc:
        raise DoctorInputError(f"probe phase '{phase.name}': {exc}") from exc
    records = [r for run in outcome.runs for r in run.output.records]
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    return PhaseResult(phase, outcome.result, time.perf_counter() - started, len(ok), len(records),
                       statistics.median(ttfts) if ttfts else None)


RETRY_SEED_OFFSET = 500
"""A phase measured again gets prompts of its own (dataset seed + this): the first try's are in the prefix cache."""


def own_stall(result: PhaseResult, th: Thresholds) -> RunClientLag | None:
    """The probe's own client lag in a phase when it is most of the phase's median TTFT (what makes
    client-overload a high finding), else None; a phase without a successful request has no TTFT to judge."""
    for run in runs_from_result(result.result, result.phase.name):
        found = run_client_lag(run)
        if found.ttft_ms is not None and lag_is_most(found, th):
            return found
    return None


def measured_phase(endpoint: Endpoint, phase: ProbePhase, tok: Tokenizer, timeout_s: float, console: Console,
                   notes: list[str]) -> PhaseResult:
    """``run_phase``, once more when the probe's own event loop stalled for most of the phase's median TTFT.

    The probe is the doctor's instrument: a stall of its own (a co-located server's threads, a GC pause) says
    nothing about the server, and one such stall in one of three probes made runs of the same server disagree.
    A stall that recurs in the second try is the client's to report, so the first try stands; one that does not
    is replaced by the second try. Either way ``notes`` says so."""
    th = Thresholds()
    first = run_phase(endpoint, phase, tok, timeout_s)
    stall = own_stall(first, th)
    if stall is None:
        return first
    console.print(f"  the probe's own event loop stalled {stall.lag_ms:,.0f} ms (p99; its median TTFT "
                  f"{stall.ttft_ms or 0:,.0f} ms): measuring the phase again", markup=False)
    retry = replace(phase, dataset=replace(phase.dataset, seed=phase.dataset.seed + RETRY_SEED_OFFSET))
    again = run_phase(endpoint, retry, tok, timeout_s)
    stalled_again = own_stall(again, th)
    if stalled_again is not None:
        notes.append(f"'{phase.name}': the probe's own event loop stalled in both tries ({stall.lag_ms:,.0f} and "
                     f"{stalled_again.lag_ms:,.0f} ms, p99): the first stands, and the client's lag is a finding")
        return replace(first, num_tries=2)
    notes.append(f"'{phase.name}' was measured twice: the probe's own event loop stalled {stall.lag_ms:,.0f} ms "
                 f"(p99) in the first try, most of its {stall.ttft_ms or 0:,.0f} ms median TTFT, and not in the "
                 "second, which is kept")
    return replace(again, phase=phase, num_tries=2, set_aside=first.result)


def ramp_point(result: PhaseResult) -> RampPoint:
    """Concurrency, output throughput and failed share of one ramp phase (the baseline is the first)."""
    runs = runs_from_result(result.result, result.phase.name)
    throughput = runs[0].output_throughput if runs else 0.0
    failed = 1.0 - result.num_ok / result.num_sent if result.num_sent else 1.0
    return RampPoint(result.phase.load.concurrency or 1, throughput, failed)


def baseline_of(result: PhaseResult, url: str) -> Baseline:
    """Medians of the baseline's successful requests; DoctorInputError (exit 2) when none succeeded."""
    runs = result.result.get("runs") or []
    requests = [r for run in runs for r in run.get("requests") or []]
    ok = [r for r in requests if r.get("ok")]
    if not ok:
        first = next((r.get("error") for r in requests if r.get("error")), "no request was sent")
        raise DoctorInputError(f"every baseline request to {url} failed ({first}): check that the server "
                               f"answers `kvpilot bench --base-url {url} --num-requests 1`")
    ttft = statistics.median(float(r["ttft_ms"]) for r in ok if r.get("ttft_ms") is not None)
    tpots = [float(r["tpot_ms"]) for r in ok if r.get("tpot_ms") is not None]
    prompt = statistics.median(int(r.get("num_prompt_tokens") or 1) for r in ok)
    return Baseline(max(ttft, 0.1), statistics.median(tpots) if tpots else 0.0, max(1, int(prompt)))


def _phase_line(p: PhaseResult) -> str:
    ttft = f", TTFT p50 {p.ttft_p50_ms:,.0f} ms" if p.ttft_p50_ms is not None else ""
    return f"  done in {p.wall_s:.1f} s: {p.num_ok}/{p.num_sent} ok{ttft}"


def endpoint_config(endpoint: Endpoint, metrics: MetricsSnapshot | None,
                    extra: ServerConfig | None = None, engine: str | None = None) -> ServerConfig | None:
    """What the server says about its limits: kvpilot's capacity endpoint first, then the detected engine's own
    (llama-server's /props, SGLang's /server_info, TGI's /info), /metrics, ``extra`` (e.g. --serve flags), and
    ``/v1/models``' max_model_len."""
    models = ServerConfig(source="/v1/models", max_model_len=endpoint.max_model_len, engine=engine)
    return merge(fetch_capacity(endpoint.base_url, endpoint.headers()),
                 fetch_engine_config(engine, endpoint.base_url, endpoint.headers()),
                 config_from_metrics(metrics) if metrics is not None else None, extra, models)


def endpoint_engine(endpoint: Endpoint, metrics: MetricsSnapshot | None) -> str | None:
    """The engine by /v1/models' owner, the Server header, then the metric names (kvpilot.doctor.engines)."""
    return detect_engine(endpoint.owned_by, endpoint.server_header) or (metrics.engine if metrics else None)


def probe_endpoint(endpoint: Endpoint, limits: ProbeLimits, console: Console, tokenizer: Any = None,
                   seed: int = 0, server_pids: tuple[int, ...] | None = None,
                   extra_config: ServerConfig | None = None) -> ProbeSession:
    """Run every phase in order, printing what each does; raises DoctorInputError (exit 2) when the
    baseline gets no answer or a bench option is invalid. ``server_pids``: the server's processes when
    known (a --serve child); else found by the port when the server is local."""
    started = time.perf_counter()
    meter = meter_for(endpoint.base_url, server_pids)
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as exc:
        raise DoctorInputError(f"--tokenizer: {exc}") from exc
    timeout_s = max(30.0, 2 * limits.phase_s)
    before, error = scrape_metrics(endpoint)
    console.print(f"probing {endpoint.base_url} ({endpoint.model}, max_model_len "
                  f"{endpoint.max_model_len or 'not reported'}; {limits.name} probe, at most "
                  f"{limits.max_in_flight} requests in flight)", markup=False)
    if error is not None:
        console.print(f"  no usable /metrics ({error}): rules on server state (KV cache, waiting "
                      "requests, prefix hits) have less to go on", markup=False)
    engine = endpoint_engine(endpoint, before)
    config = endpoint_config(endpoint, before, extra_config, engine)
    if meter is not None:
        meter.start()
    base_phase = _seeded(baseline_phase(limits, endpoint.max_model_len), seed)
    console.print(f"[1] baseline: {base_phase.describe()}", markup=False)
    retries: list[str] = []
    results = [measured_phase(endpoint, base_phase, tok, timeout_s, console, retries)]
    console.print(_phase_line(results[0]), markup=False)
    refusal = kv_full_refusal(results[0])
    if refusal is not None:  # every later phase would fail the same way: the diagnosis is already this
        console.print(f"  every baseline request failed for a full KV cache ({refusal}); the probe stops here",
                      markup=False)
        return _session(endpoint, limits, results, (before, error), started, seed, config, engine, meter, retries)
    base = baseline_of(results[0], endpoint.base_url)
    plan = [_seeded(p, seed) for p in plan_after_baseline(limits, endpoint.max_model_len, base)]
    points, knee = [ramp_point(results[0])], None
    for i, phase in enumerate(plan, 2):
        ramp = phase.name.startswith("ramp-")
        if ramp and knee is not None:
            continue
        console.print(f"[{i}] {phase.name}: {phase.describe()}", markup=False)
        results.append(measured_phase(endpoint, phase, tok, timeout_s, console, retries))
        console.print(_phase_line(results[-1]), markup=False)
        if meter is not None:
            meter.sample()
        if ramp and limits.find_knee:
            points.append(ramp_point(results[-1]))
            if (knee := knee_reason(points)) is not None:
                console.print(f"  saturation knee: {knee}; the ramp stops here", markup=False)
    return _session(endpoint, limits, results, (before, error), started, seed, config, engine, meter, retries)


def _session(endpoint: Endpoint, limits: ProbeLimits, results: list[PhaseResult],
             scraped: tuple[MetricsSnapshot | None, str | None], started: float, seed: int,
             config: ServerConfig | None, engine: str | None, meter: Any,
             retries: list[str]) -> ProbeSession:
    """The probe's session once its phases ran: the metrics delta since `scraped` (the first scrape and its
    error), the notes on phases measured twice (``retries``) and on thin phases, and the resources used."""
    before, error = scraped
    after, after_error = scrape_metrics(endpoint)
    wall_s = time.perf_counter() - started
    metrics = metrics_delta(before, after) if before is not None and after is not None else None
    notes = (*retries, *thin_phases(results, Thresholds().min_requests))  # the CLI shows them with the report
    resources = meter.stop() if meter is not None else remote_usage(
        metrics.get("process_cpu") if metrics is not None else None, wall_s)
    return ProbeSession(endpoint, limits, tuple(results), metrics, error or after_error,
                        wall_s, seed, notes, config, resources, engine)


def kv_full_refusal(result: PhaseResult) -> str | None:
    """What the server said when a phase's every request failed for a full KV buffer (inputs.KV_FULL_ERRORS: a
    finding, rules/kv_cache.py, not an unusable server); None otherwise."""
    requests = [r for run in result.result.get("runs") or [] for r in run.get("requests") or []]
    if not requests or any(r.get("ok") for r in requests):
        return None
    return next((p for r in requests if (p := kv_full_phrase(str(r.get("error") or "")))), None)


def thin_phases(results: list[PhaseResult], min_requests: int) -> tuple[str, ...]:
    """Phases whose deadline left fewer successful requests than the rules need to compare runs: a
    slow (or starved) server gets a bounded probe, and the report must not read as more certain."""
    thin = [f"'{p.phase.name}' ({p.num_ok})" for p in results if p.num_ok < min_requests]
    if not thin:
        return ()
    return (f"the server answered too slowly for this probe's time budget: {', '.join(thin)} got fewer than "
            f"{min_requests} successful requests, so rules comparing loads or request groups had little or "
            "nothing to go on; probe without --quick, or when the server is less busy",)


def _seeded(phase: ProbePhase, seed: int) -> ProbePhase:
    """Offset the phase's prompt seed: a second probe of the same server must not hit the prefix
    cache with the first probe's prompts (that would hide prefill costs)."""
    return replace(phase, dataset=replace(phase.dataset, seed=phase.dataset.seed + 1000 * seed))

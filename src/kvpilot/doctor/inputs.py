"""What the rules look at: runs from saved bench results, a /metrics snapshot, an optional roofline.

Bench result files are read with :func:`kvpilot.bench.result.read_result` (schema checked there) and
their requests rebuilt with :func:`kvpilot.bench.records.record_from_json`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvpilot.bench.records import RequestRecord, record_from_json
from kvpilot.bench.replica_report import ReplicaReport
from kvpilot.bench.result import ResultFileError, read_result
from kvpilot.doctor.errors import DoctorInputError
from kvpilot.doctor.prometheus import MetricsSnapshot, metrics_delta, parse_prometheus_text
from kvpilot.doctor.resources import ResourceUsage
from kvpilot.doctor.roofline_ref import RooflineRef, roofline_for
from kvpilot.doctor.server_config import CAPACITY_PATH, ServerConfig, from_capacity
from kvpilot.doctor.server_config import from_metrics as config_from_metrics


@dataclass(frozen=True)
class RunData:
    """One measured run (a bench run or one point of a sweep).

    ``in_flight`` is the mean number of requests in flight over the run (Little's law: sum of E2E /
    duration), comparable across closed-loop, open-loop and sweep runs. ``server_metrics`` is the
    bench's scraped summary (keys of docs/bench.md ``server_metrics.summary``) or None. ``replicas``: the
    run across the deployment's replicas (bench's ``replicas`` section), None for a single server.
    """

    source: str
    label: str
    records: tuple[RequestRecord, ...]
    in_flight: float
    output_throughput: float
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    client_lag: dict[str, Any] | None = None
    server_metrics: dict[str, Any] | None = None
    dataset: dict[str, Any] = field(default_factory=dict)
    slos_ms: dict[str, float] = field(default_factory=dict)
    burst: bool = False  # all requests sent at once (rate inf, no concurrency cap): a capacity probe
    closed_loop: bool = False  # a fixed number of clients (--concurrency): no request rate to lower
    replicas: ReplicaReport | None = None
    target_url: str = ""  # the base URL the bench sent to ("" when the result does not say)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def with_server(self) -> list[RequestRecord]:
        """Successful requests that carry kvpilot's per-stage server timings."""
        return [r for r in self.records if r.ok and r.server is not None]


@dataclass(frozen=True)
class DoctorInputs:
    """Everything one diagnosis reads. Invariant: at least one run or a metrics snapshot.
    ``runs`` are sorted by ``in_flight`` (lowest load first). ``server_config``: the server's
    configured limits (capacity endpoint, metrics, --serve flags); ``resources``: CPU/GPU use of the
    server and its host over a live probe (None for saved files). ``roofline`` (--model/--gpu) is what rules
    judge by; ``served_roofline``, drawn for the model and device the server names, only informs the verdict
    and headroom lines: fit's CPU and device figures are catalog values the user did not vouch for."""

    runs: tuple[RunData, ...] = ()
    metrics: MetricsSnapshot | None = None
    roofline: RooflineRef | None = None
    sources: tuple[str, ...] = ()
    server_config: ServerConfig | None = None
    resources: ResourceUsage | None = None
    slos_ms: dict[str, float] = field(default_factory=dict)
    """The doctor's own targets (`--slo`, `--workload`), ms by metric; empty: the runs' bench SLOs, if any."""
    workload: str | None = None
    """`--workload` preset name (chat, agent, batch), or None."""
    served_roofline: RooflineRef | None = None
    engine_hint: str | None = None
    """The engine a live probe detected (/v1/models, headers, metric names); None for saved files."""
    set_aside: tuple[RequestRecord, ...] = ()
    """Requests a live probe sent but whose measurements it set aside (a phase measured again because its own loop
    stalled): no rule reads their times, but the server's counters and histograms include them."""

    @property
    def engine(self) -> str | None:
        """Which engine served (kvpilot.doctor.engines): the probe's detection, else what the configuration or
        the metrics file's names say, else kvpilot when requests carry its per-stage timings; None: not told."""
        told = self.engine_hint or (self.server_config.engine if self.server_config is not None else None) \
            or (self.metrics.engine if self.metrics is not None else None)
        return told or ("kvpilot" if any(run.with_server for run in self.runs) else None)

    @property
    def verdict_roofline(self) -> RooflineRef | None:
        return self.roofline or self.served_roofline

    def __post_init__(self) -> None:
        if not self.runs and self.metrics is None:
            raise DoctorInputError("nothing to diagnose: give --from RESULT.json (from `kvpilot bench "
                                   "--output`) and/or --metrics-file METRICS.txt")

    @property
    def ok_records(self) -> list[RequestRecord]:
        return [r for run in self.runs for r in run.ok]

    @property
    def peak_run(self) -> RunData | None:
        return self.runs[-1] if self.runs else None

    @property
    def client_co_located(self) -> bool:
        """Whether the load generator ran on the server's machine: the doctor found the server's processes here
        (a local probe), or a run was sent to a loopback address. Such a client competes with the server for
        the same cores, so its lag is a caveat unless it explains most of the time."""
        local = self.resources is not None and bool(self.resources.server_pids)
        return local or any(is_loopback_url(run.target_url) for run in self.runs)


def is_loopback_url(url: str) -> bool:
    """A URL naming this machine by a loopback name or address (no DNS lookup: saved files are read offline)."""
    host = (urlsplit(url).hostname or "").lower()
    return host == "localhost" or host.startswith("127.") or host in ("::1", "0.0.0.0")


def _in_flight(records: list[RequestRecord], duration_s: float) -> float:
    busy_s = sum((r.e2e_ms or 0.0) for r in records) / 1000.0
    return busy_s / duration_s if duration_s > 0 else 0.0


def runs_from_result(doc: dict[str, Any], source: str) -> list[RunData]:
    """RunData for every run of one result document."""
    config = doc.get("config") or {}
    target_url = str((config.get("target") or {}).get("base_url") or "")
    runs = []
    for i, run in enumerate(doc.get("runs") or []):
        try:
            records = tuple(record_from_json(r) for r in run.get("requests") or [])
        except (TypeError, KeyError) as exc:
            raise DoctorInputError(f"{source}: run {i} has malformed request records ({exc}); re-run "
                                   f"`kvpilot bench --output`") from exc
        agg = run.get("aggregates") or {}
        duration = float(agg.get("duration_s") or 0.0)
        metrics = run.get("server_metrics") or {}
        load = run.get("load") or {}
        burst = (str(load.get("request_rate")) == "inf" and not load.get("concurrency")
                 and not load.get("max_concurrency"))
        runs.append(RunData(
            source=source, label=str(run.get("label", f"run {i}")), records=records,
            in_flight=_in_flight([r for r in records if r.ok], duration),
            output_throughput=float(agg.get("output_token_throughput") or 0.0),
            errors_by_kind=dict(agg.get("errors_by_kind") or {}),
            client_lag=run.get("client_lag"), server_metrics=metrics.get("summary"),
            dataset=dict(config.get("dataset") or {}), slos_ms=dict(config.get("slos_ms") or {}),
            burst=burst, closed_loop=bool(load.get("concurrency")),
            replicas=_replicas(run.get("replicas"), source, i), target_url=target_url))
    return runs


def _replicas(section: Any, source: str, index: int) -> ReplicaReport | None:
    if not section:
        return None
    try:
        return ReplicaReport.from_json(section)
    except (TypeError, ValueError, AttributeError) as exc:
        raise DoctorInputError(f"{source}: run {index} has a malformed replicas section ({exc}); re-run "
                               "`kvpilot bench --output`") from exc


def load_metrics(paths: list[str]) -> MetricsSnapshot | None:
    """One file: that scrape. Two or more: counters over first -> last, gauges from the last."""
    snaps = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise DoctorInputError(f"cannot read --metrics-file '{path}': {exc}") from exc
        try:
            snaps.append(parse_prometheus_text(text))
        except DoctorInputError as exc:
            raise DoctorInputError(f"{path}: {exc}") from exc
    if not snaps:
        return None
    return snaps[0] if len(snaps) == 1 else metrics_delta(snaps[0], snaps[-1])


def _median_int(values: list[int]) -> int:
    return int(statistics.median(values)) if values else 1


def load_inputs(result_paths: list[str], metrics_paths: list[str] | None = None, model: str | None = None,
                gpu: str | None = None, dtype: str | None = None) -> DoctorInputs:
    """Read the files; raises :class:`DoctorInputError` (one line, what to do) for unusable input."""
    docs = []
    for path in result_paths:
        try:
            docs.append((read_result(path), str(path)))
        except ResultFileError as exc:
            raise DoctorInputError(str(exc)) from exc
    return inputs_from_documents(docs, load_metrics(metrics_paths or []), model, gpu,
                                 tuple([*result_paths, *(metrics_paths or [])]), dtype=dtype)


def _served_roofline(config: ServerConfig, shape: tuple[int, int, int], dtype: str | None) -> RooflineRef | None:
    """The roofline of the model and device the server named (kvpilot's capacity endpoint), its weights in the
    format they are served in (int8 / int4 / fp8 quantized at load; a GGUF's own blocks, or the compute dtype
    when the server reports them dequantized, ``quantization`` "none"); None when fit
    cannot place it here (the model file is on another host, an unknown device) or the server named none (vLLM,
    an older kvpilot): it is a bonus, not an input the user gave."""
    if not (config.fit_model and config.fit_device):
        return None
    quantized = config.quantization if config.quantization not in (None, "none") else None
    weights = quantized if quantized in ("int8", "int4", "fp8") else None
    if config.quantization == "none" and dtype and config.fit_model.endswith(".gguf"):
        weights = dtype  # a GGUF dequantized at load: decode reads dense weights, not the file's blocks
    try:
        ref = roofline_for(config.fit_model, config.fit_device, *shape, dtype, weight_dtype=weights)
    except (DoctorInputError, OSError, ValueError):
        return None
    # the verdict names the file or directory, and the weights' format where they are quantized
    return replace(ref, model=Path(config.fit_model).name, dtype=quantized or ref.dtype)


def _bench_capacity(docs: list[tuple[dict[str, Any], str]]) -> ServerConfig | None:
    """The server's limits as the bench read them before its load (``config.server_capacity``, kvpilot's
    capacity endpoint); the first result that has them (None: older results, other engines)."""
    for doc, name in docs:
        capacity = (doc.get("config") or {}).get("server_capacity")
        if isinstance(capacity, dict) and capacity.get("num_blocks"):
            return replace(from_capacity(capacity), source=f"{name}: bench's GET {CAPACITY_PATH}")
    return None


# What a server answers when its KV buffer has no room left for a running request (llama-server's unified buffer
# fails the request with a 500 instead of preempting or queueing it), lower-cased
KV_FULL_ERRORS = ("context size has been exceeded", "failed to find free space in the kv cache")


def kv_full_phrase(error: str | None) -> str | None:
    """The KV_FULL_ERRORS phrase in a request's error text, as the server wrote it; None when there is none."""
    lowered = (error or "").lower()
    for phrase in KV_FULL_ERRORS:
        at = lowered.find(phrase)
        if at >= 0:
            return (error or "")[at:at + len(phrase)]
    return None


def inputs_from_documents(docs: list[tuple[dict[str, Any], str]], metrics: MetricsSnapshot | None = None,
                          model: str | None = None, gpu: str | None = None,
                          sources: tuple[str, ...] = (), server_config: ServerConfig | None = None,
                          resources: ResourceUsage | None = None, dtype: str | None = None,
                          engine: str | None = None,
                          set_aside: list[tuple[dict[str, Any], str]] | None = None) -> DoctorInputs:
    """In-memory result documents (e.g. ``BenchOutcome.result``) with a name each -> inputs.
    ``dtype``: for the roofline (default: what the server reported, else the model's own); ``engine``: the one a
    live probe detected; ``set_aside``: documents of phases a probe measured again (DoctorInputs.set_aside)."""
    runs = [run for doc, name in docs for run in runs_from_result(doc, name)]
    refused = any(kv_full_phrase(r.error) for run in runs for r in run.records)  # a finding (rules/kv_cache.py)
    if docs and not any(run.ok for run in runs) and not refused:
        raise DoctorInputError("no successful request in the bench results: fix the errors `kvpilot bench` "
                               "reported (server down? wrong --base-url?) and measure again")
    runs.sort(key=lambda r: r.in_flight)
    if server_config is None:
        server_config = _bench_capacity(docs)
    ok = [r for run in runs for r in run.ok]
    shape = (_median_int([r.num_prompt_tokens or 0 for r in ok]), _median_int([r.num_output_tokens for r in ok]),
             max(1, round(max((run.in_flight for run in runs), default=1.0))))
    served_dtype = dtype or (server_config.dtype if server_config is not None else None)
    roofline = served = None
    if model or gpu:
        roofline = roofline_for(model or "smollm2-135m", gpu or "cpu", *shape, served_dtype)
    elif server_config is not None:
        served = _served_roofline(server_config, shape, served_dtype)
    if server_config is None and metrics is not None:
        server_config = config_from_metrics(metrics)
    aside = tuple(r for doc, name in set_aside or () for run in runs_from_result(doc, name) for r in run.records)
    return DoctorInputs(tuple(runs), metrics, roofline, sources or tuple(name for _, name in docs),
                        server_config, resources, served_roofline=served, engine_hint=engine, set_aside=aside)

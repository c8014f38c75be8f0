"""Programmatic entry point: one bench (single run or sweep) from a :class:`BenchConfig`.

The CLI is a thin layer over :func:`run_bench`; the doctor and tests call it directly. Tools above bench
add sections to its HTML report through ``BenchConfig.report_sections`` (the doctor's diagnosis, wired by
kvpilot.cli), so bench never imports them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console

from kvpilot.bench.client import Target
from kvpilot.bench.clientlag import DEFAULT_MAX_LAG_MS
from kvpilot.bench.console import make_progress, print_summary
from kvpilot.bench.datasets import GENERATED_KINDS, DatasetConfig, build_dataset
from kvpilot.bench.load import LoadShape
from kvpilot.bench.records import RequestRecord, WorkItem
from kvpilot.bench.replicas import ReplicaPlan, detect_labelled, replica_id
from kvpilot.bench.result import Knee, RunResult, build_result, write_csv, write_json
from kvpilot.bench.client_processes import ProcessPlan, num_processes_for
from kvpilot.bench.runner import run_load
from kvpilot.bench.sweep import find_knee, run_sweep
from kvpilot.bench.tokens import Tokenizer, load_tokenizer


class BenchError(RuntimeError):
    """A problem that stops the bench before any load is sent (message says what to do)."""


ReportSection = Callable[[dict[str, Any], Console], str]
"""Extra HTML for the ``--html`` report, from the result document (the ``--output`` JSON): an already escaped
fragment placed after the summary table, or '' to add nothing (a section may say why on the console)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one ``kvpilot bench`` invocation needs. ``model`` None: first of ``/v1/models``.
    ``metrics_url`` None: ``<base_url>/metrics``; empty string: do not scrape (replicas neither).

    Replicas: ``replica_urls`` are scraped one by one (``<url>/metrics``) as the deployment's replicas; with
    ``route_replicas`` bench also sends the load to them round-robin (``target.base_url`` then only names
    the model server to ask for the model, and the deployment-wide metrics are the replicas' sum unless
    ``metrics_url`` is given). Without ``replica_urls`` and with ``detect_replicas``,
    ``<base_url>/metrics/replicas`` is tried once: when it answers (kvpilot's Ray Serve app) it is scraped.
    """

    target: Target
    dataset: DatasetConfig = DatasetConfig()
    load: LoadShape = LoadShape()
    slos: dict[str, float] = field(default_factory=dict)
    tokenizer: Any = None
    sweep: bool = False
    sweep_num_points: int = 5
    goodput_target: float = 0.9
    metrics_url: str | None = None
    scrape_interval_s: float = 1.0
    max_lag_ms: float = DEFAULT_MAX_LAG_MS
    json_path: str | None = None
    csv_path: str | None = None
    html_path: str | None = None
    html_plotlyjs: str = "directory"  # report_html.PLOTLYJS_MODES: a shared file beside the report, inline, cdn
    progress: bool = True
    report_sections: tuple[ReportSection, ...] = ()
    replica_urls: tuple[str, ...] = ()
    route_replicas: bool = False
    detect_replicas: bool = True
    client_processes: int = 1


@dataclass(frozen=True)
class BenchOutcome:
    runs: list[RunResult]
    knee: Knee | None
    result: dict[str, Any]


def resolve_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """First model id from ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
        if resp.status_code == 401:
            raise BenchError(f"{url} answered 401 (API key missing or wrong): pass the server's key with "
                             "--api-key, or set OPENAI_API_KEY")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"could not get a model name from {url} ({type(exc).__name__}: {exc}). "
                         f"Check --base-url, or pass --model NAME") from exc


def server_capacity(target: Target, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """kvpilot's ``GET /v1/kvpilot/capacity`` (its configured limits, model and device), stored with the result so
    `kvpilot doctor --from` can judge the run against them; None from a server without it (vLLM, a gateway)."""
    try:
        resp = httpx.get(target.base_url.rstrip("/") + "/v1/kvpilot/capacity", headers=target.headers(),
                         timeout=timeout_s)
        doc = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _config_json(cfg: BenchConfig, tok: Tokenizer, plan: ReplicaPlan | None,
                 capacity: dict[str, Any] | None = None) -> dict[str, Any]:
    target = dataclasses.asdict(cfg.target)
    target["api_key"] = "***" if cfg.target.api_key else None  # never write secrets to results
    return {"target": target, "dataset": dataclasses.asdict(cfg.dataset),
            "load": dataclasses.asdict(cfg.load), "slos_ms": dict(cfg.slos), "tokenizer": tok.name,
            "sweep": cfg.sweep, "sweep_num_points": cfg.sweep_num_points,
            "goodput_target": cfg.goodput_target, "max_lag_ms": cfg.max_lag_ms,
            "replicas": plan.to_json() if plan is not None else None, "server_capacity": capacity}


def replica_plan(cfg: BenchConfig, target: Target) -> ReplicaPlan | None:
    """The run's replicas: the given URLs, else ``<base_url>/metrics/replicas`` when it answers; None for a
    single server (or when scraping is off and bench does not route)."""
    if cfg.replica_urls:
        return ReplicaPlan(urls=tuple(replica_id(u) for u in cfg.replica_urls), route=cfg.route_replicas)
    if cfg.route_replicas:
        raise BenchError("route_replicas needs replica_urls (--replica-url URL, repeated)")
    if not cfg.detect_replicas or cfg.metrics_url == "":
        return None
    url = detect_labelled(target.base_url, target.headers())
    return ReplicaPlan(labelled_url=url) if url is not None else None


def prefix_share(dataset: DatasetConfig) -> float | None:
    """Share of each shared-prefix prompt that is its group's prefix (prefix + suffix of
    max(1, input_len - prefix_len) tokens, as the dataset builds them); None for other datasets."""
    if dataset.kind != "shared-prefix" or dataset.prefix_len <= 0:
        return None
    return dataset.prefix_len / (dataset.prefix_len + max(1, dataset.input_len - dataset.prefix_len))


def sweep_point_items(cfg: BenchConfig, tok: Tokenizer, items: list[WorkItem], point: int) -> list[WorkItem]:
    """The prompts of a sweep's `point`-th run: generated datasets get a new seed per run, so no run's
    prompts (or shared prefixes) are already in the server's prefix cache from an earlier run, which would
    make higher loads look faster than they are. File datasets (jsonl, trace) are replayed as given."""
    if point == 0 or cfg.dataset.kind not in GENERATED_KINDS:
        return items
    return build_dataset(dataclasses.replace(cfg.dataset, seed=cfg.dataset.seed + point), tok, len(items))


async def _run_all(cfg: BenchConfig, target: Target, items: list[WorkItem], tok: Tokenizer,
                   console: Console, plan: ReplicaPlan | None) -> list[RunResult]:
    metrics_url = (target.base_url.rstrip("/") + "/metrics") if cfg.metrics_url is None else cfg.metrics_url
    if cfg.metrics_url is None and plan is not None and plan.route:
        metrics_url = ""  # no server sees the whole deployment: its samples are the replicas' sum
    num_runs = 0

    async def one(label: str, shape: LoadShape) -> RunResult:
        nonlocal num_runs
        run_items = sweep_point_items(cfg, tok, items, num_runs)
        num_runs += 1
        status = Console(stderr=True)  # progress is not a result: on stderr, so `> file` holds only results
        with make_progress(status, disable=not (cfg.progress and status.is_terminal)) as progress:
            total = shape.num_requests if shape.num_requests is not None else None
            task = progress.add_task(label, total=total, errors=0)
            counts = {"errors": 0}

            def on_record(rec: RequestRecord) -> None:
                counts["errors"] += 0 if rec.ok else 1
                progress.update(task, advance=1, errors=counts["errors"])

            processes = ProcessPlan(num_processes_for(shape, cfg.client_processes), cfg.tokenizer)
            out = await run_load(target, run_items, shape, tok, metrics_url=metrics_url or None,
                                 scrape_interval_s=cfg.scrape_interval_s,
                                 on_record=on_record, replicas=plan, scrape_replicas=cfg.metrics_url != "",
                                 processes=processes)
        return RunResult.analyse(label, out, cfg.slos, cfg.max_lag_ms, prefix_share(cfg.dataset))

    if cfg.sweep:
        return await run_sweep(cfg.load, one, cfg.sweep_num_points)
    return [await one(cfg.load.label(), cfg.load)]


def run_bench(cfg: BenchConfig, console: Console | None = None) -> BenchOutcome:
    """Build the dataset, run, print the summary and write the requested files."""
    console = console or Console(stderr=True)
    if cfg.client_processes < 1:
        raise BenchError("--client-processes must be >= 1")
    if cfg.sweep and cfg.load.num_requests is None:
        raise BenchError("--sweep needs --num-requests: its max-throughput run sends them all at once")
    if cfg.html_path:  # checked before the run, not after it
        from kvpilot.bench.report_html import PLOTLYJS_MODES  # noqa: PLC0415 - plotly is needed for --html only

        if cfg.html_plotlyjs not in PLOTLYJS_MODES:
            raise BenchError(f"--html-plotlyjs {cfg.html_plotlyjs!r}: use one of {', '.join(PLOTLYJS_MODES)}")
    target = cfg.target
    if not target.model:
        target = dataclasses.replace(target, model=resolve_model(target.base_url, target.api_key))
    tok = load_tokenizer(cfg.tokenizer)
    num_requests = cfg.load.num_requests or 1000
    items = build_dataset(cfg.dataset, tok, num_requests)
    plan = replica_plan(cfg, target)
    capacity = server_capacity(target) if plan is None else None  # one server's limits, not a deployment's
    runs = asyncio.run(_run_all(cfg, target, items, tok, console, plan))
    knee = find_knee(runs, cfg.slos, cfg.goodput_target) if cfg.sweep else None
    result = build_result(_config_json(dataclasses.replace(cfg, target=target), tok, plan, capacity), runs, knee)
    print_summary(console, runs, knee)
    if cfg.json_path:
        write_json(cfg.json_path, result)
    if cfg.csv_path:
        write_csv(cfg.csv_path, runs)
    if cfg.html_path:
        extra_html = "".join(section(result, console) for section in cfg.report_sections)
        from kvpilot.bench.report_html import write_html  # noqa: PLC0415 - plotly is needed for --html only

        write_html(cfg.html_path, runs, knee, extra_html=extra_html, plotlyjs=cfg.html_plotlyjs)
    return BenchOutcome(runs, knee, result)


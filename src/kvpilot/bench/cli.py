"""``kvpilot bench``: the typer command. kvpilot.cli registers ``make_bench_command(sections)`` as
``app.command("bench")``, passing the doctor's report section: bench sits below the doctor and never
imports it. The flags are declared in bench/cli_options.py."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from kvpilot.bench.cli_options import (DEFAULT_BASE_URL, ApiKeyOpt, ArrivalOpt, BaseUrlOpt, BurstinessOpt,
                                       ClientProcessesOpt, ConcurrencyOpt, CsvOpt, DatasetOpt, DatasetPathOpt,
                                       DurationOpt, EndpointOpt, GoodputTargetOpt, HtmlOpt, HtmlPlotlyjsOpt,
                                       IgnoreEosOpt,
                                       InputLenOpt, LenDistOpt, LongFractionOpt, LongInputLenOpt, MaxClientLagOpt,
                                       MaxConcurrencyOpt, MetricsUrlOpt, ModelOpt, NumPrefixesOpt, NumRequestsOpt,
                                       NumSuffixesOpt, NumTurnsOpt, OutputLenOpt, OutputOpt, PrefixLenOpt,
                                       ProgressOpt, RangeRatioOpt, ReplicaUrlOpt, RequestRateOpt, ScrapeIntervalOpt,
                                       ScrapeMetricsOpt, SeedOpt, SloOpt, StreamOpt, SweepOpt, SweepPointsOpt,
                                       TemperatureOpt, TimeoutOpt, TokenizerOpt, WarmupOpt)

if TYPE_CHECKING:
    from rich.console import Console

    from kvpilot.bench.api import BenchConfig, BenchOutcome, ReportSection
    from kvpilot.bench.client import Target
    from kvpilot.bench.datasets import DatasetConfig
    from kvpilot.bench.load import LoadShape

# Lazy imports below (inside the functions): `kvpilot --help` should not pay for numpy/httpx/plotly imports.
UNAUTHORIZED_HINT = ("the server answered 401 (API key missing or wrong): pass its key with --api-key, or set "
                     "OPENAI_API_KEY")
DEFAULT_NUM_REQUESTS = 100  # when neither --num-requests nor --duration is given


@dataclass(frozen=True)
class BenchFlags:
    """The values of ``kvpilot bench``'s flags as typer parsed them, one field per flag (named like its
    parameter); :func:`bench_config` turns them into a :class:`~kvpilot.bench.api.BenchConfig`."""

    base_url: str | None
    replica_url: list[str] | None
    endpoint: str
    model: str | None
    api_key: str | None
    stream: bool
    ignore_eos: bool
    timeout: float
    temperature: float | None
    concurrency: int | None
    request_rate: float
    arrival: str
    burstiness: float
    max_concurrency: int | None
    num_requests: int | None
    duration: float | None
    warmup: int
    sweep: bool
    sweep_points: int
    dataset: str
    dataset_path: str | None
    input_len: int
    output_len: int
    len_dist: str
    range_ratio: float
    num_prefixes: int
    num_suffixes: int
    prefix_len: int
    long_fraction: float
    long_input_len: int
    num_turns: int
    tokenizer: str | None
    seed: int
    slo: str | None
    goodput_target: float
    metrics_url: str | None
    scrape_metrics: bool
    scrape_interval: float
    max_client_lag_ms: float
    client_processes: int
    output: str | None
    csv: str | None
    html: str | None
    html_plotlyjs: str
    progress: bool

    @property
    def replicas(self) -> tuple[str, ...]:
        """The ``--replica-url`` values, in order."""
        return tuple(self.replica_url or ())

    @property
    def route_replicas(self) -> bool:
        """Does bench send the load to the replicas itself (replicas given, no ``--base-url``)?"""
        return bool(self.replicas) and self.base_url is None


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> Any:  # Any: becomes a Literal type
    """``value`` when it is one of ``allowed``; else typer.BadParameter for ``flag``, naming them."""
    if value not in allowed:
        raise typer.BadParameter(f"{value!r}: use one of {', '.join(allowed)}", param_hint=flag)
    return value


def _target(flags: BenchFlags) -> Target:
    """Where and how requests go: ``--base-url``, else the first replica when bench routes, else the default."""
    from kvpilot.bench.client import Target  # noqa: PLC0415

    base_url = flags.base_url or (flags.replicas[0] if flags.route_replicas else DEFAULT_BASE_URL)
    return Target(base_url=base_url, model=flags.model or "",
                  endpoint=_choice(flags.endpoint, ("completions", "chat"), "--endpoint"),
                  api_key=flags.api_key, stream=flags.stream, ignore_eos=flags.ignore_eos, timeout_s=flags.timeout,
                  temperature=flags.temperature)


def _dataset(flags: BenchFlags) -> DatasetConfig:
    """The prompts: ``--dataset`` and its length flags."""
    from kvpilot.bench.datasets import DATASET_KINDS, DatasetConfig  # noqa: PLC0415

    return DatasetConfig(kind=_choice(flags.dataset, DATASET_KINDS, "--dataset"), input_len=flags.input_len,
                         output_len=flags.output_len,
                         len_dist=_choice(flags.len_dist, ("fixed", "uniform", "normal"), "--len-dist"),
                         range_ratio=flags.range_ratio, num_prefixes=flags.num_prefixes,
                         num_suffixes=flags.num_suffixes, prefix_len=flags.prefix_len,
                         long_fraction=flags.long_fraction, long_input_len=flags.long_input_len,
                         num_turns=flags.num_turns, path=flags.dataset_path, seed=flags.seed)


def _load(flags: BenchFlags) -> LoadShape:
    """The load: closed loop with ``--concurrency``, else open loop at ``--request-rate``."""
    from kvpilot.bench.load import LoadShape  # noqa: PLC0415

    unbounded = flags.num_requests is None and flags.duration is None
    return LoadShape(concurrency=flags.concurrency, request_rate=flags.request_rate,
                     arrival=_choice(flags.arrival, ("poisson", "constant"), "--arrival"),
                     burstiness=flags.burstiness, max_concurrency=flags.max_concurrency,
                     num_requests=DEFAULT_NUM_REQUESTS if unbounded else flags.num_requests,
                     duration_s=flags.duration, num_warmup=flags.warmup, seed=flags.seed)


def _plotlyjs_mode(flags: BenchFlags) -> str:
    """``--html-plotlyjs``, checked when there is a report to write (plotly is imported for --html only)."""
    if not flags.html:
        return flags.html_plotlyjs
    from kvpilot.bench.report_html import PLOTLYJS_MODES  # noqa: PLC0415

    return _choice(flags.html_plotlyjs, PLOTLYJS_MODES, "--html-plotlyjs")


def bench_config(flags: BenchFlags, report_sections: tuple[ReportSection, ...] = ()) -> BenchConfig:
    """The run ``flags`` ask for. Raises typer.BadParameter for a value outside a flag's choices, and bench's
    own errors (LoadShapeError, SloError) for other unusable values."""
    from kvpilot.bench.api import BenchConfig  # noqa: PLC0415
    from kvpilot.bench.stats import parse_slo  # noqa: PLC0415

    return BenchConfig(target=_target(flags), dataset=_dataset(flags), load=_load(flags), slos=parse_slo(flags.slo),
                       tokenizer=flags.tokenizer, sweep=flags.sweep, sweep_num_points=max(2, flags.sweep_points),
                       goodput_target=flags.goodput_target,
                       metrics_url=flags.metrics_url if flags.scrape_metrics else "",
                       scrape_interval_s=flags.scrape_interval, max_lag_ms=flags.max_client_lag_ms,
                       json_path=flags.output, csv_path=flags.csv, html_path=flags.html,
                       html_plotlyjs=_plotlyjs_mode(flags),
                       progress=flags.progress,
                       report_sections=report_sections, replica_urls=flags.replicas,
                       route_replicas=flags.route_replicas, client_processes=flags.client_processes)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that end the command with one line on stderr and exit 2, not a traceback: bad values, and a
    client process that failed (e.g. its tokenizer would not load there)."""
    from kvpilot.bench.api import BenchError  # noqa: PLC0415
    from kvpilot.bench.arrivals import LoadShapeError  # noqa: PLC0415
    from kvpilot.bench.client_processes import ClientProcessError  # noqa: PLC0415
    from kvpilot.bench.datasets import DatasetError  # noqa: PLC0415
    from kvpilot.bench.stats import SloError  # noqa: PLC0415
    from kvpilot.bench.tokens import TokenizerError  # noqa: PLC0415

    return BenchError, ClientProcessError, DatasetError, LoadShapeError, SloError, TokenizerError


def _run(flags: BenchFlags, report_sections: tuple[ReportSection, ...] = ()) -> None:
    """Run the bench ``flags`` ask for: results on stdout (`> file` keeps them), errors and hints on stderr.
    Raises typer.Exit(2) for a user error, typer.Exit(1) when every request failed."""
    from rich.console import Console  # noqa: PLC0415 (lazy: see UNAUTHORIZED_HINT's comment)

    from kvpilot.bench.api import run_bench  # noqa: PLC0415

    user_errors = _user_errors()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # httpx logs every request at INFO; a bench sends thousands
    errors = Console(stderr=True)
    try:
        outcome = run_bench(bench_config(flags, report_sections), Console())
    except user_errors as exc:
        errors.print(f"error: {exc}", style="bold red", markup=False)
        raise typer.Exit(2) from None
    _report_failures(outcome, errors)


def _report_failures(outcome: BenchOutcome, errors: Console) -> None:
    """Hint at the API key when the server answered 401; exit 1 when no request succeeded."""
    if any(rec.status == 401 for run in outcome.runs for rec in run.output.records):
        errors.print(UNAUTHORIZED_HINT, style="bold red", markup=False)
    if all(r.aggregates.num_ok == 0 for r in outcome.runs):
        errors.print("every request failed: see the errors above", style="bold red")
        raise typer.Exit(1)


def make_bench_command(report_sections: tuple[ReportSection, ...] = ()) -> Callable[..., None]:
    """The ``kvpilot bench`` command; its ``--html`` report also carries ``report_sections``, in order."""

    def bench_command(
        base_url: BaseUrlOpt = None,
        replica_url: ReplicaUrlOpt = None,
        endpoint: EndpointOpt = "completions",
        model: ModelOpt = None,
        api_key: ApiKeyOpt = None,
        stream: StreamOpt = True,
        ignore_eos: IgnoreEosOpt = False,
        timeout: TimeoutOpt = 300.0,
        temperature: TemperatureOpt = None,
        concurrency: ConcurrencyOpt = None,
        request_rate: RequestRateOpt = math.inf,
        arrival: ArrivalOpt = "poisson",
        burstiness: BurstinessOpt = 1.0,
        max_concurrency: MaxConcurrencyOpt = None,
        num_requests: NumRequestsOpt = None,
        duration: DurationOpt = None,
        warmup: WarmupOpt = 0,
        sweep: SweepOpt = False,
        sweep_points: SweepPointsOpt = 5,
        dataset: DatasetOpt = "random",
        dataset_path: DatasetPathOpt = None,
        input_len: InputLenOpt = 128,
        output_len: OutputLenOpt = 64,
        len_dist: LenDistOpt = "fixed",
        range_ratio: RangeRatioOpt = 0.0,
        num_prefixes: NumPrefixesOpt = 4,
        num_suffixes: NumSuffixesOpt = 8,
        prefix_len: PrefixLenOpt = 512,
        long_fraction: LongFractionOpt = 0.1,
        long_input_len: LongInputLenOpt = 4096,
        num_turns: NumTurnsOpt = 3,
        tokenizer: TokenizerOpt = None,
        seed: SeedOpt = 0,
        slo: SloOpt = None,
        goodput_target: GoodputTargetOpt = 0.9,
        metrics_url: MetricsUrlOpt = None,
        scrape_metrics: ScrapeMetricsOpt = True,
        scrape_interval: ScrapeIntervalOpt = 1.0,
        max_client_lag_ms: MaxClientLagOpt = 10.0,
        client_processes: ClientProcessesOpt = 1,
        output: OutputOpt = None,
        csv: CsvOpt = None,
        html: HtmlOpt = None,
        html_plotlyjs: HtmlPlotlyjsOpt = "directory",
        progress: ProgressOpt = True,
    ) -> None:
        """Load-test an OpenAI-compatible server and split latency into its stages."""
        flags = BenchFlags(
            base_url=base_url, replica_url=replica_url, endpoint=endpoint, model=model, api_key=api_key,
            stream=stream, ignore_eos=ignore_eos, timeout=timeout, temperature=temperature, concurrency=concurrency,
            request_rate=request_rate, arrival=arrival, burstiness=burstiness, max_concurrency=max_concurrency,
            num_requests=num_requests, duration=duration, warmup=warmup, sweep=sweep, sweep_points=sweep_points,
            dataset=dataset, dataset_path=dataset_path, input_len=input_len, output_len=output_len,
            len_dist=len_dist, range_ratio=range_ratio, num_prefixes=num_prefixes, num_suffixes=num_suffixes,
            prefix_len=prefix_len, long_fraction=long_fraction, long_input_len=long_input_len, num_turns=num_turns,
            tokenizer=tokenizer, seed=seed, slo=slo, goodput_target=goodput_target, metrics_url=metrics_url,
            scrape_metrics=scrape_metrics, scrape_interval=scrape_interval, max_client_lag_ms=max_client_lag_ms,
            client_processes=client_processes, output=output, csv=csv, html=html, html_plotlyjs=html_plotlyjs,
            progress=progress)
        _run(flags, report_sections)

    return bench_command


bench_command = make_bench_command()  # without extra report sections

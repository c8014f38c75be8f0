"""``kvpilot doctor``: the typer command (the lead registers it as ``app.command("doctor")``). The flags are
declared in doctor/cli_options.py.

Exit codes: 0 healthy, 1 findings above low severity, 2 unusable input (one line on stderr).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import typer

from kvpilot.doctor.cli_options import (ApiKeyOpt, FromOpt, GpuOpt, HtmlOpt, JsonOpt, MaxConcurrencyOpt,
                                        MetricsFileOpt, ModelNameOpt, ModelOpt, PhaseSecondsOpt, QuickOpt, RequestOpt,
                                        ServeOpt, ServeTimeoutOpt, SloOpt, TokenizerOpt, UrlOpt, VerifyBudgetOpt,
                                        VerifyOpt, WorkloadOpt)
from kvpilot.doctor.errors import DoctorInputError

if TYPE_CHECKING:
    from kvpilot.doctor.diagnose import DoctorReport
    from kvpilot.doctor.inputs import DoctorInputs
    from kvpilot.doctor.probe import ProbeSession
    from kvpilot.doctor.probe_plan import ProbeLimits
    from kvpilot.doctor.slo import Goal

# Imports of the doctor's machinery stay inside the functions (lazy: `kvpilot --help` stays fast).
EXIT_UNUSABLE = 2


@dataclass(frozen=True)
class DoctorFlags:
    """The values of ``kvpilot doctor``'s flags as typer parsed them, one field per flag (named like its
    parameter: ``from_`` is ``--from``, ``as_json`` is ``--json``)."""

    from_: list[str] | None
    metrics_file: list[str] | None
    url: str | None
    quick: bool
    max_concurrency: int | None
    phase_seconds: float | None
    api_key: str | None
    model_name: str | None
    tokenizer: str | None
    model: str | None
    gpu: str | None
    as_json: bool
    html: str | None
    serve: str | None
    verify: bool
    verify_budget: float
    serve_timeout: float
    slo: str | None
    workload: str | None
    request: str | None = None

    @property
    def has_files(self) -> bool:
        """Were saved measurements given (``--from`` or ``--metrics-file``)?"""
        return bool(self.from_ or self.metrics_file)

    @property
    def probe_only(self) -> bool:
        """Was a flag given that only a live probe uses?"""
        return bool(self.quick or self.model_name or self.tokenizer or self.max_concurrency is not None
                    or self.phase_seconds is not None)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"kvpilot doctor: error: {message}", err=True)
    return typer.Exit(EXIT_UNUSABLE)


def _limits(quick: bool, max_concurrency: int | None, phase_s: float | None = None) -> ProbeLimits:
    from dataclasses import replace  # noqa: PLC0415

    from kvpilot.doctor.probe_plan import FULL, QUICK  # noqa: PLC0415

    limits = QUICK if quick else FULL
    if phase_s is not None:
        if not 1.0 <= phase_s <= 600.0:
            raise DoctorInputError(f"--phase-seconds must be between 1 and 600, got {phase_s:g}")
        limits = replace(limits, phase_s=phase_s)
    if max_concurrency is None:
        return limits
    if max_concurrency < 1:
        raise DoctorInputError(f"--max-concurrency must be at least 1, got {max_concurrency}")
    return limits.capped(max_concurrency)


def _probe(flags: DoctorFlags, url: str, limits: ProbeLimits) -> ProbeSession:
    """Check the endpoint at ``url`` and run the live probes (progress lines on stderr)."""
    from rich.console import Console  # noqa: PLC0415

    from kvpilot.doctor.probe import check_endpoint, probe_endpoint  # noqa: PLC0415

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request (and /metrics scrape) at INFO
    if flags.has_files:
        raise DoctorInputError("--url probes the server live; --from and --metrics-file diagnose saved "
                               "measurements: use one or the other")
    endpoint = check_endpoint(url, flags.api_key, flags.model_name)
    # A new seed per session: prompts of an earlier probe may still sit in the server's prefix cache.
    return probe_endpoint(endpoint, limits, Console(stderr=True), flags.tokenizer,
                          seed=int(time.time()) % 100_000)


def _serve_mode(flags: DoctorFlags, limits: ProbeLimits, goal: Goal) -> NoReturn:
    """``--serve`` (and ``--verify``): start the server, probe, report; raises typer.Exit when done."""
    from rich.console import Console  # noqa: PLC0415

    from kvpilot.doctor.render_console import print_report  # noqa: PLC0415
    from kvpilot.doctor.serve import parse_command  # noqa: PLC0415
    from kvpilot.doctor.verify import print_verify, run_verify  # noqa: PLC0415

    if flags.serve is None:
        raise DoctorInputError('--verify needs --serve "kvpilot serve ..." (the doctor restarts the server '
                               "with each fix)")
    if flags.url or flags.has_files:
        raise DoctorInputError("--serve starts and probes its own server: leave out --url, --from and --metrics-file")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    err = Console(stderr=True)
    seed = int(time.time()) % 100_000
    result = run_verify(parse_command(flags.serve), limits, err, seed,
                        budget_s=flags.verify_budget if flags.verify else 0.0, serve_timeout_s=flags.serve_timeout,
                        model=flags.model, gpu=flags.gpu, goal=goal)
    report = result.report
    if flags.as_json:
        doc = report.to_json()
        doc["probe"] = result.session.to_json()
        doc["verify"] = result.to_json() if flags.verify else None
        typer.echo(json.dumps(doc, indent=1))
    else:
        print_report(Console(), report)
        if flags.verify:
            print_verify(Console(), result)
    raise typer.Exit(report.exit_code)


def _gather(flags: DoctorFlags) -> tuple[ProbeSession | None, DoctorInputs]:
    """What to diagnose, with the goal's SLOs applied: a live probe's measurements (and the probe), or the saved
    files'. ``--serve`` runs to the end here (typer.Exit). Raises DoctorInputError for unusable flags or input."""
    from kvpilot.doctor.inputs import load_inputs  # noqa: PLC0415
    from kvpilot.doctor.slo import resolve_goal  # noqa: PLC0415

    goal = resolve_goal(flags.workload, flags.slo)
    limits = _limits(flags.quick, flags.max_concurrency, flags.phase_seconds)
    if flags.serve is not None or flags.verify:
        _serve_mode(flags, limits, goal)
    if flags.url is not None:
        probe = _probe(flags, flags.url, limits)
        return probe, goal.apply(probe.inputs(flags.model, flags.gpu))
    if flags.probe_only:
        raise DoctorInputError("--quick, --max-concurrency, --phase-seconds, --model-name and --tokenizer "
                               "go with --url")
    return None, goal.apply(load_inputs(flags.from_ or [], flags.metrics_file or [], flags.model, flags.gpu))


def _print(report: DoctorReport, probe: ProbeSession | None, as_json: bool) -> None:
    """The report on stdout, as JSON or for the console; the probe's notes after it (on stderr with JSON)."""
    from rich.console import Console  # noqa: PLC0415

    from kvpilot.doctor.render_console import print_report  # noqa: PLC0415

    if as_json:
        doc = report.to_json()
        doc["probe"] = probe.to_json() if probe is not None else None
        typer.echo(json.dumps(doc, indent=1))
    else:
        if probe is not None:
            Console().print(f"findings from live probes of {probe.endpoint.base_url} "
                            f"({len(probe.phases)} phases, {sum(p.num_sent for p in probe.phases)} requests, "
                            f"{probe.wall_s:.0f} s)", markup=False)
        print_report(Console(), report)
    for note in probe.notes if probe is not None else ():
        Console(stderr=as_json).print(f"note: {note}", style="yellow", markup=False)


def _write_html(path: str, report: DoctorReport) -> None:
    """``--html``: the report as an HTML fragment; exit 2 when the file cannot be written."""
    from kvpilot.doctor.render_html import doctor_html_section  # noqa: PLC0415

    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(doctor_html_section(report))
    except OSError as exc:
        raise _fail(f"cannot write --html '{path}': {exc}") from None


def _explain_request(flags: DoctorFlags) -> NoReturn:
    """``--request ID``: the server's timeline of one request and the requests around it, explained; exit 0."""
    from kvpilot.doctor.request_explain import explain, fetch_timelines  # noqa: PLC0415

    if flags.url is None or flags.has_files or flags.serve is not None:
        raise _fail("--request explains a request a live kvpilot server served: give --url (and not --from, "
                    "--metrics-file or --serve)")
    headers = {"Authorization": f"Bearer {flags.api_key}"} if flags.api_key else {}
    try:
        answer = explain(fetch_timelines(flags.url, flags.request or "", headers))
    except DoctorInputError as exc:
        raise _fail(str(exc)) from None
    if flags.as_json:
        typer.echo(json.dumps(answer.to_json(), indent=1))
    else:
        for line in answer.lines:
            typer.echo(line)
    raise typer.Exit(0)


def _run(flags: DoctorFlags) -> NoReturn:
    """Diagnose what ``flags`` name, print the report, exit with its code (2: unusable input)."""
    from kvpilot.doctor.diagnose import diagnose  # noqa: PLC0415

    if flags.request is not None:
        _explain_request(flags)
    try:
        probe, inputs = _gather(flags)
    except DoctorInputError as exc:
        raise _fail(str(exc)) from None
    report = diagnose(inputs)
    _print(report, probe, flags.as_json)
    if flags.html:
        _write_html(flags.html, report)
    raise typer.Exit(report.exit_code)


def doctor_command(
    from_: FromOpt = None,
    metrics_file: MetricsFileOpt = None,
    url: UrlOpt = None,
    quick: QuickOpt = False,
    max_concurrency: MaxConcurrencyOpt = None,
    phase_seconds: PhaseSecondsOpt = None,
    api_key: ApiKeyOpt = None,
    model_name: ModelNameOpt = None,
    tokenizer: TokenizerOpt = None,
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    as_json: JsonOpt = False,
    html: HtmlOpt = None,
    serve: ServeOpt = None,
    verify: VerifyOpt = False,
    verify_budget: VerifyBudgetOpt = 900.0,
    serve_timeout: ServeTimeoutOpt = 300.0,
    slo: SloOpt = None,
    workload: WorkloadOpt = None,
    request: RequestOpt = None,
) -> None:
    """Name the bottleneck of a slow deployment, with the evidence, a confidence and the fix."""
    _run(DoctorFlags(
        from_=from_, metrics_file=metrics_file, url=url, quick=quick, max_concurrency=max_concurrency,
        phase_seconds=phase_seconds, api_key=api_key, model_name=model_name, tokenizer=tokenizer, model=model,
        gpu=gpu, as_json=as_json, html=html, serve=serve, verify=verify, verify_budget=verify_budget,
        serve_timeout=serve_timeout, slo=slo, workload=workload, request=request))

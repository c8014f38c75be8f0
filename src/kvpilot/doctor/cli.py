"""``kvpilot doctor``: the typer command (the lead registers it as ``app.command("doctor")``).

Exit codes: 0 healthy, 1 findings above low severity, 2 unusable input (one line on stderr).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Annotated

import typer

from kvpilot.doctor.errors import DoctorInputError

if TYPE_CHECKING:
    from kvpilot.doctor.probe import ProbeSession
    from kvpilot.doctor.probe_plan import ProbeLimits
    from kvpilot.doctor.slo import Goal

EXIT_UNUSABLE = 2


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


def _probe(url: str, limits: ProbeLimits, api_key: str | None, model_name: str | None, tokenizer: str | None,
           has_files: bool) -> ProbeSession:
    """Check the endpoint and run the live probes (progress lines on stderr)."""
    from rich.console import Console  # noqa: PLC0415

    from kvpilot.doctor.probe import check_endpoint, probe_endpoint  # noqa: PLC0415

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request (and /metrics scrape) at INFO
    if has_files:
        raise DoctorInputError("--url probes the server live; --from and --metrics-file diagnose saved "
                               "measurements: use one or the other")
    endpoint = check_endpoint(url, api_key, model_name)
    # A new seed per session: prompts of an earlier probe may still sit in the server's prefix cache.
    return probe_endpoint(endpoint, limits, Console(stderr=True), tokenizer,
                          seed=int(time.time()) % 100_000)


def _serve_mode(serve: str | None, verify: bool, limits: ProbeLimits, other_inputs: bool, model: str | None,
                gpu: str | None, as_json: bool, budget_s: float, serve_timeout_s: float, goal: Goal) -> None:
    """``--serve`` (and ``--verify``): start the server, probe, report; raises typer.Exit when done."""
    from rich.console import Console  # noqa: PLC0415

    from kvpilot.doctor.render_console import print_report  # noqa: PLC0415
    from kvpilot.doctor.serve import parse_command  # noqa: PLC0415
    from kvpilot.doctor.verify import print_verify, run_verify  # noqa: PLC0415

    if serve is None:
        raise DoctorInputError('--verify needs --serve "kvpilot serve ..." (the doctor restarts the server '
                               "with each fix)")
    if other_inputs:
        raise DoctorInputError("--serve starts and probes its own server: leave out --url, --from and --metrics-file")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    err = Console(stderr=True)
    seed = int(time.time()) % 100_000
    result = run_verify(parse_command(serve), limits, err, seed,
                        budget_s if verify else 0.0, serve_timeout_s, model, gpu, goal)
    report = result.report
    if as_json:
        doc = report.to_json()
        doc["probe"] = result.session.to_json()
        doc["verify"] = result.to_json() if verify else None
        typer.echo(json.dumps(doc, indent=1))
    else:
        print_report(Console(), report)
        if verify:
            print_verify(Console(), result)
    raise typer.Exit(report.exit_code)


def doctor_command(
    from_: Annotated[
        list[str] | None,
        typer.Option("--from", help="Saved `kvpilot bench --output` result JSON (repeatable: several runs or "
                     "a sweep are compared by load)."),
    ] = None,
    metrics_file: Annotated[
        list[str] | None,
        typer.Option("--metrics-file", help="Prometheus /metrics text of the server (kvpilot or vLLM names, old "
                     "or new). Repeat it to give a scrape before and after the load: counters are diffed."),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option("--url", help="Live server to probe (base URL, e.g. http://127.0.0.1:8000): the doctor runs "
                     "its own short bench workloads (a single-request baseline, short vs long prompts, shared vs "
                     "unique prefixes, a concurrency ramp doubling from 1 to at most 64 in flight until throughput stops "
                     "rising: the saturation knee; 3-5 minutes) and "
                     "scrapes /metrics before and after. Not with --from/--metrics-file."),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="With --url: a smaller probe, under a minute (ramp "
                                        "to 8 in flight, no unique-prefix control).")] = False,
    max_concurrency: Annotated[
        int | None,
        typer.Option("--max-concurrency", help="With --url/--serve: never more requests in flight than this "
                     "(the full probe doubles concurrency from 1 up to 64 until throughput stops rising: "
                     "the saturation knee)."),
    ] = None,
    phase_seconds: Annotated[
        float | None,
        typer.Option("--phase-seconds", help="With --url/--serve: how long each probe phase sends requests "
                     "(default 24 s, 8 s with --quick); shorter probes finish sooner and measure more noise."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar=["OPENAI_API_KEY", "KVPILOT_API_KEY"],
                     help="With --url: bearer token for the server (also OPENAI_API_KEY, then KVPILOT_API_KEY)."),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option("--model-name", help="With --url: the served model to probe (default: the first of "
                     "/v1/models)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option("--tokenizer", help="With --url: tokenizer for token-exact prompt lengths (HF name/dir, "
                     ".gguf, 'embedded'); default: approximate word counts (the server reports exact ones)."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("--model", help="Model for the roofline (catalog name, config.json or GGUF; see "
                     "`kvpilot fit --list`), to say how far measured speed is from the hardware limit. Default with "
                     "--gpu: the embedded smollm2-135m."),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", help="Hardware for the roofline, NAME[:count] as in `kvpilot fit` (e.g. "
                     "h100-sxm, l4:2, cpu). Default with --model: cpu."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    html: Annotated[
        str | None, typer.Option("--html", help="Write the report as an HTML fragment (for embedding) here.")
    ] = None,
    serve: Annotated[
        str | None,
        typer.Option("--serve", help='Start this server command (e.g. "kvpilot serve --max-num-seqs 8", or '
                     '"vllm serve MODEL ..."; a free --port is added unless given), probe it like --url, stop it.'),
    ] = None,
    verify: Annotated[bool, typer.Option("--verify", help="With --serve: restart with the top finding's fix, "
                                         "probe the same workload again, print before/after for that finding's "
                                         "metric; a fix that does not help is withdrawn and the next tried.")] = False,
    verify_budget: Annotated[float, typer.Option("--verify-budget", help="With --verify: seconds for all "
                                                 "rounds (no new round starts that would overrun it).")] = 900.0,
    serve_timeout: Annotated[float, typer.Option("--serve-timeout", help="With --serve: seconds to wait for "
                                                 "the server to answer /v1/models.")] = 300.0,
    slo: Annotated[
        str | None,
        typer.Option("--slo", help="Latency targets the findings are judged against, as in `kvpilot bench` "
                     "(e.g. ttft=500ms,tpot=50ms,itl=100ms,e2e=5s; 90% of requests must meet them). Without "
                     "one, latency trade-offs (TPOT rising with the batch) are notes, not findings."),
    ] = None,
    workload: Annotated[
        str | None,
        typer.Option("--workload", help="What the deployment is for: chat (ttft=1s,tpot=100ms), agent "
                     "(ttft=2s,tpot=50ms) or batch (throughput only). Sets those SLOs (--slo overrides) and "
                     "recommends flags for the goal; with --verify they are measured."),
    ] = None,
) -> None:
    """Name the bottleneck of a slow deployment, with the evidence, a confidence and the fix."""
    from rich.console import Console  # noqa: PLC0415 (lazy: `kvpilot --help` stays fast)

    from kvpilot.doctor.diagnose import diagnose  # noqa: PLC0415
    from kvpilot.doctor.inputs import load_inputs  # noqa: PLC0415
    from kvpilot.doctor.render_console import print_report  # noqa: PLC0415
    from kvpilot.doctor.render_html import doctor_html_section  # noqa: PLC0415
    from kvpilot.doctor.slo import resolve_goal  # noqa: PLC0415

    probe = None
    try:
        goal = resolve_goal(workload, slo)
        limits = _limits(quick, max_concurrency, phase_seconds)
        if serve is not None or verify:
            _serve_mode(serve, verify, limits, bool(url or from_ or metrics_file), model, gpu, as_json,
                        verify_budget, serve_timeout, goal)
        if url is not None:
            probe = _probe(url, limits, api_key, model_name, tokenizer, bool(from_ or metrics_file))
            inputs = probe.inputs(model, gpu)
        else:
            if quick or model_name or tokenizer or max_concurrency is not None or phase_seconds is not None:
                raise DoctorInputError("--quick, --max-concurrency, --phase-seconds, --model-name and --tokenizer "
                                       "go with --url")
            inputs = load_inputs(from_ or [], metrics_file or [], model, gpu)
    except DoctorInputError as exc:
        raise _fail(str(exc)) from None
    report = diagnose(goal.apply(inputs))
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
    if html:
        try:
            with open(html, "w", encoding="utf-8") as fh:
                fh.write(doctor_html_section(report))
        except OSError as exc:
            raise _fail(f"cannot write --html '{html}': {exc}") from None
    raise typer.Exit(report.exit_code)

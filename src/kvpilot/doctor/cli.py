"""``kvpilot doctor``: the typer command (the lead registers it as ``app.command("doctor")``).

Exit codes: 0 healthy, 1 findings above low severity, 2 unusable input (one line on stderr).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

EXIT_UNUSABLE = 2


def _fail(message: str) -> typer.Exit:
    typer.echo(f"kvpilot doctor: error: {message}", err=True)
    return typer.Exit(EXIT_UNUSABLE)


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
        typer.Option("--url", help="Live server to probe with short workloads (not available yet: use "
                     "`kvpilot bench --output` and --from)."),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="With --url: probe for under a minute.")] = False,
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
) -> None:
    """Name the bottleneck of a slow deployment, with the evidence, a confidence and the fix."""
    from rich.console import Console  # noqa: PLC0415 (lazy: `kvpilot --help` stays fast)

    from kvpilot.doctor.diagnose import diagnose  # noqa: PLC0415
    from kvpilot.doctor.errors import DoctorInputError  # noqa: PLC0415
    from kvpilot.doctor.inputs import load_inputs  # noqa: PLC0415
    from kvpilot.doctor.render_console import print_report  # noqa: PLC0415
    from kvpilot.doctor.render_html import doctor_html_section  # noqa: PLC0415

    if url is not None:
        # TODO(issue 7, live probing): run the probe workloads here with kvpilot.bench.api.run_bench
        # (single-request baseline, short vs long prompts, shared vs unique prefixes, a concurrency
        # ramp; bounded to a few minutes, --quick under one), scrape <url>/metrics before and after,
        # then feed the outcomes' `result` documents to runs_from_result() and diagnose them.
        raise _fail("live probing (--url) needs the kvpilot server probes, not built yet: run "
                    "`kvpilot bench --base-url URL --output result.json` and pass --from result.json")
    del quick  # used by the live probes (TODO above)
    try:
        inputs = load_inputs(from_ or [], metrics_file or [], model, gpu)
    except DoctorInputError as exc:
        raise _fail(str(exc)) from None
    report = diagnose(inputs)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=1))
    else:
        print_report(Console(), report)
    if html:
        try:
            with open(html, "w", encoding="utf-8") as fh:
                fh.write(doctor_html_section(report))
        except OSError as exc:
            raise _fail(f"cannot write --html '{html}': {exc}") from None
    raise typer.Exit(report.exit_code)

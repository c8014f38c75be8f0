"""The doctor's report on a rich console: verdict, latency split, ranked findings, headroom."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from kvpilot.doctor.diagnose import DoctorReport
from kvpilot.doctor.engines import ENGINES, KVPILOT, VLLM, display
from kvpilot.doctor.findings import Finding, Fix, Severity
from kvpilot.doctor.split import LatencySplit

SEVERITY_STYLE = {Severity.HIGH: "bold red", Severity.MEDIUM: "yellow", Severity.LOW: "cyan"}
SPLIT_COLUMNS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"), ("network_ms", "network"),
                 ("queue_ms", "queue"), ("tokenize_ms", "tokenize"), ("prefill_ms", "prefill"),
                 ("decode_ms", "decode"))


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def split_table(splits: tuple[LatencySplit, ...]) -> Table:
    table = Table(title="Latency split (median ms)", title_justify="left")
    table.add_column("run")
    table.add_column("in flight", justify="right")
    for _, name in SPLIT_COLUMNS:
        table.add_column(name, justify="right")
    table.add_column("source")
    for s in splits:
        table.add_row(s.label, fmt_ms(s.in_flight), *(fmt_ms(getattr(s, key)) for key, _ in SPLIT_COLUMNS), s.source)
    return table


def fix_flags(fix: Fix, engine: str | None) -> list[tuple[str, str]]:
    """(engine label, flags) lines of a fix: the running engine's first (marked), then kvpilot's; vLLM's too
    unless another engine runs (its flags were translated from vLLM's). Engines without such a flag are left out."""
    own = {KVPILOT: fix.kvpilot, VLLM: fix.vllm}
    running = fix.engine_flags if engine not in own else own.get(engine or "", "")
    lines = [(f"{display(engine)} (running)", running)] if engine in ENGINES and running else []
    lines += [(display(name), text) for name, text in own.items()
              if text and name != engine and (name == KVPILOT or engine in (None, KVPILOT))]
    return lines


def finding_panel(index: int, f: Finding, engine: str | None = None) -> Panel:
    lines = [f.summary, f"Share of latency: {f.share_text}", ""]
    lines += [f"  - {e.text()}" for e in f.evidence]
    if f.fixes:
        lines.append("")
        lines.append("Fixes:")
    for fix in f.fixes:
        lines.append(f"  * {fix.action}")
        lines += [f"      {label}: {text}" for label, text in fix_flags(fix, engine)]
    style = SEVERITY_STYLE[f.severity]
    title = f"{index}. [{style}]{f.severity.value.upper()}[/] {f.title}  ({f.rule_id}, confidence {f.confidence:.0%})"
    return Panel("\n".join(lines), title=title, title_align="left", border_style=style, expand=True)


def print_report(console: Console, report: DoctorReport) -> None:
    """Verdict first, so the one line that matters is at the top."""
    style = "bold green" if report.healthy else SEVERITY_STYLE[report.findings[0].severity]
    console.print(f"kvpilot doctor: {report.verdict}", style=style, markup=False)
    if report.splits:
        console.print(split_table(report.splits))
    for i, f in enumerate(report.findings, 1):
        console.print(finding_panel(i, f, report.engine))
    if report.healthy and report.headroom:
        console.print("Headroom:", style="bold")
    elif report.headroom:
        console.print("Measured:", style="bold")
    for line in report.headroom:
        console.print(f"  {line}", markup=False)
    engine = f"; engine: {display(report.engine)}" if report.engine else ""
    console.print(f"inputs: {', '.join(report.sources) or '-'}; server metrics: {report.metrics_source}{engine}",
                  style="dim", markup=False)

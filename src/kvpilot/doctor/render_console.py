"""The doctor's report on a rich console: verdict, latency split, ranked findings, headroom; whole at any console
width (the split table as a list when it cannot be drawn uncut, findings' titles inside their panels)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvpilot.bench.table_layout import print_table
from kvpilot.doctor.diagnose import DoctorReport
from kvpilot.doctor.engines import ENGINES, KVPILOT, VLLM, display
from kvpilot.doctor.findings import Finding, Fix, Severity
from kvpilot.doctor.split import LatencySplit

SEVERITY_STYLE = {Severity.HIGH: "bold red", Severity.MEDIUM: "yellow", Severity.LOW: "cyan"}
# A frame title needs the corner, a space each side of it and the far corner: rich cuts a longer one.
_FRAME_TITLE_MARGIN = 6
SPLIT_COLUMNS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"), ("network_ms", "network"),
                 ("queue_ms", "queue"), ("tokenize_ms", "tokenize"), ("prefill_ms", "prefill"),
                 ("decode_ms", "decode"))


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{round(v, 1) + 0.0:,.1f}"  # + 0.0: never "-0.0"


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


def finding_panel(index: int, f: Finding, engine: str | None = None, width: int | None = None) -> Panel:
    """The finding in a frame of its severity's colour. Its title goes on the frame when it fits `width` (rich
    would cut it there), else on the panel's first line, where it wraps."""
    style = SEVERITY_STYLE[f.severity]
    heading = f"{f.title}  ({f.rule_id}, confidence {f.confidence:.0%})"
    badge = f"{index}. [{style}]{f.severity.value.upper()}[/]"
    on_frame = width is None or len(f"{index}. {f.severity.value} {heading}") + _FRAME_TITLE_MARGIN <= width
    lines = [f.summary, f"Share of latency: {f.share_text}", ""]
    lines += [f"  - {e.text()}" for e in f.evidence]
    if f.fixes:
        lines.append("")
        lines.append("Fixes:")
    for fix in f.fixes:
        lines.append(f"  * {fix.action}")
        lines += [f"      {label}: {text}" for label, text in fix_flags(fix, engine)]
    body = Text("\n".join(lines))  # plain text: a run label or flag in brackets is not markup
    if not on_frame:
        body = Text.assemble((heading, "bold"), "\n", body)
    title = f"{badge} {escape(heading)}" if on_frame else badge
    return Panel(body, title=title, title_align="left", border_style=style, expand=True)


def print_report(console: Console, report: DoctorReport) -> None:
    """Verdict first, so the one line that matters is at the top."""
    style = "bold green" if report.healthy else SEVERITY_STYLE[report.findings[0].severity]
    console.print(f"kvpilot doctor: {report.verdict}", style=style, markup=False)
    if report.splits:
        print_table(console, split_table(report.splits))
    for i, f in enumerate(report.findings, 1):
        console.print(finding_panel(i, f, report.engine, console.width))
    if report.healthy and report.headroom:
        console.print("Headroom:", style="bold")
    elif report.headroom:
        console.print("Measured:", style="bold")
    for line in report.headroom:
        console.print(f"  {line}", markup=False)
    engine = f"; engine: {display(report.engine)}" if report.engine else ""
    console.print(f"inputs: {', '.join(report.sources) or '-'}; server metrics: {report.metrics_source}{engine}",
                  style="dim", markup=False)

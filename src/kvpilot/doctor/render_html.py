"""The doctor's report as a self-contained HTML fragment for the bench HTML report.

``doctor_html_section(report)`` returns one ``<section>`` (inline styles, no scripts, no external
resources); every value is escaped, since rule summaries quote user-controlled labels.
"""

from __future__ import annotations

from html import escape

from kvpilot.doctor.diagnose import DoctorReport
from kvpilot.doctor.findings import Finding, Fix, Severity
from kvpilot.doctor.request_explain import Explanation
from kvpilot.doctor.render_console import SPLIT_COLUMNS, fix_flags, fmt_ms

COLORS = {Severity.HIGH: "#c62828", Severity.MEDIUM: "#ef6c00", Severity.LOW: "#0277bd"}


def _fix_row(fix: Fix, engine: str | None) -> str:
    flags = "<br>".join(f"{escape(label)}: <code>{escape(text)}</code>" for label, text in fix_flags(fix, engine))
    return f"<tr><td>{escape(fix.action)}</td><td>{flags}</td></tr>"


def _finding(i: int, f: Finding, engine: str | None = None) -> str:
    color = COLORS[f.severity]
    evidence = "".join(f"<li>{escape(e.text())}</li>" for e in f.evidence)
    fixes = "".join(_fix_row(x, engine) for x in f.fixes)
    return (f'<div class="kvp-finding" data-rule="{escape(f.rule_id)}" style="border-left:4px solid {color};'
            f'padding:4px 12px;margin:12px 0">'
            f'<h3 style="margin:4px 0">{i}. <span style="color:{color}">{f.severity.value.upper()}</span> '
            f'{escape(f.title)} <small>({escape(f.rule_id)}, confidence {f.confidence:.0%})</small></h3>'
            f"<p>{escape(f.summary)}</p><p><b>Share of latency:</b> {escape(f.share_text)}</p><ul>{evidence}</ul>"
            + (f'<table style="border-collapse:collapse"><tr><th align="left">fix</th><th align="left">flags'
               f'</th></tr>{fixes}</table>' if fixes else "")
            + "</div>")


def _splits(report: DoctorReport) -> str:
    head = "".join(f"<th>{escape(name)}</th>" for _, name in SPLIT_COLUMNS)
    rows = "".join(
        f"<tr><td>{escape(s.label)}</td><td>{fmt_ms(s.in_flight)}</td>"
        + "".join(f"<td>{fmt_ms(getattr(s, key))}</td>" for key, _ in SPLIT_COLUMNS)
        + f"<td>{escape(s.source)}</td></tr>" for s in report.splits)
    return (f"<table><tr><th>run</th><th>in flight</th>{head}<th>source</th></tr>{rows}</table>"
            if report.splits else "")


def doctor_html_section(report: DoctorReport) -> str:
    """An HTML ``<section id="kvpilot-doctor">`` with the verdict, latency split, findings, headroom."""
    color = "#2e7d32" if report.healthy else COLORS[report.findings[0].severity]
    findings = "".join(_finding(i, f, report.engine) for i, f in enumerate(report.findings, 1))
    headroom = "".join(f"<li>{escape(line)}</li>" for line in report.headroom)
    return (f'<section id="kvpilot-doctor"><h2>Doctor</h2>'
            f'<p style="font-weight:bold;color:{color}">{escape(report.verdict)}</p>'
            f"<h3>Latency split (median ms)</h3>{_splits(report)}{findings}"
            + (f"<h3>{'Headroom' if report.healthy else 'Measured'}</h3><ul>{headroom}</ul>" if headroom else "")
            + f"<p><small>inputs: {escape(', '.join(report.sources) or '-')}; server metrics: "
            f"{escape(report.metrics_source)}</small></p></section>")


def slowest_html(explained: list[Explanation], notes: list[str]) -> str:
    """The slowest requests, each with the server's explanation (request_explain), and why others have none."""
    items = "".join("<li>" + "<br>".join(escape(line) for line in e.lines) + "</li>" for e in explained)
    missing = "".join(f"<li><small>{escape(note)}</small></li>" for note in notes)
    return (f'<section id="kvpilot-slowest"><h3>The slowest requests, explained</h3><ol>{items}</ol>'
            + (f"<ul>{missing}</ul>" if missing else "") + "</section>")

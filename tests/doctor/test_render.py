"""Renderers and contracts: HTML section (escaped, self-contained), JSON round trip, thresholds (ranking:
test_attribution.py)."""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from kvpilot.doctor import thresholds
from kvpilot.doctor.diagnose import diagnose
from kvpilot.doctor.findings import Evidence, Finding, Fix, Severity
from kvpilot.doctor.inputs import DoctorInputs, load_inputs
from kvpilot.doctor.prometheus import parse_prometheus_text
from kvpilot.doctor.render_console import SPLIT_COLUMNS, fmt_ms, print_report
from kvpilot.doctor.render_html import doctor_html_section
from tests.doctor.scenarios import SCENARIOS, healthy


def _finding(rule: str, severity: Severity, confidence: float, impact: float = 0.5) -> Finding:
    return Finding(rule, rule.title(), severity, confidence, impact, "s", (Evidence("x", 1.0),), (Fix("a", "b", "c"),))


def test_finding_rejects_confidence_out_of_range() -> None:
    with pytest.raises(ValueError, match="confidence"):
        _finding("a", Severity.LOW, 1.5)


def test_html_section_is_escaped_and_self_contained() -> None:
    snap = parse_prometheus_text((Path(__file__).parent / "fixtures" / "vllm_v1_pressure.txt").read_text())
    report = diagnose(DoctorInputs(metrics=snap))
    html = doctor_html_section(report)
    assert html.startswith('<section id="kvpilot-doctor">') and html.endswith("</section>")
    assert 'data-rule="kv-cache-pressure"' in html and "--kv-cache-dtype fp8" in html
    assert not re.search(r"<script|src=|href=", html)
    tricky = _finding("x<script>", Severity.HIGH, 0.9)
    html = doctor_html_section(type(report)((tricky,), (), (), (), "none", None, 0.0))
    assert "<script>" not in html and "x&lt;script&gt;" in html


def test_healthy_html_shows_headroom(tmp_path: Path) -> None:
    report = diagnose(load_inputs(healthy(tmp_path)[0]))
    html = doctor_html_section(report)
    assert "healthy" in html and "<h3>Headroom</h3>" in html


def test_json_report_is_strict_json(tmp_path: Path) -> None:
    report = diagnose(load_inputs(*SCENARIOS["decode-bound"](tmp_path)))
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["findings"][0]["rule_id"] == "decode-bound"
    assert doc["roofline"]["model"] == "llama-3.1-8b" and doc["roofline"]["decode_step_ms"] > 0


def test_every_threshold_documents_its_rationale() -> None:
    """The one place for thresholds: each field is followed by a docstring explaining it."""
    tree = ast.parse(Path(thresholds.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Thresholds")
    body = cls.body
    fields = [(i, n.target.id) for i, n in enumerate(body)
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    assert len(fields) >= 20
    for i, name in fields:
        doc = body[i + 1] if i + 1 < len(body) else None
        text = doc.value.value if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else None
        assert isinstance(text, str) and len(text) > 30, name


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {name: diagnose(load_inputs(*make(tmp_path_factory.mktemp(name)))) for name, make in SCENARIOS.items()}


@pytest.mark.parametrize("width", [80, 60])
def test_console_report_cuts_nothing_on_narrow_consoles(reports: dict, width: int) -> None:  # type: ignore[type-arg]
    """At 80 and 60 columns (a small terminal, a pipe) the latency split becomes a list rather than a table cut
    to `con…`, and a finding's title moves into its panel rather than being cropped on the frame."""
    for name, report in reports.items():
        console = Console(width=width, file=io.StringIO(), record=True)
        print_report(console, report)
        text = console.export_text()
        assert "…" not in text, (name, text)
        words = set(re.split(r"[\s│┃]+", text))
        for s in report.splits:
            cells = [fmt_ms(s.in_flight), *(fmt_ms(getattr(s, key)) for key, _ in SPLIT_COLUMNS), s.label]
            assert {w for cell in cells for w in cell.split()} <= words, (name, text)  # every number whole
        for f in report.findings:
            assert {f"({f.rule_id},", f"{f.confidence:.0%})"} <= words, (name, text)  # the title is not cropped

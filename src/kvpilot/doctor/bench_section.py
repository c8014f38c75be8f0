"""The doctor's section of the ``kvpilot bench --html`` report.

:func:`doctor_report_section` is a ``kvpilot.bench.api.ReportSection``: kvpilot.cli hands it to
``make_bench_command``, and API users put it in ``BenchConfig.report_sections``. The dependency runs one
way, doctor -> bench: bench only knows the callable's shape.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console


def doctor_report_section(result: dict[str, Any], console: Console) -> str:
    """The doctor's diagnosis of one bench result document as an HTML ``<section>``; '' (with a note on the
    console) when the result cannot be diagnosed."""
    # Imported on call: `kvpilot --help` registers this function and must not pay for numpy and httpx.
    from kvpilot.doctor.diagnose import diagnose  # noqa: PLC0415
    from kvpilot.doctor.errors import DoctorInputError  # noqa: PLC0415
    from kvpilot.doctor.inputs import inputs_from_documents  # noqa: PLC0415
    from kvpilot.doctor.render_html import doctor_html_section  # noqa: PLC0415

    try:
        section = doctor_html_section(diagnose(inputs_from_documents([(result, "this run")])))
    except DoctorInputError as exc:
        console.print(f"[yellow]doctor section left out of the report: {exc}[/yellow]")
        return ""
    return section + _slowest_section(result)


def _slowest_section(result: dict[str, Any]) -> str:
    """The run's slowest requests explained by the server (kvpilot's ring of request timelines); '' for a run
    whose server sent no per-request timings. The result keeps no API key: the environment's is used."""
    from kvpilot.fit.server_capacity import API_KEY_ENV  # noqa: PLC0415
    from kvpilot.doctor.render_html import slowest_html  # noqa: PLC0415
    from kvpilot.doctor.request_explain import explain_slowest  # noqa: PLC0415

    key = next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)
    explained, notes = explain_slowest(result, {"Authorization": f"Bearer {key}"} if key else {})
    return slowest_html(explained, notes) if explained or notes else ""

"""``--html report.html``: the report's page, which needs no network.

Plots: latency CDFs; per-request stacked stage breakdown; KV usage and queue depth over time; and
for sweeps, TTFT/TPOT vs load with the knee marked and throughput vs concurrency.

plotly.js (~4.7 MB, most of a report inlined) is by default one shared file beside the reports
(``plotly-<version>.min.js``, written once per directory), so a report is tens of kB; ``inline`` makes one
self-contained file, ``cdn`` loads it from plotly's CDN (needs the network). A page whose plotly.js is missing
says so at the top. Count axes (requests) tick on whole numbers only.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs, get_plotlyjs_version
from plotly.subplots import make_subplots

from kvpilot.bench.breakdown import STAGES, stage_breakdown
from kvpilot.bench.result import Knee, RunResult

MAX_STACKED_REQUESTS = 300
PLOTLYJS_MODES = ("directory", "inline", "cdn")  # as plotly's include_plotlyjs names them (True: inline)
MAX_COUNT_TICKS = 8
_CONFIG = {"displaylogo": False, "responsive": True}
_MISSING_PLOTLYJS = ("<script>if(!window.Plotly){{var p=document.createElement('p');p.id='kvpilot-plotly-missing';"
                     "p.style.color='#c62828';p.textContent={message};document.body.prepend(p)}}</script>")


def count_axis(max_count: float) -> dict[str, Any]:
    """Axis settings for a count (requests): ticks from 0 on whole numbers, 1, 2 or 5 times a power of ten
    apart, at most MAX_COUNT_TICKS of them (plotly's own ticks would split 0-3 requests into 0.5s)."""
    wanted = max(1.0, max_count / MAX_COUNT_TICKS) if math.isfinite(max_count) else 1.0
    power = 10 ** math.floor(math.log10(wanted))
    step = next(base * power for base in (1, 2, 5, 10) if base * power >= wanted)
    return {"tick0": 0, "dtick": step, "tickformat": "d", "rangemode": "tozero"}


def _cdf(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    xs = np.sort(np.asarray(values, dtype=float))
    return xs, np.arange(1, xs.size + 1) / max(1, xs.size)


def latency_cdfs(runs: list[RunResult]) -> go.Figure:
    fig = make_subplots(rows=2, cols=2, subplot_titles=("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2E (ms)"))
    for run in runs:
        ok = [r for r in run.output.records if r.ok]
        series = [[r.ttft_ms for r in ok if r.ttft_ms is not None],
                  [r.tpot_ms for r in ok if r.tpot_ms is not None],
                  [g for r in ok for g in r.itl_ms], [r.e2e_ms for r in ok if r.e2e_ms is not None]]
        for k, values in enumerate(series):
            xs, ys = _cdf(values)
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=run.label, legendgroup=run.label,
                                     showlegend=k == 0), row=k // 2 + 1, col=k % 2 + 1)
    fig.update_layout(title="Latency CDFs", height=600)
    return fig


def stage_stack(run: RunResult) -> go.Figure | None:
    rows = [(r.request_index, s) for r in run.output.records if r.ok
            for s in [stage_breakdown(r)] if s is not None][:MAX_STACKED_REQUESTS]
    if not rows:
        return None
    fig = go.Figure([go.Bar(x=[i for i, _ in rows], y=[s[stage] for _, s in rows], name=stage)
                     for stage in STAGES])
    fig.update_layout(barmode="relative", title=f"Per-request latency by stage: {run.label}",
                      xaxis_title="request index", yaxis_title="ms")
    fig.update_xaxes(**count_axis(max(i for i, _ in rows)))
    return fig


def server_timeline(run: RunResult) -> go.Figure | None:
    samples = run.output.metrics
    if not samples:
        return None
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    max_requests = 0.0
    for key, name, secondary in (("kv_usage", "KV cache usage", False), ("waiting", "queue depth", True),
                                 ("running", "running", True)):
        pts = [(s.t_s, s.values[key]) for s in samples if key in s.values]
        if pts:
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=name,
                                     mode="lines+markers"), secondary_y=secondary)
            max_requests = max(max_requests, *(p[1] for p in pts)) if secondary else max_requests
    fig.update_layout(title=f"Server KV usage and queue depth over time: {run.label}",
                      xaxis_title="time since start (s)")
    fig.update_yaxes(title_text="KV usage (0-1)", secondary_y=False)
    fig.update_yaxes(title_text="requests", secondary_y=True, **count_axis(max_requests))
    return fig


def sweep_latency(runs: list[RunResult], knee: Knee) -> go.Figure:
    x = [r.aggregates.request_throughput for r in runs]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT vs load", "TPOT vs load"))
    for col, attr in ((1, "ttft_ms"), (2, "tpot_ms")):
        for pct in ("median", "p99"):
            y = [getattr(getattr(r.aggregates, attr), pct) for r in runs]
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", text=[r.label for r in runs],
                                     name=f"{attr.split('_')[0].upper()} {pct}"), row=1, col=col)
        if knee.index is not None:
            fig.add_vline(x=x[knee.index], line_dash="dash", line_color="red", row=1, col=col,
                          annotation_text="knee")
    fig.update_xaxes(title_text="achieved request rate (req/s)")
    fig.update_yaxes(title_text="ms")
    fig.update_layout(title=f"Latency vs load. Knee: {knee.reason}")
    return fig


def throughput_vs_concurrency(runs: list[RunResult]) -> go.Figure:
    # Little's law: mean requests in flight = throughput x mean E2E.
    conc = [r.aggregates.request_throughput * (r.aggregates.e2e_ms.mean or 0) / 1000 for r in runs]
    fig = go.Figure(go.Scatter(x=conc, y=[r.aggregates.output_token_throughput for r in runs],
                               mode="lines+markers", text=[r.label for r in runs]))
    fig.update_layout(title="Output throughput vs concurrency", xaxis_title="mean requests in flight",
                      yaxis_title="output tokens/s")
    return fig


def _summary_html(runs: list[RunResult]) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("run", "ok/sent", "req/s", "out tok/s", "TTFT p50",
                                              "TTFT p99", "TPOT p50", "TPOT p99", "errors", "client"))
    body = []
    for r in runs:
        a = r.aggregates
        cells = [r.label, f"{a.num_ok}/{a.num_requests}", f"{a.request_throughput:.2f}",
                 f"{a.output_token_throughput:.1f}", *(f"{v:.1f}" if v is not None else "-" for v in
                 (a.ttft_ms.median, a.ttft_ms.p99, a.tpot_ms.median, a.tpot_ms.p99)),
                 ", ".join(f"{k}: {v}" for k, v in a.errors_by_kind.items()) or "0",
                 "OVERLOADED" if r.client_lag.overloaded else "ok"]
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _replicas_html(run: RunResult) -> str:
    """The shown run's per-replica table ('' for a single server)."""
    rep = run.replicas
    if rep is None:
        return ""

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = "".join(f"<th>{h}</th>" for h in ("replica", "lane", "requests", "prompt tokens", "prefix hits",
                                              "prefix queries", "hit rate", "waiting max"))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in (
        r.replica, r.lane or "-", fmt(r.num_requests, "d"), fmt(r.prompt_tokens, ".0f"), fmt(r.prefix_hits, ".0f"),
        fmt(r.prefix_queries, ".0f"), fmt(r.prefix_hit_rate, ".1%"), fmt(r.waiting_max, ".0f"))) + "</tr>"
        for r in rep.replicas)
    note = (f"imbalance {fmt(rep.imbalance, '.2f')}, prefix spread {fmt(rep.prefix_spread, '.2f')}, hit rate "
            f"{fmt(rep.hit_rate, '.1%')} of {fmt(rep.offered_reuse, '.1%')} offered ({rep.source})")
    return f"<h2>Replicas: {html.escape(run.label)}</h2><p>{html.escape(note)}</p><table><tr>{head}</tr>{body}</table>"


def render_html(runs: list[RunResult], knee: Knee | None, title: str = "kvpilot bench report",
                extra_html: str = "", plotlyjs: bool | str = True) -> str:
    """The report as one HTML string. `plotlyjs` is plotly's include_plotlyjs for the first figure (True:
    inlined; "cdn"; or the path of a plotly.js file, relative to the page); the rest reuse it.

    `extra_html` (already escaped, e.g. the doctor's section) is placed after the summary table.
    """
    shown = runs[knee.index] if knee is not None and knee.index is not None else runs[-1]
    figs = [latency_cdfs(runs)]
    if knee is not None and len(runs) > 1:
        figs += [sweep_latency(runs, knee), throughput_vs_concurrency(runs)]
    figs += [f for f in (stage_stack(shown), server_timeline(shown)) if f is not None]
    divs = [f.to_html(full_html=False, include_plotlyjs=plotlyjs if i == 0 else False, config=_CONFIG,
                      div_id=f"kvpilot-plot-{i}") for i, f in enumerate(figs)]
    if isinstance(plotlyjs, str) and plotlyjs.endswith(".js"):
        message = (f"The plots need {plotlyjs} beside this file (copy it along, or write the report with "
                   "--html-plotlyjs inline).")
        divs.insert(1, _MISSING_PLOTLYJS.format(message=json.dumps(message).replace("</", "<\\/")))
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            f"{_summary_html(runs)}{_replicas_html(shown)}{extra_html}{''.join(divs)}</body></html>")


def shared_plotlyjs(directory: Path) -> str:
    """The name of plotly.js's file in `directory`, written there unless this version already is (reports
    written side by side share it). Written under a temporary name and renamed: never seen half written."""
    name = f"plotly-{get_plotlyjs_version()}.min.js"
    target = directory / name
    if not target.is_file():
        partial = directory / f".{name}.{os.getpid()}.partial"
        partial.write_text(get_plotlyjs(), encoding="utf-8")
        os.replace(partial, target)
    return name


def write_html(path: str | Path, runs: list[RunResult], knee: Knee | None, extra_html: str = "",
               plotlyjs: str = "directory") -> None:
    """Writes the report to `path`; `plotlyjs` is one of PLOTLYJS_MODES (module docstring)."""
    if plotlyjs not in PLOTLYJS_MODES:
        raise ValueError(f"--html-plotlyjs {plotlyjs!r}: use one of {', '.join(PLOTLYJS_MODES)}")
    path = Path(path)
    include: bool | str = ({"inline": True, "cdn": "cdn"}[plotlyjs] if plotlyjs != "directory"
                           else shared_plotlyjs(path.parent))
    path.write_text(render_html(runs, knee, extra_html=extra_html, plotlyjs=include), encoding="utf-8")

"""Console output: the progress bar while running and the summary tables after (rich), each printed whole at
any console width (table_layout.print_table)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpilot.bench.cache_hits import cache_hits
from kvpilot.bench.result import Knee, RunResult
from kvpilot.bench.stats import Distribution
from kvpilot.bench.table_layout import print_table


def make_progress(console: Console, disable: bool = False) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("errors: {task.fields[errors]}"), TimeElapsedColumn(),
                    console=console, transient=True, disable=disable)


def _fmt(v: float | None, digits: int = 1) -> str:
    """`v` to `digits` decimals with thousands separators; a value that rounds to zero prints `0.0`, never `-0.0`
    (a stage's mean can come out a hair below zero from the server's rounded timings)."""
    return "-" if v is None else f"{round(v, digits) + 0.0:,.{digits}f}"  # + 0.0 turns -0.0 into 0.0


def latency_table(run: RunResult) -> Table:
    a = run.aggregates
    table = Table(title=f"Latency (ms): {run.label}")
    for col in ("metric", "n", "mean", "median", "p90", "p95", "p99", "max"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    rows: list[tuple[str, Distribution]] = [
        ("TTFT", a.ttft_ms), ("TPOT", a.tpot_ms), ("ITL", a.itl_ms), ("E2E", a.e2e_ms),
        ("client queue wait", a.queue_wait_ms), ("client dispatch lag", a.sched_lag_ms)]
    rows += [(f"  stage: {k}", d) for k, d in (a.stages_ms or {}).items()]
    for name, d in rows:
        table.add_row(name, str(d.num_samples), _fmt(d.mean), _fmt(d.median), _fmt(d.p90),
                      _fmt(d.p95), _fmt(d.p99), _fmt(d.max))
    return table


def group_table(run: RunResult) -> Table | None:
    groups = run.aggregates.groups_ms
    if not groups:
        return None
    table = Table(title="By prompt group (ms)")
    for col in ("group", "n", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "E2E p99"):
        table.add_column(col, justify="left" if col == "group" else "right")
    for name, d in groups.items():
        table.add_row(name, str(d["e2e"].num_samples), _fmt(d["ttft"].median), _fmt(d["ttft"].p99),
                      _fmt(d["tpot"].median), _fmt(d["tpot"].p99), _fmt(d["e2e"].median), _fmt(d["e2e"].p99))
    return table


def throughput_table(run: RunResult) -> Table:
    a = run.aggregates
    table = Table(title="Throughput and errors", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("requests ok / sent", f"{a.num_ok} / {a.num_requests}")
    table.add_row("duration (s)", _fmt(a.duration_s, 2))
    table.add_row("request throughput (req/s)", _fmt(a.request_throughput, 2))
    table.add_row("output token throughput (tok/s)", _fmt(a.output_token_throughput, 1))
    table.add_row("total token throughput (tok/s)", _fmt(a.total_token_throughput, 1))
    if a.goodput is not None:
        table.add_row("goodput (req/s within SLOs)", f"{a.goodput:.2f} ({a.good_fraction:.0%} of requests)")
    for kind, count in sorted(a.errors_by_kind.items()):
        table.add_row(f"[red]errors: {kind}", str(count))
    m = run.metrics_summary
    if m is not None:
        table.add_row("server KV usage max / mean", f"{_fmt(m.kv_usage_max, 3)} / {_fmt(m.kv_usage_mean, 3)}")
        table.add_row("server queue depth max / mean", f"{_fmt(m.waiting_max, 0)} / {_fmt(m.waiting_mean, 1)}")
        table.add_row("server preemptions", _fmt(m.num_preemptions, 0))
        table.add_row("prefix cache hit rate", _fmt(m.prefix_cache_hit_rate, 3))
    hits = cache_hits(run.output.records, m)
    if hits is not None and hits.returning.num_requests:  # multi-turn: reuse of the sessions' history
        for line in hits.lines():
            name, _, value = line.partition(": ")
            table.add_row(f"cache, {name}", value)
    return table


def replica_table(run: RunResult) -> Table | None:
    """Per-replica load and prefix-cache reuse, with the imbalance and prefix spread in the caption."""
    rep = run.replicas
    if rep is None:
        return None
    table = Table(title=f"Replicas ({rep.source})")
    table.add_column("replica", no_wrap=True, min_width=max((len(r.replica) for r in rep.replicas), default=7))
    for col in ("lane", "requests", "prompt tok", "prefix hits / queries", "hit rate", "running mean / max",
                "waiting mean / max"):
        table.add_column(col, justify="left" if col == "lane" else "right")
    for r in rep.replicas:
        table.add_row(r.replica, r.lane or "-", "-" if r.num_requests is None else str(r.num_requests),
                      _fmt(r.prompt_tokens, 0), f"{_fmt(r.prefix_hits, 0)} / {_fmt(r.prefix_queries, 0)}",
                      _fmt(r.prefix_hit_rate, 3), f"{_fmt(r.running_mean)} / {_fmt(r.running_max, 0)}",
                      f"{_fmt(r.waiting_mean)} / {_fmt(r.waiting_max, 0)}")
    parts = [f"imbalance (max/mean requests) {_fmt(rep.imbalance, 2)}"]
    if rep.prefix_spread is not None:
        parts.append(f"prefix spread {rep.prefix_spread:.2f} replicas per group ({rep.num_prefix_groups} groups)")
    parts.append(f"hit rate {_fmt(rep.hit_rate, 3)}" + (f" of {rep.offered_reuse:.3f} offered"
                                                        if rep.offered_reuse is not None else ""))
    if rep.routed:
        parts.append("bench routed round-robin")
    if rep.error:
        parts.append(f"scrape error: {rep.error}")
    table.caption = "; ".join(parts)
    return table


def sweep_table(runs: list[RunResult], knee: Knee) -> Table:
    table = Table(title="Sweep (increasing load)")
    for col in ("run", "req/s", "out tok/s", "good %", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "errors", "knee"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=col in ("run", "knee"))
    for i, r in enumerate(runs):
        a = r.aggregates
        good = "-" if a.good_fraction is None else f"{a.good_fraction:.0%}"
        table.add_row(r.label, _fmt(a.request_throughput, 2), _fmt(a.output_token_throughput),
                      good, _fmt(a.ttft_ms.median), _fmt(a.ttft_ms.p99), _fmt(a.tpot_ms.median),
                      _fmt(a.tpot_ms.p99), str(a.num_errors), "<== knee" if i == knee.index else "")
    return table


def print_summary(console: Console, runs: list[RunResult], knee: Knee | None) -> None:
    """Tables for the last run (or the sweep), then the client-lag verdict and first errors."""
    if knee is not None:
        print_table(console, sweep_table(runs, knee))
        console.print(f"Knee: {knee.reason}")
    last = runs[knee.index if knee is not None and knee.index is not None else -1]
    tables = [latency_table(last), group_table(last), throughput_table(last), replica_table(last)]
    for table in tables:
        if table is not None:
            print_table(console, table)
    for r in runs:
        style = "bold red" if r.client_lag.overloaded else "green"
        console.print(f"{r.label}: {r.client_lag.message}", style=style, markup=False)
    errors = [rec for r in runs for rec in r.output.records if rec.error][:3]
    for rec in errors:
        console.print(f"example error (request {rec.request_index}): {rec.error}", style="red",
                      markup=False)

"""bench's console summary on narrow consoles (80 and 60 columns, as a small terminal or a pipe): every table
is printed whole (drawn when it fits, else as a list), no cell cut to `…`, every number whole; no `-0.0`."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from rich.console import Console
from rich.table import Table

from kvpilot.bench.console import (group_table, latency_table, print_summary, replica_table, sweep_table,
                                   throughput_table)
from kvpilot.bench.records import RequestRecord
from kvpilot.bench.result import Knee, RunResult
from kvpilot.bench.table_layout import print_table
from tests.doctor.builders import closed_loop, req, run, samples
from tests.doctor.scenarios import GATEWAY, replica_samples

WIDTHS = (80, 60)


def _slow_request(i: int, sent_s: float) -> RequestRecord:
    """Seconds-long requests (numbers like 4,113.2) whose server E2E reads a hair over its stages' sum."""
    r = req(i, sent_s, prefill=1500.0 + 97.3 * i, itl=120.0 + i, group=f"long-prefix-group-{i % 2}",
            replica=f"replica-{i % 2}")
    assert r.server is not None
    return dataclasses.replace(r, server=dataclasses.replace(r.server, e2e_ms=r.server.e2e_ms - 0.04))


@pytest.fixture(scope="module")
def runs() -> list[RunResult]:
    gauges = {"running": 2, "waiting": 1}
    reps = replica_samples(60, {f"replica-{k}": {"prefix_queries": 9000.0, "prefix_hits": 1234.0,
                                                 "requests_ok": 6.0} for k in range(2)},
                           {f"replica-{k}": gauges for k in range(2)})
    metrics = samples(60, running=4, waiting=3, kv=0.42, prefix_queries=18000, prefix_hits=2468)
    return [run(f"concurrency={c}-with-a-long-label", closed_loop(12, c, _slow_request), concurrency=c,
                metrics=metrics, replica_plan=GATEWAY, replica_samples=reps) for c in (2, 4)]


def _tables(runs: list[RunResult]) -> list[Table]:
    knee = Knee(0, "the last run within the SLOs", 0.9)
    tables = [sweep_table(runs, knee), latency_table(runs[-1]), group_table(runs[-1]),
              throughput_table(runs[-1]), replica_table(runs[-1])]
    return [t for t in tables if t is not None]


def _printed(width: int, draw) -> str:  # type: ignore[no-untyped-def]
    console = Console(width=width, file=io.StringIO(), record=True)
    draw(console)
    return console.export_text()


def _words(table: Table) -> set[str]:
    """Each cell's whitespace-separated pieces (markup removed): numbers, and words of labels."""
    console = Console()
    return {word for column in table.columns for cell in column.cells
            for word in console.render_str(str(cell)).plain.split()}


@pytest.mark.parametrize("width", WIDTHS)
def test_every_table_prints_whole(runs: list[RunResult], width: int) -> None:
    for table in _tables(runs):
        text = _printed(width, lambda console: print_table(console, table))
        assert "…" not in text, text
        assert max(len(line) for line in text.splitlines()) <= width
        found = set(re.split(r"[\s│┃|]+", text))
        assert _words(table) - found == set(), text  # every number and word whole, on one line


@pytest.mark.parametrize("width", WIDTHS)
def test_the_summary_cuts_nothing_and_prints_no_negative_zero(runs: list[RunResult], width: int) -> None:
    text = _printed(width, lambda console: print_summary(console, runs, Knee(0, "within the SLOs", 0.9)))
    assert "…" not in text and "-0.0" not in text
    assert re.search(r"stage: other\b.*\b0\.0\b", text.replace("\n", " "))  # a mean of -0.04 ms reads 0.0
    assert "<== knee" in text and "long-prefix-group-1" in text and "replica-1" in text


def test_a_wide_console_still_draws_the_tables(runs: list[RunResult]) -> None:
    text = _printed(200, lambda console: print_table(console, latency_table(runs[-1])))
    assert "┃ metric" in text and "│ client dispatch lag" in text

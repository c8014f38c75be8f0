"""A sweep against a capacity-limited scripted server, its knee, and the JSON/CSV/HTML outputs."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from kvpilot.bench.api import BenchConfig, BenchOutcome, run_bench, sweep_point_items
from kvpilot.bench.client import Target
from kvpilot.bench.datasets import DatasetConfig, build_dataset
from kvpilot.bench.load import LoadShape
from kvpilot.bench.records import record_from_json
from kvpilot.bench.report_html import write_html
from kvpilot.bench.result import SCHEMA_VERSION, ResultFileError, read_result
from kvpilot.bench.stats import parse_slo
from kvpilot.bench.sweep import sweep_rates
from kvpilot.bench.tokens import load_tokenizer
from kvpilot.doctor.bench_section import doctor_report_section
from tests.doubles.scripted_process import ScriptedProcess
from tests.doubles.scripted_server import Behavior

from .chromium_probe import chromium_path, probe


@pytest.fixture(scope="module")
def sweep_outcome(scripted: ScriptedProcess, tmp_path_factory: pytest.TempPathFactory) -> tuple[BenchOutcome, Path]:
    # Two requests decode at once (20 ms TTFT + 5 x 5 ms): all-at-once load queues, synchronous does not.
    scripted.set_script(Behavior(ttft_s=0.02, itl_s=0.005, num_output_tokens=6, num_cached_tokens=2),
                        max_running=2)
    out_dir = tmp_path_factory.mktemp("sweep")
    cfg = BenchConfig(
        target=Target(scripted.base_url, "", timeout_s=20.0),
        dataset=DatasetConfig(kind="shared-prefix", input_len=12, prefix_len=8, num_prefixes=2,
                              num_suffixes=3, output_len=6),
        load=LoadShape(num_requests=12, num_warmup=2), slos=parse_slo("ttft=70ms"), sweep=True,
        sweep_num_points=3, scrape_interval_s=0.1, json_path=str(out_dir / "r.json"),
        csv_path=str(out_dir / "r.csv"), html_path=str(out_dir / "r.html"), progress=False,
        report_sections=(doctor_report_section,))
    console = Console(record=True, width=140)
    outcome = run_bench(cfg, console)
    (out_dir / "console.txt").write_text(console.export_text())
    scripted.set_script(Behavior())
    return outcome, out_dir


def test_sweep_rates_between() -> None:
    assert sweep_rates(1.0, 5.0, 3) == pytest.approx([2.0, 3.0, 4.0])
    assert sweep_rates(5.0, 5.0, 3) == []


def test_sweep_finds_the_knee(sweep_outcome: tuple[BenchOutcome, Path]) -> None:
    outcome, _ = sweep_outcome
    labels = [r.label for r in outcome.runs]
    assert labels[0] == "synchronous" and labels[-1] == "max-throughput" and len(labels) == 3
    knee = outcome.knee
    assert knee is not None and knee.index is not None and knee.index < 2
    assert (outcome.runs[knee.index].aggregates.good_fraction or 0) >= 0.9
    assert (outcome.runs[-1].aggregates.good_fraction or 0) < 0.9  # 12 at once: TTFT queues up
    assert all(r.aggregates.num_requests == 12 for r in outcome.runs)  # warmup left out


def test_result_json_schema(sweep_outcome: tuple[BenchOutcome, Path]) -> None:
    outcome, out_dir = sweep_outcome
    doc = read_result(out_dir / "r.json")
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    records = [record_from_json(r) for r in doc["runs"][0]["requests"]]
    assert records == [dataclasses.replace(r, output_text="") for r in outcome.runs[0].output.records]
    assert doc["config"]["target"]["model"] == "scripted-model"  # resolved from /v1/models
    assert doc["config"]["dataset"]["kind"] == "shared-prefix" and doc["config"]["slos_ms"] == {"ttft": 70.0}
    assert doc["sweep"]["index"] == 0 or doc["sweep"]["index"] == 1
    run = doc["runs"][-1]
    assert run["load"]["request_rate"] == "inf"
    assert set(run) >= {"label", "load", "aggregates", "client_lag", "server_metrics", "requests"}
    req = run["requests"][0]
    assert req["group_id"] in {"prefix-0", "prefix-1"} and req["server"]["num_cached_tokens"] == 2
    assert {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_wait_ms", "sched_lag_ms", "status"} <= set(req)
    assert run["server_metrics"]["summary"]["waiting_max"] >= 1  # the server queue was seen
    assert run["aggregates"]["stages_ms"]["queue"]["max"] > 20  # admission waits show as queue
    assert "loop_lag_samples" in run["client_lag"]


def test_csv_has_one_row_per_request(sweep_outcome: tuple[BenchOutcome, Path]) -> None:
    _, out_dir = sweep_outcome
    rows = list(csv.DictReader((out_dir / "r.csv").open()))
    assert len(rows) == 36 and {r["run"] for r in rows} == {"synchronous", "max-throughput", rows[12]["run"]}
    assert all(float(r["e2e_ms"]) > 0 and r["network_ms"] != "" for r in rows)


def test_console_summary(sweep_outcome: tuple[BenchOutcome, Path]) -> None:
    text = (sweep_outcome[1] / "console.txt").read_text()
    assert "<== knee" in text and "TTFT" in text and "prefix cache hit rate" in text
    assert "By prompt group" in text and "prefix-1" in text


def test_html_carries_the_report_sections(sweep_outcome: tuple[BenchOutcome, Path]) -> None:
    """The doctor's diagnosis reaches the report through BenchConfig.report_sections (bench never imports it)."""
    text = (sweep_outcome[1] / "r.html").read_text()
    assert text.count('id="kvpilot-doctor"') == 1


def _ticks(dom: str, axis: str) -> list[str]:
    """The tick labels plotly drew on `axis` ("xtick", "ytick", "y2tick") in a piece of the DOM."""
    return re.findall(rf'class="{axis}"[^>]*>\s*<text[^>]*>([^<]*)<', dom)


def test_html_is_self_contained_and_renders_offline(sweep_outcome: tuple[BenchOutcome, Path],
                                                    tmp_path: Path) -> None:
    if chromium_path() is None:
        pytest.skip("chromium is not installed: run scripts/install_chromium.sh")
    report = sweep_outcome[1] / "r.html"
    text = report.read_text()
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)\s*=\s*[\"']?(https?:)?//", text, re.I)
    # Control: the recording proxy does see a page's external requests.
    leaky = tmp_path / "leaky.html"
    leaky.write_text('<html><body><script src="http://example.org/a.js"></script></body></html>')
    assert "example.org" in probe(leaky).page_hosts()
    result = probe(report)
    assert result.page_hosts() == []
    # All five plots (CDFs, sweep latency, throughput, stages, KV/queue) were drawn by plotly.js.
    assert result.dom.count('class="plot-container plotly"') == 5
    assert "knee" in result.dom and "Per-request latency by stage" in result.dom
    assert 'id="kvpilot-doctor"' in result.dom  # the doctor's diagnosis of the run is part of the report
    assert 'id="kvpilot-plotly-missing"' not in result.dom  # the notice's element (its script sets p.id)
    # The stage plot's request-index axis and the timeline's requests axis tick on whole numbers only.
    stages, timeline = result.dom.split('id="kvpilot-plot-3"')[1].split('id="kvpilot-plot-4"')
    count_ticks = [*_ticks(stages, "xtick"), *_ticks(timeline, "y2tick")]
    assert count_ticks and all(re.fullmatch(r"[\d,]+", t) for t in count_ticks), count_ticks
    assert not all(re.fullmatch(r"[\d,]+", t) for t in _ticks(timeline, "ytick"))  # control: KV usage 0-1
    alone = tmp_path / "alone.html"  # the report copied without its plotly.js says what is missing
    alone.write_text(text)
    missing = probe(alone).dom
    assert 'id="kvpilot-plotly-missing"' in missing and "The plots need plotly-" in missing


def test_html_report_is_small_and_shares_one_plotlyjs(sweep_outcome: tuple[BenchOutcome, Path],
                                                      tmp_path: Path) -> None:
    """plotly.js is ~4.7 MB: inlined in every report it was nearly all of it (4.9 MB). By default it is one file
    beside the reports, written once; --html-plotlyjs inline still makes one self-contained file."""
    outcome, out_dir = sweep_outcome
    shared = list(out_dir.glob("plotly-*.min.js"))
    assert len(shared) == 1 and shared[0].stat().st_size > 3_000_000
    report = (out_dir / "r.html").read_text()
    assert len(report) < 300_000 and f'src="{shared[0].name}"' in report
    written = shared[0].stat().st_mtime_ns
    write_html(out_dir / "again.html", outcome.runs, outcome.knee)
    assert list(out_dir.glob("plotly-*.min.js")) == shared and shared[0].stat().st_mtime_ns == written
    write_html(tmp_path / "inline.html", outcome.runs, outcome.knee, plotlyjs="inline")
    inline = (tmp_path / "inline.html").read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "inline.html"] and len(inline) > 3_000_000
    assert not re.search(r"<script[^>]+src=", inline)
    with pytest.raises(ValueError, match="use one of directory, inline, cdn"):
        write_html(tmp_path / "bad.html", outcome.runs, outcome.knee, plotlyjs="local")


def test_read_result_checks_the_schema_version(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": 0}))
    with pytest.raises(ResultFileError, match="re-run"):
        read_result(old)
    with pytest.raises(ResultFileError, match="cannot read"):
        read_result(tmp_path / "missing.json")



def test_each_sweep_run_draws_new_prompts_unless_the_dataset_is_a_file() -> None:
    """A later run must not find its prompts in the server's prefix cache from an earlier run."""
    tok = load_tokenizer(None)
    cfg = BenchConfig(target=Target("http://unused", "m"),
                      dataset=DatasetConfig(kind="shared-prefix", input_len=24, prefix_len=16, num_prefixes=2))
    first = build_dataset(cfg.dataset, tok, 6)
    texts = [{item.turns[0].text for item in sweep_point_items(cfg, tok, first, k)} for k in range(3)]
    assert sweep_point_items(cfg, tok, first, 0) is first
    assert all(not (a & b) for i, a in enumerate(texts) for b in texts[i + 1:])
    prefixes = [{t.split(" ")[0] for t in run} for run in texts]
    assert not (prefixes[0] & prefixes[1])  # new shared prefixes too
    trace_cfg = dataclasses.replace(cfg, dataset=DatasetConfig(kind="trace", path="unused.jsonl"))
    assert sweep_point_items(trace_cfg, tok, first, 2) is first

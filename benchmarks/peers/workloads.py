"""The workloads, each one `kvpilot bench` run (the same client for every engine), and their result rows.

Every engine sees the same prompts: workload i uses seed `base_seed + i` whatever the engine. The warm-up is
a separate, unrecorded `kvpilot bench` call with other prompts (seed + 1000): bench's own --warmup replays
the first measured prompts, which would then hit the engines' prefix caches.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpilot.bench.result import read_result

WARMUP_SEED_OFFSET = 1000


@dataclass(frozen=True)
class Workload:
    """One closed-loop load: `concurrency` streams, prompts of `input_len` tokens, `output_len` out."""

    name: str
    concurrency: int
    input_len: int
    output_len: int
    num_requests: int
    num_warmup_requests: int
    is_prefill: bool = False


@dataclass(frozen=True)
class Row:
    """One engine x workload x pass. Throughputs in tokens/s over the run's span, latencies in ms."""

    engine: str
    workload: str
    pass_index: int
    output_tok_s: float
    prompt_tok_s: float
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    tpot_p50_ms: float | None
    num_ok: int
    num_errors: int
    mean_output_tokens: float
    client_overloaded: bool
    min_output_tokens: int = 0  # the shortest successful request's output (a stream that ended early shows here)
    peak_rss_mib: float | None = None  # the server's peak RSS when the workload ended (servers.RunningServer)

    def to_json(self) -> dict:
        return asdict(self)


def default_workloads(quick: bool, prefill_concurrency: int, input_len: int = 128, output_len: int = 128,
                      prefill_len: int = 512) -> list[Workload]:
    """c1 / c16 / c64: `input_len` in, `output_len` out; prefill: `prefill_len`-token prompts, 1 token out
    (judged by prompt tok/s). Full runs warm up with one request per stream; quick ones with one in all."""
    scale = 1 if quick else 4

    def warmup(concurrency: int) -> int:
        return 1 if quick else concurrency

    return [
        Workload("c1", 1, input_len, output_len, 4 * scale, warmup(1)),
        Workload("c16", 16, input_len, output_len, 16 * scale, warmup(16)),
        Workload("c64", 64, input_len, output_len, 64 * scale, warmup(64)),
        Workload("prefill", prefill_concurrency, prefill_len, 1, 8 * scale, warmup(prefill_concurrency),
                 is_prefill=True),
    ]


def kvpilot_command() -> list[str]:
    return [str(Path(sys.executable).with_name("kvpilot"))]


@functools.cache
def bench_has_temperature() -> bool:
    """Whether this kvpilot bench can send temperature (older ones leave it to the server's default)."""
    help_text = subprocess.run([*kvpilot_command(), "bench", "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "200"}).stdout
    return "--temperature" in help_text


def bench_command(base_url: str, workload: Workload, seed: int, num_requests: int, output: Path | None) -> list[str]:
    command = [*kvpilot_command(), "bench", "--base-url", base_url, "--endpoint", "completions", "--stream",
               "--ignore-eos", "--concurrency", str(workload.concurrency), "--num-requests", str(num_requests),
               "--dataset", "random", "--input-len", str(workload.input_len), "--output-len",
               str(workload.output_len), "--tokenizer", "embedded", "--seed", str(seed), "--no-progress",
               # Scraping /metrics each second costs the servers unequally (llama.cpp has none by default).
               "--no-scrape-metrics"]
    if bench_has_temperature():
        command += ["--temperature", "0"]
    if output is not None:
        command += ["--output", str(output)]
    return command


def run_workload(engine: str, pass_index: int, base_url: str, workload: Workload, seed: int,
                 results_dir: Path) -> Row:
    """Warm-up (other prompts, not recorded), then the measured run; its JSON is kept in `results_dir`."""
    if workload.num_warmup_requests:
        _run_bench(bench_command(base_url, workload, seed + WARMUP_SEED_OFFSET, workload.num_warmup_requests,
                                 None), results_dir / f"{engine}-{pass_index}-{workload.name}-warmup.log")
    output = results_dir / f"{engine}-{pass_index}-{workload.name}.json"
    _run_bench(bench_command(base_url, workload, seed, workload.num_requests, output),
               output.with_suffix(".log"))
    return row_from_result(engine, workload.name, pass_index, read_result(output))


def _run_bench(command: list[str], log_path: Path) -> None:
    with log_path.open("w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode not in (0, 1):  # 1: every request failed, still a result worth a row
        raise RuntimeError(f"kvpilot bench exited {result.returncode}; see {log_path}")


def row_from_result(engine: str, workload: str, pass_index: int, document: dict) -> Row:
    run = document["runs"][0]
    aggregates = run["aggregates"]
    ok_requests = [r for r in run["requests"] if r["ok"]]
    num_output = sum(r["num_output_tokens"] or 0 for r in ok_requests)
    return Row(
        engine=engine, workload=workload, pass_index=pass_index,
        output_tok_s=aggregates["output_token_throughput"],
        prompt_tok_s=aggregates["total_token_throughput"] - aggregates["output_token_throughput"],
        ttft_p50_ms=aggregates["ttft_ms"]["median"], itl_p50_ms=aggregates["itl_ms"]["median"],
        tpot_p50_ms=aggregates["tpot_ms"]["median"], num_ok=aggregates["num_ok"],
        num_errors=aggregates["num_errors"], mean_output_tokens=num_output / max(1, len(ok_requests)),
        client_overloaded=bool(run["client_lag"]["overloaded"]),
        min_output_tokens=min((r["num_output_tokens"] or 0 for r in ok_requests), default=0))

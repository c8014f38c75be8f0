"""The flags of ``kvpilot bench``: one ``Annotated`` typer declaration per flag, in ``--help`` order.

``bench/cli.py`` gives each its parameter and default. Only typer is imported here: ``kvpilot --help``
should not pay for numpy/httpx/plotly imports, so the texts below repeat what they need (DATASETS_HELP).
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvpilot.fit.server_capacity import API_KEY_ENV

DATASETS_HELP = "random, shared-prefix, long-short, multi-turn, jsonl, trace"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"

# the target server and how requests are sent
BaseUrlOpt = Annotated[str | None, typer.Option(
    "--base-url", "--url",  # --url: the doctor's name for it
    help=f"Server base URL (without /v1). Default {DEFAULT_BASE_URL}, unless --replica-url "
         "is given: then bench sends the load to the replicas itself.")]
ReplicaUrlOpt = Annotated[list[str] | None, typer.Option(
    "--replica-url",
    help="A replica of the deployment (a kvpilot/vLLM server's base URL; repeat for each): "
         "its /metrics is scraped as that replica's, for per-replica load, prefix-cache hit "
         "rate and imbalance. Without --base-url bench spreads the requests round-robin "
         "over these URLs (what a prefix-blind load balancer does).")]
EndpointOpt = Annotated[str, typer.Option(
    "--endpoint", help="API to call: 'completions' (/v1/completions) or 'chat' (/v1/chat/completions).")]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="Model name to send; default: the first one listed by /v1/models.")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", help="Bearer token for the server (also read from OPENAI_API_KEY, then KVPILOT_API_KEY).",
    envvar=list(API_KEY_ENV))]
StreamOpt = Annotated[bool, typer.Option(
    "--stream/--no-stream",
    help="Stream responses (needed for TTFT, TPOT and ITL); --no-stream measures E2E only.")]
IgnoreEosOpt = Annotated[bool, typer.Option(
    "--ignore-eos/--no-ignore-eos",
    help="Send ignore_eos=true so every request generates exactly its max tokens (vLLM, kvpilot).")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", help="Seconds to wait for a connection or for the next bytes of a response.")]
TemperatureOpt = Annotated[Optional[float], typer.Option(
    "--temperature", help="Send this temperature (0 = greedy, as peers are usually compared); default: "
                          "the server's own (OpenAI's default is 1.0).")]

# the load: closed or open loop, how long, sweeps
ConcurrencyOpt = Annotated[int | None, typer.Option(
    "--concurrency", help="Closed loop: keep N requests in flight, each sent as soon as the previous finished.")]
RequestRateOpt = Annotated[float, typer.Option(
    "--request-rate", help="Open loop: requests per second (inf = all at once). Ignored with --concurrency.")]
ArrivalOpt = Annotated[str, typer.Option(
    "--arrival", help="Open-loop arrivals: 'poisson' (gamma with --burstiness) or 'constant' spacing.")]
BurstinessOpt = Annotated[float, typer.Option(
    "--burstiness", help="Gamma shape for arrivals like vLLM: 1 = Poisson, < 1 burstier, > 1 smoother.")]
MaxConcurrencyOpt = Annotated[int | None, typer.Option(
    "--max-concurrency", help="Open loop: at most N in flight; time waiting for a slot is reported as client queue "
                              "wait, not TTFT.")]
NumRequestsOpt = Annotated[int | None, typer.Option(
    "--num-requests",
    help="Requests to send (with --duration: whichever ends first). Default 100 without --duration.")]
DurationOpt = Annotated[float | None, typer.Option("--duration", help="Stop sending after this many seconds.")]
WarmupOpt = Annotated[int, typer.Option("--warmup", help="Requests sent first and left out of the results.")]
SweepOpt = Annotated[bool, typer.Option(
    "--sweep/--no-sweep",
    help="Run synchronous, then max throughput, then rates in between; report the saturation knee.")]
SweepPointsOpt = Annotated[int, typer.Option("--sweep-points", help="Number of runs in a --sweep (>= 2).")]

# the prompts
DatasetOpt = Annotated[str, typer.Option("--dataset", help=f"Prompts: {DATASETS_HELP}.")]
DatasetPathOpt = Annotated[str | None, typer.Option(
    "--dataset-path", help="JSONL file for --dataset jsonl (prompt/messages per line) or trace "
                           "(timestamp plus prompt or input_len/output_len).")]
InputLenOpt = Annotated[int, typer.Option(
    "--input-len", help="Prompt length in tokens (random, long-short short prompts, multi-turn turns; "
                        "shared-prefix total).")]
OutputLenOpt = Annotated[int, typer.Option("--output-len", help="max_tokens per request.")]
LenDistOpt = Annotated[str, typer.Option(
    "--len-dist", help="Length distribution for random: fixed, uniform or normal.")]
RangeRatioOpt = Annotated[float, typer.Option(
    "--range-ratio", help="uniform: lengths in len*(1 +- r); normal: std = r*len, clipped to that range.")]
NumPrefixesOpt = Annotated[int, typer.Option(
    "--num-prefixes", help="shared-prefix: number of distinct prefixes (groups).")]
NumSuffixesOpt = Annotated[int, typer.Option("--num-suffixes", help="shared-prefix: suffixes per prefix.")]
PrefixLenOpt = Annotated[int, typer.Option("--prefix-len", help="shared-prefix: prefix length in tokens.")]
LongFractionOpt = Annotated[float, typer.Option("--long-fraction", help="long-short: fraction of long prompts.")]
LongInputLenOpt = Annotated[int, typer.Option(
    "--long-input-len", help="long-short: long prompt length in tokens.")]
NumTurnsOpt = Annotated[int, typer.Option(
    "--num-turns", help="multi-turn: user turns per chat session (each carries the history).")]
TokenizerOpt = Annotated[str | None, typer.Option(
    "--tokenizer", help="Tokenizer for token-exact prompts and output counts: HF name/dir, a .gguf file, "
                        "or 'embedded'. Default: approximate word counts.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed for prompts and arrivals.")]

# what counts as good, and what is measured besides the requests
SloOpt = Annotated[str | None, typer.Option(
    "--slo", help="SLOs for goodput, e.g. ttft=200ms,tpot=50ms,itl=100ms,e2e=5s.")]
GoodputTargetOpt = Annotated[float, typer.Option(
    "--goodput-target", help="Sweep knee: a load meets the SLOs when this fraction of requests does.")]
MetricsUrlOpt = Annotated[str | None, typer.Option(
    "--metrics-url", help="Prometheus endpoint to scrape; default <base-url>/metrics.")]
ScrapeMetricsOpt = Annotated[bool, typer.Option(
    "--scrape-metrics/--no-scrape-metrics", help="Scrape server metrics before, during and after the run.")]
ScrapeIntervalOpt = Annotated[float, typer.Option(
    "--scrape-interval", help="Seconds between metric scrapes during the run.")]
MaxClientLagOpt = Annotated[float, typer.Option(
    "--max-client-lag-ms",
    help="Warn that the client is overloaded when its p99 dispatch or event-loop lag exceeds this.")]
ClientProcessesOpt = Annotated[int, typer.Option(
    "--client-processes",
    help="Run the measured load in N client processes (concurrency, requests and rate dealt "
         "among them), so that the client keeps up with hundreds of fast streams: one "
         "Python process reads a few thousand chunks a second.")]

# where the results go
OutputOpt = Annotated[str | None, typer.Option(
    "--output", help="Write the full result JSON (schema_version 1, see docs/bench.md) here.")]
CsvOpt = Annotated[str | None, typer.Option("--csv", help="Write per-request records as CSV here.")]
HtmlOpt = Annotated[str | None, typer.Option(
    "--html", help="Write an HTML report with plots here (works offline; see --html-plotlyjs).")]
HtmlPlotlyjsOpt = Annotated[str, typer.Option(
    "--html-plotlyjs",
    help="Where the report's plotly.js comes from: directory (one shared plotly-<version>.min.js beside the "
         "reports, a report is tens of kB), inline (one self-contained file, ~5 MB) or cdn (loaded from "
         "plotly's CDN: needs the network).")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")]

"""``kvpilot bench``: the typer command. kvpilot.cli registers ``make_bench_command(sections)`` as
``app.command("bench")``, passing the doctor's report section: bench sits below the doctor and never
imports it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from kvpilot.bench.api import ReportSection

# Kept here, not imported: `kvpilot --help` should not pay for numpy/httpx/plotly imports.
DATASETS_HELP = "random, shared-prefix, long-short, multi-turn, jsonl, trace"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
UNAUTHORIZED_HINT = ("the server answered 401 (API key missing or wrong): pass its key with --api-key, or set "
                     "OPENAI_API_KEY")


def _choice(value: str, allowed: tuple[str, ...], flag: str) -> Any:  # Any: becomes a Literal type
    if value not in allowed:
        raise typer.BadParameter(f"{value!r}: use one of {', '.join(allowed)}", param_hint=flag)
    return value


def make_bench_command(report_sections: tuple[ReportSection, ...] = ()) -> Callable[..., None]:
    """The ``kvpilot bench`` command; its ``--html`` report also carries ``report_sections``, in order."""

    def bench_command(
        base_url: Annotated[
            str | None,
            typer.Option("--base-url", "--url",  # --url: the doctor's name for it
                         help=f"Server base URL (without /v1). Default {DEFAULT_BASE_URL}, unless --replica-url "
                              "is given: then bench sends the load to the replicas itself."),
        ] = None,
        replica_url: Annotated[
            list[str] | None,
            typer.Option(help="A replica of the deployment (a kvpilot/vLLM server's base URL; repeat for each): "
                              "its /metrics is scraped as that replica's, for per-replica load, prefix-cache hit "
                              "rate and imbalance. Without --base-url bench spreads the requests round-robin "
                              "over these URLs (what a prefix-blind load balancer does)."),
        ] = None,
        endpoint: Annotated[
            str,
            typer.Option(help="API to call: 'completions' (/v1/completions) or 'chat' (/v1/chat/completions)."),
        ] = "completions",
        model: Annotated[
            str | None, typer.Option(help="Model name to send; default: the first one listed by /v1/models.")
        ] = None,
        api_key: Annotated[
            str | None,
            typer.Option(
                help="Bearer token for the server (also read from OPENAI_API_KEY, then KVPILOT_API_KEY).",
                envvar=["OPENAI_API_KEY", "KVPILOT_API_KEY"],
            ),
        ] = None,
        stream: Annotated[
            bool,
            typer.Option(help="Stream responses (needed for TTFT, TPOT and ITL); --no-stream measures E2E only."),
        ] = True,
        ignore_eos: Annotated[
            bool,
            typer.Option(
                help="Send ignore_eos=true so every request generates exactly its max tokens (vLLM, kvpilot)."
            ),
        ] = False,
        timeout: Annotated[
            float, typer.Option(help="Seconds to wait for a connection or for the next bytes of a response.")
        ] = 300.0,
        temperature: Annotated[
            Optional[float],
            typer.Option(help="Send this temperature (0 = greedy, as peers are usually compared); default: "
                              "the server's own (OpenAI's default is 1.0)."),
        ] = None,
        concurrency: Annotated[
            int | None,
            typer.Option(
                help="Closed loop: keep N requests in flight, each sent as soon as the previous finished."
            ),
        ] = None,
        request_rate: Annotated[
            float,
            typer.Option(help="Open loop: requests per second (inf = all at once). Ignored with --concurrency."),
        ] = math.inf,
        arrival: Annotated[
            str,
            typer.Option(help="Open-loop arrivals: 'poisson' (gamma with --burstiness) or 'constant' spacing."),
        ] = "poisson",
        burstiness: Annotated[
            float,
            typer.Option(help="Gamma shape for arrivals like vLLM: 1 = Poisson, < 1 burstier, > 1 smoother."),
        ] = 1.0,
        max_concurrency: Annotated[
            int | None,
            typer.Option(
                help="Open loop: at most N in flight; time waiting for a slot is reported as client queue "
                "wait, not TTFT."
            ),
        ] = None,
        num_requests: Annotated[
            int | None,
            typer.Option(
                help="Requests to send (with --duration: whichever ends first). Default 100 without --duration."
            ),
        ] = None,
        duration: Annotated[float | None, typer.Option(help="Stop sending after this many seconds.")] = None,
        warmup: Annotated[int, typer.Option(help="Requests sent first and left out of the results.")] = 0,
        sweep: Annotated[
            bool,
            typer.Option(
                help="Run synchronous, then max throughput, then rates in between; report the saturation knee."
            ),
        ] = False,
        sweep_points: Annotated[int, typer.Option(help="Number of runs in a --sweep (>= 2).")] = 5,
        dataset: Annotated[str, typer.Option(help=f"Prompts: {DATASETS_HELP}.")] = "random",
        dataset_path: Annotated[
            str | None,
            typer.Option(
                help="JSONL file for --dataset jsonl (prompt/messages per line) or trace "
                "(timestamp plus prompt or input_len/output_len)."
            ),
        ] = None,
        input_len: Annotated[
            int,
            typer.Option(
                help="Prompt length in tokens (random, long-short short prompts, multi-turn turns; "
                "shared-prefix total)."
            ),
        ] = 128,
        output_len: Annotated[int, typer.Option(help="max_tokens per request.")] = 64,
        len_dist: Annotated[
            str, typer.Option(help="Length distribution for random: fixed, uniform or normal.")
        ] = "fixed",
        range_ratio: Annotated[
            float,
            typer.Option(help="uniform: lengths in len*(1 +- r); normal: std = r*len, clipped to that range."),
        ] = 0.0,
        num_prefixes: Annotated[
            int, typer.Option(help="shared-prefix: number of distinct prefixes (groups).")
        ] = 4,
        num_suffixes: Annotated[int, typer.Option(help="shared-prefix: suffixes per prefix.")] = 8,
        prefix_len: Annotated[int, typer.Option(help="shared-prefix: prefix length in tokens.")] = 512,
        long_fraction: Annotated[float, typer.Option(help="long-short: fraction of long prompts.")] = 0.1,
        long_input_len: Annotated[int, typer.Option(help="long-short: long prompt length in tokens.")] = 4096,
        num_turns: Annotated[
            int, typer.Option(help="multi-turn: user turns per chat session (each carries the history).")
        ] = 3,
        tokenizer: Annotated[
            str | None,
            typer.Option(
                help="Tokenizer for token-exact prompts and output counts: HF name/dir, a .gguf file, "
                "or 'embedded'. Default: approximate word counts."
            ),
        ] = None,
        seed: Annotated[int, typer.Option(help="Random seed for prompts and arrivals.")] = 0,
        slo: Annotated[
            str | None, typer.Option(help="SLOs for goodput, e.g. ttft=200ms,tpot=50ms,itl=100ms,e2e=5s.")
        ] = None,
        goodput_target: Annotated[
            float, typer.Option(help="Sweep knee: a load meets the SLOs when this fraction of requests does.")
        ] = 0.9,
        metrics_url: Annotated[
            str | None, typer.Option(help="Prometheus endpoint to scrape; default <base-url>/metrics.")
        ] = None,
        scrape_metrics: Annotated[
            bool, typer.Option(help="Scrape server metrics before, during and after the run.")
        ] = True,
        scrape_interval: Annotated[
            float, typer.Option(help="Seconds between metric scrapes during the run.")
        ] = 1.0,
        max_client_lag_ms: Annotated[
            float,
            typer.Option(
                help="Warn that the client is overloaded when its p99 dispatch or event-loop lag exceeds this."
            ),
        ] = 10.0,
        client_processes: Annotated[
            int,
            typer.Option(help="Run the measured load in N client processes (concurrency, requests and rate dealt "
                              "among them), so that the client keeps up with hundreds of fast streams: one "
                              "Python process reads a few thousand chunks a second."),
        ] = 1,
        output: Annotated[
            str | None,
            typer.Option(help="Write the full result JSON (schema_version 1, see docs/bench.md) here."),
        ] = None,
        csv: Annotated[str | None, typer.Option(help="Write per-request records as CSV here.")] = None,
        html: Annotated[
            str | None, typer.Option(help="Write a self-contained HTML report with plots here.")
        ] = None,
        progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ) -> None:
        """Load-test an OpenAI-compatible server and split latency into its stages."""
        from rich.console import Console  # noqa: PLC0415 (lazy: see DATASETS_HELP)

        from kvpilot.bench.api import BenchConfig, BenchError, run_bench  # noqa: PLC0415
        from kvpilot.bench.arrivals import LoadShapeError  # noqa: PLC0415
        from kvpilot.bench.client_processes import ClientProcessError  # noqa: PLC0415
        from kvpilot.bench.client import Target  # noqa: PLC0415
        from kvpilot.bench.datasets import DATASET_KINDS, DatasetConfig, DatasetError  # noqa: PLC0415
        from kvpilot.bench.load import LoadShape  # noqa: PLC0415
        from kvpilot.bench.stats import SloError, parse_slo  # noqa: PLC0415
        from kvpilot.bench.tokens import TokenizerError  # noqa: PLC0415

        # a client process that failed (e.g. its tokenizer would not load there): one line, exit 2
        user_errors = (BenchError, ClientProcessError, DatasetError, LoadShapeError, SloError, TokenizerError)
        # httpx logs every request at INFO; a bench sends thousands.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        console = Console()  # results on stdout (`> file` keeps them); errors and hints on stderr
        errors = Console(stderr=True)
        replicas = tuple(replica_url or ())
        route = bool(replicas) and base_url is None
        try:
            cfg = BenchConfig(
                target=Target(
                    base_url or (replicas[0] if route else DEFAULT_BASE_URL),
                    model or "",
                    _choice(endpoint, ("completions", "chat"), "--endpoint"),
                    api_key,
                    stream,
                    ignore_eos,
                    timeout,
                    temperature,
                ),  # type: ignore[arg-type]
                dataset=DatasetConfig(
                    _choice(dataset, DATASET_KINDS, "--dataset"),
                    input_len,
                    output_len,  # type: ignore[arg-type]
                    _choice(len_dist, ("fixed", "uniform", "normal"), "--len-dist"),
                    range_ratio,  # type: ignore[arg-type]
                    num_prefixes,
                    num_suffixes,
                    prefix_len,
                    long_fraction,
                    long_input_len,
                    num_turns,
                    dataset_path,
                    seed,
                ),
                load=LoadShape(
                    concurrency,
                    request_rate,
                    _choice(arrival, ("poisson", "constant"), "--arrival"),  # type: ignore[arg-type]
                    burstiness,
                    max_concurrency,
                    num_requests if num_requests is not None or duration is not None else 100,
                    duration,
                    warmup,
                    seed,
                ),
                slos=parse_slo(slo),
                tokenizer=tokenizer,
                sweep=sweep,
                sweep_num_points=max(2, sweep_points),
                goodput_target=goodput_target,
                metrics_url=metrics_url if scrape_metrics else "",
                scrape_interval_s=scrape_interval,
                max_lag_ms=max_client_lag_ms,
                json_path=output,
                csv_path=csv,
                html_path=html,
                progress=progress,
                report_sections=report_sections,
                replica_urls=replicas,
                route_replicas=route,
                client_processes=client_processes,
            )
            outcome = run_bench(cfg, console)
        except user_errors as exc:
            errors.print(f"error: {exc}", style="bold red", markup=False)
            raise typer.Exit(2) from None
        if any(rec.status == 401 for run in outcome.runs for rec in run.output.records):
            errors.print(UNAUTHORIZED_HINT, style="bold red", markup=False)
        if all(r.aggregates.num_ok == 0 for r in outcome.runs):
            errors.print("every request failed: see the errors above", style="bold red")
            raise typer.Exit(1)

    return bench_command


bench_command = make_bench_command()  # without extra report sections

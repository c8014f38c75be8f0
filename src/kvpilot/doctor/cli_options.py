"""The flags of ``kvpilot doctor``: one ``Annotated`` typer declaration per flag, in ``--help`` order.

``doctor/cli.py`` gives each its parameter and default. Only typer is imported here (`kvpilot --help` stays fast).
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvpilot.fit.server_capacity import API_KEY_ENV

# what to diagnose: saved measurements, or a live server
FromOpt = Annotated[list[str] | None, typer.Option(
    "--from", help="Saved `kvpilot bench --output` result JSON (repeatable: several runs or "
    "a sweep are compared by load).")]
MetricsFileOpt = Annotated[list[str] | None, typer.Option(
    "--metrics-file", help="Prometheus /metrics text of the server (kvpilot or vLLM names, old "
    "or new). Repeat it to give a scrape before and after the load: counters are diffed.")]
UrlOpt = Annotated[str | None, typer.Option(
    "--url", help="Live server to probe (base URL, e.g. http://127.0.0.1:8000): the doctor runs "
    "its own short bench workloads (a single-request baseline, short vs long prompts, shared vs "
    "unique prefixes, a concurrency ramp doubling from 1 to at most 64 in flight until throughput stops "
    "rising: the saturation knee; 3-5 minutes) and "
    "scrapes /metrics before and after. Not with --from/--metrics-file.")]

RequestOpt = Annotated[str | None, typer.Option(
    "--request", help="With --url (a kvpilot server): explain one recent request by its id (the `kvpilot` "
    "field's request_id, or X-Request-Id): where its time went and which other requests it waited behind "
    "(the server keeps its last finished requests at /v1/kvpilot/requests/ID). No probe is run.")]

# how the live probe runs
QuickOpt = Annotated[bool, typer.Option("--quick", help="With --url: a smaller probe, under a minute (ramp "
                                        "to 8 in flight, no unique-prefix control).")]
MaxConcurrencyOpt = Annotated[int | None, typer.Option(
    "--max-concurrency", help="With --url/--serve: never more requests in flight than this "
    "(the full probe doubles concurrency from 1 up to 64 until throughput stops rising: "
    "the saturation knee).")]
PhaseSecondsOpt = Annotated[float | None, typer.Option(
    "--phase-seconds", help="With --url/--serve: how long each probe phase sends requests "
    "(default 24 s, 8 s with --quick); shorter probes finish sooner and measure more noise.")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", envvar=list(API_KEY_ENV),
    help="With --url: bearer token for the server (also OPENAI_API_KEY, then KVPILOT_API_KEY).")]
ModelNameOpt = Annotated[str | None, typer.Option(
    "--model-name", help="With --url: the served model to probe (default: the first of "
    "/v1/models).")]
TokenizerOpt = Annotated[str | None, typer.Option(
    "--tokenizer", help="With --url: tokenizer for token-exact prompt lengths (HF name/dir, "
    ".gguf, 'embedded'); default: approximate word counts (the server reports exact ones).")]

# the roofline
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="Model for the roofline (catalog name, config.json or GGUF; see "
    "`kvpilot fit --list`), to say how far measured speed is from the hardware limit. Default with "
    "--gpu: the embedded smollm2-135m.")]
GpuOpt = Annotated[str | None, typer.Option(
    "--gpu", help="Hardware for the roofline, NAME[:count] as in `kvpilot fit` (e.g. "
    "h100-sxm, l4:2, cpu). Default with --model: cpu.")]

# the report
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")]
HtmlOpt = Annotated[str | None, typer.Option(
    "--html", help="Write the report as an HTML fragment (for embedding) here.")]

# a server the doctor starts itself, and the fixes it tries on it
ServeOpt = Annotated[str | None, typer.Option(
    "--serve", help='Start this server command (e.g. "kvpilot serve --max-num-seqs 8", or '
    '"vllm serve MODEL ..."; a free --port is added unless given), probe it like --url, stop it.')]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="With --serve: restart with the top finding's fix, "
                                         "probe the same workload again, print before/after for that finding's "
                                         "metric; a fix that does not help is withdrawn and the next tried.")]
VerifyBudgetOpt = Annotated[float, typer.Option("--verify-budget", help="With --verify: seconds for all "
                                                "rounds (no new round starts that would overrun it).")]
ServeTimeoutOpt = Annotated[float, typer.Option("--serve-timeout", help="With --serve: seconds to wait for "
                                                "the server to answer /v1/models.")]

# the goal the findings are judged against
SloOpt = Annotated[str | None, typer.Option(
    "--slo", help="Latency targets the findings are judged against, as in `kvpilot bench` "
    "(e.g. ttft=500ms,tpot=50ms,itl=100ms,e2e=5s; 90% of requests must meet them). Without "
    "one, latency trade-offs (TPOT rising with the batch) are notes, not findings.")]
WorkloadOpt = Annotated[str | None, typer.Option(
    "--workload", help="What the deployment is for: chat (ttft=1s,tpot=100ms), agent "
    "(ttft=2s,tpot=50ms) or batch (throughput only). Sets those SLOs (--slo overrides) and "
    "recommends flags for the goal; with --verify they are measured.")]

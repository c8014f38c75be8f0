"""The flags only `kvpilot serve` has (HTTP, limits, observability, Ray), as typer option types.

Engine flags shared with `generate` and `chat` live in kvpilot.cli_options; these are kept apart so the
command's signature in server/cli.py reads as one line per flag. Importing this module loads typer only
(`kvpilot serve --help` stays fast): defaults that need server modules are repeated in server/cli.py.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

HostOpt = Annotated[str, typer.Option("--host", help="Address to bind (0.0.0.0 for all interfaces).")]
PortOpt = Annotated[int, typer.Option("--port", help="Port to listen on.")]
ServedModelNameOpt = Annotated[Optional[list[str]], typer.Option(
    "--served-model-name", help="Model name(s) clients send in `model` (repeatable); the first is reported. "
    "Default: the --model argument.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="KVPILOT_API_KEY", help="Require `Authorization: Bearer <key>` on every route but "
    "/health (and /metrics with --metrics-public). An empty key is refused.")]
MetricsPublicOpt = Annotated[bool, typer.Option(
    "--metrics-public", help="With --api-key: leave GET /metrics open (for a Prometheus scraper without "
    "the key), and the live dashboard built from it (/dashboard, /v1/kvpilot/dashboard).")]
MaxQueuedReqsOpt = Annotated[Optional[int], typer.Option(
    "--max-num-queued-reqs", help="Most requests waiting to run (admitted, not yet running); beyond it: "
    "429 + Retry-After at once. Default: 2 x --max-num-seqs, at least 64; 0: no limit.")]
MaxQueuedTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-num-queued-tokens", help="Most prompt tokens waiting to run; beyond it: 429 + Retry-After. "
    "Default: no limit.")]
MaxRequestBodyOpt = Annotated[int, typer.Option(
    "--max-request-body-bytes", help="Largest request body accepted; beyond it: 413 before the body is "
    "read.")]
HeaderTimeoutOpt = Annotated[float, typer.Option(
    "--header-timeout", help="Seconds a client may take to send a request's line and headers; then the "
    "connection is closed.")]
BodyTimeoutOpt = Annotated[float, typer.Option(
    "--body-timeout", help="Seconds a client may take to send a request body; then 408 and the "
    "connection is closed.")]
KeepAliveTimeoutOpt = Annotated[float, typer.Option(
    "--keep-alive-timeout", help="Seconds an idle keep-alive connection stays open.")]
DrainTimeoutOpt = Annotated[float, typer.Option(
    "--drain-timeout", help="On SIGTERM, seconds in-flight requests may take to finish (new ones get "
    "503) before they are aborted and the server exits 0.")]
MaxTokensDefaultOpt = Annotated[int, typer.Option(
    "--max-tokens-default", help="Most tokens generated for a request that sends no max_tokens (chat: "
    "max_completion_tokens); it then ends with finish_reason \"length\". 0: no cap, the room left in "
    "--max-model-len (vLLM's behaviour). A client's own max_tokens is never capped.")]
AutoToolChoiceOpt = Annotated[Optional[bool], typer.Option(
    "--enable-auto-tool-choice/--no-enable-auto-tool-choice", help="Serve chat tool_choice \"auto\" (the "
    "default when a request sends tools): the output is left free and tool calls are read out of it by "
    "--tool-call-parser. Default: on where the model's chat template renders no tools (kvpilot lists them, "
    "asking for Hermes blocks) or asks for a format a parser reads, with that parser; the start-up log says "
    "which. Off: \"auto\" is a 400.")]
ToolCallParserOpt = Annotated[Optional[str], typer.Option(
    "--tool-call-parser", help="How tool calls are read out of the model's text for tool_choice \"auto\" "
    "(turns it on): hermes (<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> blocks, as Hermes "
    "and Qwen models write them) or openai (gpt-oss's harmony calls: <|channel|>commentary to=functions.NAME "
    "...<|message|>{...}<|call|>). Default: the one the chat template asks for.")]
ReasoningParserOpt = Annotated[Optional[str], typer.Option(
    "--reasoning-parser", help="Split a reasoning model's <think>...</think> block off its chat answer, as "
    "`reasoning` and `reasoning_content` (streamed: deltas of those, then content): qwen3 (Qwen3; a reply "
    "without a block is all answer), deepseek_r1 (DeepSeek-R1, QwQ: text before </think> is reasoning) or "
    "openai_gptoss (gpt-oss's harmony format: the analysis channel is the reasoning, the final channel the "
    "answer; the default for a model whose tokenizer has harmony's markers).")]
LogPromptsOpt = Annotated[bool, typer.Option(
    "--log-prompts", help="Include prompt text in the per-request JSON access log.")]
KvEventsConfigOpt = Annotated[Optional[str], typer.Option(
    "--kv-events-config", help="Publish KV-cache events (blocks stored / removed) for prefix-aware routers "
    "(llm-d), in vLLM's format and JSON keys, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": "
    "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}': a wildcard "
    "endpoint is bound, tcp://host:port is connected to (docs/server.md).")]
OtlpTracesEndpointOpt = Annotated[Optional[str], typer.Option(
    "--otlp-traces-endpoint", help="Send one OpenTelemetry span per finished request (stages as child spans, "
    "the client's W3C traceparent as parent) to this OTLP/HTTP collector, e.g. "
    "http://localhost:4318/v1/traces. Needs `pip install 'kvpilot[otel]'`.")]
EngineProcessOpt = Annotated[bool, typer.Option(
    "--engine-process/--no-engine-process", help="Run the engine core (model, scheduler, step loop) in its "
    "own process, so HTTP work never shares the GIL with it; --no-engine-process runs it in a thread of "
    "the server process.")]
UvicornLogLevelOpt = Annotated[str, typer.Option("--uvicorn-log-level", help="uvicorn's own log level.")]
RayOpt = Annotated[bool, typer.Option(
    "--ray", help="Serve on Ray Serve: replicas of this engine behind one OpenAI endpoint on --host/--port, "
    "with prefix-cache-aware routing (docs/ray.md). Needs `pip install 'kvpilot[ray]'`.")]
NumReplicasOpt = Annotated[Optional[int], typer.Option(
    "--num-replicas", help="With --ray: engine replicas (each its own process and KV cache). Default: 1, "
    "or the --ray-config file's.")]
RayConfigOpt = Annotated[Optional[str], typer.Option(
    "--ray-config", help="With --ray: a YAML file with lanes (replica pools with their own engine settings, "
    "chosen by prompt length, X-Lane header or priority) and autoscaling (docs/ray.md).")]
RoutingOpt = Annotated[Optional[str], typer.Option(
    "--routing", help="With --ray: prefix (requests sharing a prompt prefix go to the replica that cached "
    "it, within a load bound), round_robin, or power_of_two (Ray's default). Default: prefix.")]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    "--ray-address", help="With --ray: join this Ray cluster (e.g. auto) instead of starting a local "
    "one.")]

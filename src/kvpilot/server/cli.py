"""`kvpilot serve`: the OpenAI-compatible server (registered by kvpilot.cli as `app.command("serve")`).

Flags are named like `vllm serve`'s where the concept is the same; engine flags are shared with
`generate` and `chat` through kvpilot.cli_options.
"""

from __future__ import annotations

import logging
from typing import Annotated, Optional

import typer

from kvpilot.cli_options import (AsyncSchedulingOpt, AttentionBackendOpt, BlockSizeOpt, CudaGraphSizesOpt,
                                 DeviceOpt, DtypeOpt, EnforceEagerOpt, GpuUtilOpt, KvCacheDtypeOpt, KvCacheMemoryOpt,
                                 LoadFormatOpt, MaxBatchedTokensOpt, MaxModelLenOpt, MaxNumSeqsOpt, ModelOpt,
                                 PolicyOpt, PrefixCachingOpt, PromptGemmDtypeOpt, QuantizationOpt, SeedOpt,
                                 TensorParallelOpt,
                                 parse_cuda_graph_sizes)

logger = logging.getLogger("kvpilot.server")
QUEUE_CAP_BATCHES = 2
MIN_QUEUE_CAP = 64  # a burst from a few clients waits its turn, even with --max-num-seqs 1
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024  # config.DEFAULT_MAX_REQUEST_BODY_BYTES (kept lazy: --help)
DEFAULT_MAX_TOKENS_DEFAULT = 1024  # config.DEFAULT_MAX_TOKENS_DEFAULT


def _queue_cap(flag: int | None, max_num_seqs: int) -> int | None:
    """--max-num-queued-reqs: left out, two full batches may wait, and never fewer than MIN_QUEUE_CAP (beyond
    that a new request's wait grows without bound under overload, so refusing at once is kinder); 0: no limit."""
    if flag is None:
        return max(QUEUE_CAP_BATCHES * max_num_seqs, MIN_QUEUE_CAP)
    return flag or None


def serve_command(
    model: ModelOpt = None, load_format: LoadFormatOpt = "auto", dtype: DtypeOpt = "auto", device: DeviceOpt = None,
    quantization: QuantizationOpt = "auto", prompt_gemm_dtype: PromptGemmDtypeOpt = "auto",
    max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = 256,
    max_num_batched_tokens: MaxBatchedTokensOpt = None, kv_cache_memory: KvCacheMemoryOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto", gpu_memory_utilization: GpuUtilOpt = 0.9,
    block_size: BlockSizeOpt = 16,
    enable_prefix_caching: PrefixCachingOpt = True, scheduling_policy: PolicyOpt = "fcfs", seed: SeedOpt = 0,
    attention_backend: AttentionBackendOpt = "auto", async_scheduling: AsyncSchedulingOpt = None,
    enforce_eager: EnforceEagerOpt = False, cuda_graph_sizes: CudaGraphSizesOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    host: Annotated[str, typer.Option("--host", help="Address to bind (0.0.0.0 for all interfaces).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8000,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        "--served-model-name", help="Model name(s) clients send in `model` (repeatable); the first is reported. "
        "Default: the --model argument.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="KVPILOT_API_KEY", help="Require `Authorization: Bearer <key>` on every route but "
        "/health (and /metrics with --metrics-public). An empty key is refused.")] = None,
    metrics_public: Annotated[bool, typer.Option(
        "--metrics-public", help="With --api-key: leave GET /metrics open (for a Prometheus scraper without "
        "the key), and the live dashboard built from it (/dashboard, /v1/kvpilot/dashboard).")] = False,
    max_num_queued_reqs: Annotated[Optional[int], typer.Option(
        "--max-num-queued-reqs", help="Most requests waiting to run (admitted, not yet running); beyond it: "
        "429 + Retry-After at once. Default: 2 x --max-num-seqs, at least 64; 0: no limit.")] = None,
    max_num_queued_tokens: Annotated[Optional[int], typer.Option(
        "--max-num-queued-tokens", help="Most prompt tokens waiting to run; beyond it: 429 + Retry-After. "
        "Default: no limit.")] = None,
    max_request_body_bytes: Annotated[int, typer.Option(
        "--max-request-body-bytes", help="Largest request body accepted; beyond it: 413 before the body is "
        "read.")] = DEFAULT_MAX_REQUEST_BODY_BYTES,
    header_timeout: Annotated[float, typer.Option(
        "--header-timeout", help="Seconds a client may take to send a request's line and headers; then the "
        "connection is closed.")] = 10.0,
    body_timeout: Annotated[float, typer.Option(
        "--body-timeout", help="Seconds a client may take to send a request body; then 408 and the "
        "connection is closed.")] = 30.0,
    keep_alive_timeout: Annotated[float, typer.Option(
        "--keep-alive-timeout", help="Seconds an idle keep-alive connection stays open.")] = 5.0,
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", help="On SIGTERM, seconds in-flight requests may take to finish (new ones get "
        "503) before they are aborted and the server exits 0.")] = 30.0,
    max_tokens_default: Annotated[int, typer.Option(
        "--max-tokens-default", help="Most tokens generated for a request that sends no max_tokens (chat: "
        "max_completion_tokens); it then ends with finish_reason \"length\". 0: no cap, the room left in "
        "--max-model-len (vLLM's behaviour). A client's own max_tokens is never capped.")]
    = DEFAULT_MAX_TOKENS_DEFAULT,
    enable_auto_tool_choice: Annotated[bool, typer.Option(
        "--enable-auto-tool-choice", help="Serve chat tool_choice \"auto\" (the default when a request sends "
        "tools): the output is left free and tool calls are read out of it by --tool-call-parser. Without it "
        "\"auto\" is a 400.")] = False,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        "--tool-call-parser", help="How tool calls are read out of the model's text with "
        "--enable-auto-tool-choice: hermes (<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> "
        "blocks, as Hermes and Qwen models write them).")] = None,
    log_prompts: Annotated[bool, typer.Option(
        "--log-prompts", help="Include prompt text in the per-request JSON access log.")] = False,
    kv_events_config: Annotated[Optional[str], typer.Option(
        "--kv-events-config", help="Publish KV-cache events (blocks stored / removed) for prefix-aware routers, "
        "in vLLM's format, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\", \"topic\": \"kv-events\"}' (docs/server.md).")] = None,
    otlp_traces_endpoint: Annotated[Optional[str], typer.Option(
        "--otlp-traces-endpoint", help="Send one OpenTelemetry span per finished request (stages as child spans, "
        "the client's W3C traceparent as parent) to this OTLP/HTTP collector, e.g. "
        "http://localhost:4318/v1/traces. Needs `pip install 'kvpilot[otel]'`.")] = None,
    engine_process: Annotated[bool, typer.Option(
        "--engine-process/--no-engine-process", help="Run the engine core (model, scheduler, step loop) in its "
        "own process, so HTTP work never shares the GIL with it; --no-engine-process runs it in a thread of "
        "the server process.")] = True,
    uvicorn_log_level: Annotated[str, typer.Option("--uvicorn-log-level", help="uvicorn's own log level.")]
    = "warning",
    ray: Annotated[bool, typer.Option(
        "--ray", help="Serve on Ray Serve: replicas of this engine behind one OpenAI endpoint on --host/--port, "
        "with prefix-cache-aware routing (docs/ray.md). Needs `pip install 'kvpilot[ray]'`.")] = False,
    num_replicas: Annotated[Optional[int], typer.Option(
        "--num-replicas", help="With --ray: engine replicas (each its own process and KV cache). Default: 1, "
        "or the --ray-config file's.")] = None,
    ray_config: Annotated[Optional[str], typer.Option(
        "--ray-config", help="With --ray: a YAML file with lanes (replica pools with their own engine settings, "
        "chosen by prompt length, X-Lane header or priority) and autoscaling (docs/ray.md).")] = None,
    routing: Annotated[Optional[str], typer.Option(
        "--routing", help="With --ray: prefix (requests sharing a prompt prefix go to the replica that cached "
        "it, within a load bound), round_robin, or power_of_two (Ray's default). Default: prefix.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray-address", help="With --ray: join this Ray cluster (e.g. auto) instead of starting a local "
        "one.")] = None,
) -> None:
    """Start the OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics, /health)."""
    from kvpilot.engine.config import EngineConfigError
    from kvpilot.engine.kv_events_config import KVEventsConfig
    from kvpilot.launch.args import EngineArgs
    from kvpilot.server.config import ServerArgs, ServerConfigError, served_names

    try:
        engine_args = EngineArgs(model=model, load_format=load_format, dtype=dtype, device=device,
                                 quantization=quantization, prompt_gemm_dtype=prompt_gemm_dtype,
                                 max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                                 kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=gpu_memory_utilization,
                                 block_size=block_size,
                                 enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy,
                                 seed=seed, attention_backend=attention_backend,
                                 async_scheduling=async_scheduling, enforce_eager=enforce_eager,
                                 tensor_parallel_size=tensor_parallel_size,
                                 cuda_graph_sizes=parse_cuda_graph_sizes(cuda_graph_sizes),
                                 kv_events_config=KVEventsConfig.parse(kv_events_config) if kv_events_config else None,
                                 usage_context="server")
        engine_args.check()
        if otlp_traces_endpoint:  # fail here, before binding the port or loading the model
            from kvpilot.server.observe.tracing import check_tracing_available, otlp_traces_url

            otlp_traces_url(otlp_traces_endpoint)
            check_tracing_available()
        server_args = ServerArgs(host=host, port=port, served_model_names=served_names(served_model_name, model),
                                 api_key=api_key, metrics_public=metrics_public,
                                 max_num_queued_reqs=_queue_cap(max_num_queued_reqs, max_num_seqs),
                                 max_num_queued_tokens=max_num_queued_tokens or None,
                                 max_request_body_bytes=max_request_body_bytes, header_timeout_s=header_timeout,
                                 body_timeout_s=body_timeout, keep_alive_timeout_s=keep_alive_timeout,
                                 drain_timeout=drain_timeout, log_prompts=log_prompts, engine_process=engine_process,
                                 otlp_traces_endpoint=otlp_traces_endpoint or None,
                                 max_tokens_default=max_tokens_default or None,
                                 enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser)
    except (EngineConfigError, ServerConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if ray:
        raise typer.Exit(_run_on_ray(engine_args, server_args, num_replicas, ray_config, routing, ray_address))
    if num_replicas is not None or ray_config is not None or routing is not None or ray_address is not None:
        typer.echo("error: --num-replicas, --ray-config, --routing and --ray-address need --ray", err=True)
        raise typer.Exit(2)
    raise typer.Exit(run_server(engine_args, server_args, uvicorn_log_level))


def _run_on_ray(engine_args, server_args, num_replicas, ray_config, routing, ray_address) -> int:  # type: ignore[no-untyped-def]
    from kvpilot.server.ray_app.config import RayConfigError
    from kvpilot.server.ray_app.launch import RayLaunch, run_ray_server

    try:
        return run_ray_server(engine_args, server_args, RayLaunch(num_replicas, ray_config, routing, ray_address))
    except RayConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2


def run_server(engine_args, server_args, uvicorn_log_level: str = "warning") -> int:  # type: ignore[no-untyped-def]
    """Serves until SIGTERM/SIGINT (drained) and returns the exit code: 0, or 1 if the engine failed or the
    address is taken (checked before the model loads)."""
    import uvicorn

    from kvpilot.server.app import create_app
    from kvpilot.server.drain import DrainingServer
    from kvpilot.server.core.engine_spec import engine_factory
    from kvpilot.server.gc_heap import freeze_startup_heap
    from kvpilot.server.guards.listen import PortInUseError, bind_listener
    from kvpilot.server.observe.log_writer import detach_output
    from kvpilot.server.guards.slow_clients import uvicorn_options

    try:
        listener = bind_listener(server_args.host, server_args.port)
    except PortInUseError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 1
    app = create_app(engine_factory(engine_args), server_args)
    config = uvicorn.Config(app, log_level=uvicorn_log_level, access_log=False, timeout_graceful_shutdown=5,
                            **uvicorn_options(server_args))
    detach_output()  # after uvicorn's logging set-up: no log write may block the event loop
    server = DrainingServer(config, app.state.kvpilot, server_args.drain_timeout)
    freeze_startup_heap()  # this process serves until it exits: its start-up objects need no more scans
    logger.info("kvpilot serve: http://%s:%d (model %s loading)", server_args.host, server_args.port,
                server_args.model_name)
    server.run(sockets=[listener])
    error = app.state.kvpilot.client.error
    if error is not None:
        typer.echo(f"error: {error}", err=True)
        return 1
    return 0

"""`kvpilot serve`: the OpenAI-compatible server (registered by kvpilot.cli as `app.command("serve")`).

Flags are named like `vllm serve`'s where the concept is the same; engine flags are shared with
`generate` and `chat` through kvpilot.cli_options.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from kvpilot.cli_options import (AsyncSchedulingOpt, AttentionBackendOpt, BlockSizeOpt, CalculateKvScalesOpt,
                                 CompilationConfigOpt, CudaGraphSizesOpt,
                                 DeviceOpt, DisableHybridKvOpt, DownloadDirOpt, DtypeOpt, EnforceEagerOpt,
                                 GgufFileOpt, GpuUtilOpt,
                                 KvCacheDtypeOpt, KvCacheMemoryOpt, KvOffloadDirOpt, KvOffloadDirSizeOpt,
                                 KvOffloadingBackendOpt, KvOffloadingSizeOpt, KvOffloadOverlapOpt, KvRoleOpt,
                                 KvTransferConfigOpt, KvTransferHostOpt, KvTransferPortOpt, KvTransferTimeoutOpt,
                                 LoadFormatOpt, MaxBatchedTokensOpt, MaxModelLenOpt, MaxNumSeqsOpt, ModelOpt,
                                 PolicyOpt, PrefixCachingOpt, PromptGemmDtypeOpt, QuantizationOpt, RevisionOpt,
                                 SeedOpt, SpeculativeConfigOpt, TensorParallelOpt, parse_cuda_graph_sizes)
from kvpilot.server.serve_flags import (ApiKeyOpt, AutoToolChoiceOpt, BodyTimeoutOpt, DrainTimeoutOpt,
                                        EngineProcessOpt, HeaderTimeoutOpt, HostOpt, KeepAliveTimeoutOpt,
                                        KvEventsConfigOpt, LogPromptsOpt, MaxQueuedReqsOpt, MaxQueuedTokensOpt,
                                        MaxRequestBodyOpt, MaxTokensDefaultOpt, MetricsPublicOpt, NumReplicasOpt,
                                        OtlpTracesEndpointOpt, PortOpt, RayAddressOpt, RayConfigOpt, RayOpt,
                                        ReasoningParserOpt, RoutingOpt, ServedModelNameOpt, ToolCallParserOpt,
                                        UvicornLogLevelOpt)

if TYPE_CHECKING:
    from kvpilot.launch.args import EngineArgs
    from kvpilot.server.config import ServerArgs

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
    revision: RevisionOpt = None, download_dir: DownloadDirOpt = None, gguf_file: GgufFileOpt = None,
    quantization: QuantizationOpt = "auto", prompt_gemm_dtype: PromptGemmDtypeOpt = "auto",
    max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = 256,
    max_num_batched_tokens: MaxBatchedTokensOpt = None, kv_cache_memory: KvCacheMemoryOpt = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto", calculate_kv_scales: CalculateKvScalesOpt = True,
    gpu_memory_utilization: GpuUtilOpt = 0.9, block_size: BlockSizeOpt = 16,
    kv_offloading_size: KvOffloadingSizeOpt = None,
    kv_offloading_backend: KvOffloadingBackendOpt = "native", kv_offload_dir: KvOffloadDirOpt = None,
    kv_offload_dir_size: KvOffloadDirSizeOpt = None, kv_offload_overlap: KvOffloadOverlapOpt = True,
    kv_role: KvRoleOpt = None, disable_hybrid_kv_cache_manager: DisableHybridKvOpt = False,
    kv_transfer_config: KvTransferConfigOpt = None, kv_transfer_port: KvTransferPortOpt = None,
    kv_transfer_host: KvTransferHostOpt = None, kv_transfer_timeout: KvTransferTimeoutOpt = 120.0,
    enable_prefix_caching: PrefixCachingOpt = True, scheduling_policy: PolicyOpt = "fcfs", seed: SeedOpt = 0,
    attention_backend: AttentionBackendOpt = "auto", async_scheduling: AsyncSchedulingOpt = None,
    enforce_eager: EnforceEagerOpt = False, cuda_graph_sizes: CudaGraphSizesOpt = None,
    compilation_config: CompilationConfigOpt = None, tensor_parallel_size: TensorParallelOpt = 1,
    speculative_config: SpeculativeConfigOpt = None,
    host: HostOpt = "127.0.0.1", port: PortOpt = 8000, served_model_name: ServedModelNameOpt = None,
    api_key: ApiKeyOpt = None, metrics_public: MetricsPublicOpt = False,
    max_num_queued_reqs: MaxQueuedReqsOpt = None, max_num_queued_tokens: MaxQueuedTokensOpt = None,
    max_request_body_bytes: MaxRequestBodyOpt = DEFAULT_MAX_REQUEST_BODY_BYTES,
    header_timeout: HeaderTimeoutOpt = 10.0, body_timeout: BodyTimeoutOpt = 30.0,
    keep_alive_timeout: KeepAliveTimeoutOpt = 5.0, drain_timeout: DrainTimeoutOpt = 30.0,
    max_tokens_default: MaxTokensDefaultOpt = DEFAULT_MAX_TOKENS_DEFAULT,
    enable_auto_tool_choice: AutoToolChoiceOpt = None, tool_call_parser: ToolCallParserOpt = None,
    reasoning_parser: ReasoningParserOpt = None,
    log_prompts: LogPromptsOpt = False, kv_events_config: KvEventsConfigOpt = None,
    otlp_traces_endpoint: OtlpTracesEndpointOpt = None, engine_process: EngineProcessOpt = True,
    uvicorn_log_level: UvicornLogLevelOpt = "warning",
    ray: RayOpt = False, num_replicas: NumReplicasOpt = None, ray_config: RayConfigOpt = None,
    routing: RoutingOpt = None, ray_address: RayAddressOpt = None,
) -> None:
    """Start the OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics, /health)."""
    # (the docstring is the --help text) Every flag is checked, exit 2 on a bad one, before anything loads.
    from kvpilot.engine.config import EngineConfigError
    from kvpilot.server.config import ServerConfigError

    try:
        engine_args = _engine_args(
            model=model, load_format=load_format, dtype=dtype, device=device, revision=revision,
            download_dir=download_dir, gguf_file=gguf_file, quantization=quantization,
            prompt_gemm_dtype=prompt_gemm_dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy, seed=seed,
            attention_backend=attention_backend, async_scheduling=async_scheduling, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size, cuda_graph_sizes=parse_cuda_graph_sizes(cuda_graph_sizes),
            compilation_config=compilation_config,
            kv_events_config=kv_events_config, speculative_config=speculative_config,
            kv_offloading_size=kv_offloading_size, kv_offloading_backend=kv_offloading_backend,
            kv_offload_dir=kv_offload_dir, kv_offload_dir_size=kv_offload_dir_size,
            kv_offload_overlap=kv_offload_overlap, kv_role=kv_role,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            kv_transfer_config=kv_transfer_config, kv_transfer_port=kv_transfer_port,
            kv_transfer_host=_kv_transfer_host(kv_transfer_host, kv_transfer_config, host),
            kv_transfer_timeout=kv_transfer_timeout)
        _check_tracing(otlp_traces_endpoint)
        if not ray:  # Ray's replicas read the model on their own nodes
            _check_local_model(model, load_format)
        server_args = _server_args(
            model, max_num_seqs, host=host, port=port, served_model_name=served_model_name, api_key=api_key,
            metrics_public=metrics_public, max_num_queued_reqs=max_num_queued_reqs,
            max_num_queued_tokens=max_num_queued_tokens, max_request_body_bytes=max_request_body_bytes,
            header_timeout_s=header_timeout, body_timeout_s=body_timeout, keep_alive_timeout_s=keep_alive_timeout,
            drain_timeout=drain_timeout, log_prompts=log_prompts, engine_process=engine_process,
            otlp_traces_endpoint=otlp_traces_endpoint, max_tokens_default=max_tokens_default,
            enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser)
    except (EngineConfigError, ServerConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    ray_flags = RayFlags(ray, num_replicas, ray_config, routing, ray_address)
    raise typer.Exit(_serve(engine_args, server_args, ray_flags, uvicorn_log_level))


def _kv_transfer_host(flag: str | None, transfer_config: str | None, host: str) -> str | None:
    """--kv-transfer-host, else kv_transfer_config's kv_ip, else --host unless a wildcard (None: 127.0.0.1)."""
    import json

    if flag is not None:
        return flag
    try:
        if transfer_config and (json.loads(transfer_config) or {}).get("kv_ip"):
            return None  # EngineArgs.kv_transfer takes it from the config
    except (ValueError, AttributeError):
        return None  # EngineArgs.kv_transfer names the malformed config
    return host if host not in ("0.0.0.0", "::", "") else None


def _engine_args(kv_events_config: str | None, **flags: Any) -> EngineArgs:
    """The engine's flags as a checked EngineArgs (raises EngineConfigError on a bad one)."""
    from kvpilot.engine.kv_events_config import KVEventsConfig
    from kvpilot.launch.args import EngineArgs

    engine_args = EngineArgs(**flags, usage_context="server",
                             kv_events_config=KVEventsConfig.parse(kv_events_config) if kv_events_config else None)
    engine_args.check()
    return engine_args


def _check_local_model(model: str | None, load_format: str) -> None:
    """A local --model that is not there fails here, before the port is bound and the engine spends seconds
    loading torch to find out (EngineConfigError)."""
    from kvpilot.engine.config import EngineConfigError
    from kvpilot.model.errors import ModelLoadError
    from kvpilot.model.hub import check_local_model

    try:
        check_local_model(model, load_format)
    except ModelLoadError as exc:
        raise EngineConfigError(str(exc)) from exc


def _check_tracing(otlp_traces_endpoint: str | None) -> None:
    """Fails here, before the port is bound or the model loaded, on a bad endpoint or missing OTel packages."""
    if not otlp_traces_endpoint:
        return
    from kvpilot.server.observe.tracing import check_tracing_available, otlp_traces_url

    otlp_traces_url(otlp_traces_endpoint)
    check_tracing_available()


def _server_args(model: str | None, max_num_seqs: int, *, served_model_name: list[str] | None,
                 max_num_queued_reqs: int | None, max_num_queued_tokens: int | None,
                 otlp_traces_endpoint: str | None, max_tokens_default: int, **flags: Any) -> ServerArgs:
    """The HTTP side's flags as ServerArgs (raises ServerConfigError on a bad one). A 0 (or empty) flag means
    "no limit" (None) where its help says so."""
    from kvpilot.server.config import ServerArgs, served_names

    return ServerArgs(served_model_names=served_names(served_model_name, model),
                      max_num_queued_reqs=_queue_cap(max_num_queued_reqs, max_num_seqs),
                      max_num_queued_tokens=max_num_queued_tokens or None,
                      otlp_traces_endpoint=otlp_traces_endpoint or None,
                      max_tokens_default=max_tokens_default or None, **flags)


@dataclass(frozen=True)
class RayFlags:
    """--ray and the flags that only mean something with it (None: not given)."""

    on: bool
    num_replicas: int | None
    config_path: str | None
    routing: str | None
    address: str | None

    def given_without_ray(self) -> bool:
        return not self.on and any(v is not None for v in (self.num_replicas, self.config_path, self.routing,
                                                             self.address))


def _serve(engine_args: EngineArgs, server_args: ServerArgs, ray_flags: RayFlags, uvicorn_log_level: str) -> int:
    """Serves on Ray or in this process (run_server) and returns the exit code; 2 for Ray flags without --ray."""
    if ray_flags.on:
        return _run_on_ray(engine_args, server_args, ray_flags)
    if ray_flags.given_without_ray():
        typer.echo("error: --num-replicas, --ray-config, --routing and --ray-address need --ray", err=True)
        return 2
    return run_server(engine_args, server_args, uvicorn_log_level)


def _run_on_ray(engine_args: EngineArgs, server_args: ServerArgs, flags: RayFlags) -> int:
    from kvpilot.server.ray_app.config import RayConfigError
    from kvpilot.server.ray_app.launch import RayLaunch, run_ray_server

    launch = RayLaunch(flags.num_replicas, flags.config_path, flags.routing, flags.address)
    try:
        return run_ray_server(engine_args, server_args, launch)
    except RayConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2


def run_server(engine_args: EngineArgs, server_args: ServerArgs, uvicorn_log_level: str = "warning") -> int:
    """Serves until SIGTERM/SIGINT (drained) and returns the exit code: 0, or 1 if the engine failed or the
    address is taken (checked before the model loads)."""
    import uvicorn

    from kvpilot.server.app import create_app
    from kvpilot.server.drain import DrainingServer
    from kvpilot.server.core.engine_spec import engine_factory
    from kvpilot.server.gc_heap import freeze_startup_heap
    from kvpilot.server.guards.listen import PortInUseError, bind_listener
    from kvpilot.server.observe.log_writer import detach_output, stacks_on_sigusr1
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
    stacks_on_sigusr1()
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

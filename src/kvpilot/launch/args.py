"""EngineArgs: every engine setting, named like the server flags (and vLLM's), validated in one place.

Torch-free, so the HTTP process validates a server's flags without importing the model; `launch/build.py`
(`build_engine(args)`) loads the model, sizes the KV cache and wires scheduler + runner into an LLMEngine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvpilot.engine.config import CacheConfig, EngineConfigError, SchedulerConfig
from kvpilot.engine.kv_events_config import KVEventsConfig
from kvpilot.engine.kv_transfer import KVTransferConfig, KVTransferParamsError, role_of_vllm_config
from kvpilot.engine.spec_config import SpeculativeConfig
from kvpilot.fit.memory import CPU_DEFAULT_KV_CACHE_BYTES
from kvpilot.memory_size import parse_memory_size
from kvpilot.model.choices import ATTENTION_BACKENDS, check_kv_cache_dtype, check_prompt_gemm_dtype, cuda_graph_sizes
from kvpilot.model.compilation_config import CompilationConfig

# Like vLLM's VLLM_CPU_KVCACHE_SPACE (4 GiB there), 2 GiB here: RSS matters on small boxes. Defined in `fit`
# so the planner and the engine use one number.
DEFAULT_CPU_KV_CACHE_BYTES = CPU_DEFAULT_KV_CACHE_BYTES
DEFAULT_KV_OFFLOAD_DIR_SIZE = "10GiB"  # --kv-offload-dir without --kv-offload-dir-size
_PLAIN_NUMBER = re.compile(r"^[0-9]*\.?[0-9]+$")  # --kv-offloading-size 8: GiB, as vLLM reads it
USAGE_CONTEXTS = ("llm", "server")  # offline LLM(), or a server (kvpilot serve, Ray lanes): model/step_budget.py


@dataclass(kw_only=True)
class EngineArgs:
    """Engine settings. None means "derive a sensible value" (documented per field in the CLI help)."""

    model: str | None = None
    load_format: str = "auto"
    # a Hugging Face Hub id's download (kvpilot.model.hub): branch/tag/commit, cache folder, GGUF file name
    revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"  # CPU: auto (bf16: + dense copy) / gguf keep a GGUF's Q8_0/Q4_0/Q4_1 packed; none;
    # int8/int4 (CPU, at load); fp8 (Hopper/Ada GPUs: e4m3 weights per channel, activations per token);
    # awq/gptq/fp8/compressed-tensors: a pre-quantized HF checkpoint's own (auto reads it too)
    prompt_gemm_dtype: str = "auto"  # CPU, packed weights, bf16: prompt GEMMs in bf16 or float32 (auto: measured)
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = True  # fp8 KV: per-layer, per-head scales from the first step (False: 1.0)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    attention_backend: str = "auto"
    async_scheduling: bool | None = None  # None: on where the device computes asynchronously (CUDA)
    tensor_parallel_size: int = 1  # ranks sharing each layer (CPU: gloo, one process per rank)
    enforce_eager: bool = False  # CUDA: no CUDA graphs (decode steps launch their kernels one by one)
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes to capture; None: 1, 2, 4, 8, 16k..
    # vLLM's dict (or JSON text): cudagraph_mode (FULL_AND_PIECEWISE, FULL_DECODE_ONLY, PIECEWISE, NONE) and the
    # sizes graphs are captured at (model/compilation_config.py)
    compilation_config: CompilationConfig | dict | str | None = None
    kv_events_config: KVEventsConfig | None = None  # publish KV-cache events (the engine core process does)
    usage_context: str = "llm"  # "llm" (offline) or "server": picks defaults that differ (step_budget.py)
    # speculative decoding, vLLM's dict (or its JSON text): {"method": "ngram", "num_speculative_tokens": 4, ...}
    speculative_config: SpeculativeConfig | dict | str | None = None
    # KV offload (vLLM's flags): a host-memory tier for evicted prefix blocks, in GiB (a number, as vLLM) or
    # with a unit ("512MiB"); None: off. Backend "native" only (vLLM's other one, lmcache, is not built in).
    kv_offloading_size: float | str | None = None
    kv_offloading_backend: str = "native"
    # a local-disk tier below the host tier: its folder, and its size (DEFAULT_KV_OFFLOAD_DIR_SIZE if None)
    kv_offload_dir: str | None = None
    kv_offload_dir_size: str | int | None = None
    # a waiting request's tier loads run beside a step of the running requests (False: before its own step)
    kv_offload_overlap: bool = True
    # prefill/decode disaggregation (engine/kv_transfer.py): this worker's role (None: off), or vLLM's
    # --kv-transfer-config dict/JSON mapped onto it; the KV sender's port (0: a free one), the address it
    # advertises (None: kv_transfer_config's kv_ip, else 127.0.0.1), and how long held blocks wait for a pull
    kv_role: str | None = None
    # vLLM's flag: keep an interleaved model (Gemma 2/3, gpt-oss) in one KV group, its sliding layers' blocks
    # kept for the whole context like the full layers' (engine/kv_groups.py); default: a group per layer kind
    disable_hybrid_kv_cache_manager: bool = False
    kv_transfer_config: dict | str | None = None
    kv_transfer_port: int | None = None
    kv_transfer_host: str | None = None
    kv_transfer_timeout: float = 120.0

    def kv_offload_bytes(self) -> tuple[int, int]:
        """(host tier bytes, disk tier bytes), 0 where off; ValueError naming the flag for a bad size."""
        host = 0
        if self.kv_offloading_size is not None:
            size = self.kv_offloading_size
            if isinstance(size, str) and _PLAIN_NUMBER.match(size.strip()):
                size = float(size)
            host = parse_memory_size(size * 2**30 if isinstance(size, (int, float)) and not isinstance(size, bool)
                                     else size, "kv_offloading_size")
        disk = 0
        if self.kv_offload_dir is not None:
            disk = parse_memory_size(self.kv_offload_dir_size if self.kv_offload_dir_size is not None
                                     else DEFAULT_KV_OFFLOAD_DIR_SIZE, "kv_offload_dir_size")
        return host, disk

    def kv_transfer(self) -> KVTransferConfig | None:
        """The disaggregation settings, None when off; EngineConfigError naming what is accepted."""
        role, host, port = self.kv_role, self.kv_transfer_host, self.kv_transfer_port
        config = self.kv_transfer_config
        try:
            if config is not None:
                parsed = json.loads(config) if isinstance(config, str) else config
                if not isinstance(parsed, dict):
                    raise KVTransferParamsError("kv_transfer_config must be a JSON object")
                vllm_role, ip, vllm_port = role_of_vllm_config(parsed)
                if role is not None and role != vllm_role:
                    raise KVTransferParamsError(f"kv_role {role!r} contradicts kv_transfer_config's "
                                                f"{parsed['kv_role']!r}: give one of them")
                role, host, port = vllm_role, host or ip, port if port is not None else vllm_port
            if role is None:
                return None
            return KVTransferConfig(role, host or "127.0.0.1", port or 0, float(self.kv_transfer_timeout))
        except (KVTransferParamsError, ValueError) as exc:
            raise EngineConfigError(str(exc)) from exc

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, parsed and checked (EngineConfigError naming the field); None: off."""
        return SpeculativeConfig.of(self.speculative_config)

    @property
    def compilation(self) -> CompilationConfig:
        """compilation_config, parsed and checked (EngineConfigError naming the field)."""
        try:
            return CompilationConfig.of(self.compilation_config)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc

    def check(self) -> None:
        """Validates what can be checked before loading the model; EngineConfigError names the setting."""
        if self.usage_context not in USAGE_CONTEXTS:
            raise EngineConfigError(f"usage_context must be 'llm' or 'server', got {self.usage_context!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            try:
                parse_memory_size(self.kv_cache_memory, "kv_cache_memory")
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from exc
        try:
            check_kv_cache_dtype(self.kv_cache_dtype)
            check_prompt_gemm_dtype(self.prompt_gemm_dtype)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise EngineConfigError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise EngineConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                                    f"{self.attention_backend!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise EngineConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.quantization not in ("auto", "none"):
            raise EngineConfigError(f"tensor parallelism shards dense weights: --quantization {self.quantization} "
                                    "keeps packed ones; use --quantization none (or auto)")
        compilation = self.compilation  # EngineConfigError for a bad compilation_config
        if self.cuda_graph_sizes is not None:
            try:
                cuda_graph_sizes(self.max_num_seqs, self.cuda_graph_sizes)
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from exc
            if compilation.cudagraph_capture_sizes is not None:
                raise EngineConfigError("cuda_graph_sizes and compilation_config's cudagraph_capture_sizes both "
                                        "set the decode graphs' sizes: give one of them")
        self._check_speculative()
        self._check_offload()
        if self.kv_transfer() is not None and self.tensor_parallel_size > 1:  # the sender reads one rank's cache
            raise EngineConfigError("kv_role (disaggregation) with tensor_parallel_size > 1 is not supported yet")
        CacheConfig(num_blocks=1, block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching)
        SchedulerConfig(max_model_len=1, max_num_seqs=self.max_num_seqs,
                        max_num_batched_tokens=self.max_num_batched_tokens or max(2048, self.max_num_seqs),
                        scheduling_policy=self.scheduling_policy)

    def _check_offload(self) -> None:
        if self.kv_offloading_backend != "native":
            raise EngineConfigError(f"kv_offloading_backend {self.kv_offloading_backend!r} is not supported: "
                                    "kvpilot has its own ('native'); LMCache is not built in")
        try:
            host, disk = self.kv_offload_bytes()
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from exc
        if self.kv_offload_dir_size is not None and self.kv_offload_dir is None:
            raise EngineConfigError("kv_offload_dir_size sizes the disk tier: give kv_offload_dir too")
        if disk and not host:
            raise EngineConfigError("the disk tier (kv_offload_dir) sits below the host tier: give "
                                    "kv_offloading_size too")
        if host and not self.enable_prefix_caching:
            raise EngineConfigError("KV offload keeps prefix blocks by their hashes: it needs prefix caching "
                                    "(drop --no-enable-prefix-caching, or --kv-offloading-size)")

    def _check_speculative(self) -> None:
        if self.speculative is None:
            return
        if self.async_scheduling:  # a verification's accepted tokens decide what the next step computes
            raise EngineConfigError("speculative_config needs synchronous scheduling: leave async_scheduling "
                                    "unset (--no-async-scheduling is then chosen) or turn speculation off")
        if self.tensor_parallel_size > 1 and self.speculative.method != "ngram":
            # n-gram drafts come from the scheduler, in the diff every rank gets; a draft model's would be
            # computed on rank 0 alone, and the ranks' verify steps must compute the same tokens
            raise EngineConfigError(f"speculative_config method {self.speculative.method!r} with "
                                    "tensor_parallel_size > 1 is not supported yet: use \"method\": \"ngram\" "
                                    "with tensor parallelism, or one rank")

"""Memory model: what one device holds, the KV budget left over, and what that budget serves.

Per device (vLLM's own accounting, `gpu_worker.determine_available_memory`):
    kv_budget = total * gpu_memory_utilization - weights/num_devices - activation_peak - runtime
With a fixed KV size (vLLM --kv-cache-memory-bytes; on a CPU 2 GiB by default, as kvpilot serve
allocates) the utilization fraction is ignored and
    kv_budget = min(fixed size, total - weights/num_devices - activation_peak - runtime)
Constants (estimates; vLLM measures these at start-up and logs them, expect +-1 GiB per GPU):
- RUNTIME_GPU_BYTES 1 GiB: CUDA context, cuBLAS/NCCL workspaces (~0.5 GiB of "non-torch memory" in
  vLLM's profiling log) plus CUDA graphs (vLLM logs 0.3-1 GiB for "Graph capturing").
- RUNTIME_CPU_BYTES 0.5 GiB: Python, torch and tokenizer of the serving process (RSS before weights).
- Activation peak: one forward over max_num_batched_tokens tokens keeps, per token, the residual and
  normed hidden states, q/k/v, attention output, gate/up/activated MLP intermediates (compute dtype),
  plus fp32 logits and probabilities for max_num_seqs rows.
Parallelism: up to 8 devices are tensor-parallel (one node); beyond that, 8-way TP x pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.fit.errors import FitError
from kvpilot.fit.hardware import GIB, DeviceGroup
from kvpilot.fit.kv_cache import kv_bytes_per_sequence, kv_bytes_per_token
from kvpilot.fit.model_source import LoadedModel
from kvpilot.fit.model_spec import ModelSpec
from kvpilot.fit.weight_formats import compute_dtype, device_dtype, dtype_bytes, kv_dtype_bytes
from kvpilot.fit.weights import WeightBytes, int8_packed, weight_bytes
from kvpilot.fit.workload import FitInputs

# kvpilot serve on a CPU allocates a fixed KV cache unless told otherwise (vLLM's CPU backend does the
# same with VLLM_CPU_KVCACHE_SPACE); the engine's default, kept here so plan and server agree.
CPU_DEFAULT_KV_CACHE_BYTES = 2 * GIB
RUNTIME_GPU_BYTES = 1 * GIB
RUNTIME_CPU_BYTES = GIB // 2
MAX_TENSOR_PARALLEL = 8


@dataclass(frozen=True)
class Parallelism:
    """Invariant: tensor_parallel_size * pipeline_parallel_size == number of devices."""

    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def parallelism_for(spec: ModelSpec, num_devices: int) -> Parallelism:
    """TP within a node (must divide the attention heads, as vLLM requires), pipeline stages beyond."""
    tp = min(num_devices, MAX_TENSOR_PARALLEL)
    if num_devices % tp:
        raise FitError(f"{num_devices} devices: use a multiple of {MAX_TENSOR_PARALLEL} beyond one node.")
    if spec.num_attention_heads % tp:
        raise FitError(f"tensor parallel size {tp} must divide the model's {spec.num_attention_heads} attention heads.")
    return Parallelism(tp, num_devices // tp)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory and the capacity it leaves. Bytes are per device; kv_budget may be negative
    (then nothing fits). Invariant: num_kv_tokens == num_kv_blocks * block_size."""

    parallelism: Parallelism
    weights: WeightBytes
    total_bytes: int
    budget_bytes: int  # total * utilization, or total when the KV size is fixed
    fixed_kv_bytes: int | None  # the requested fixed KV size (--kv-cache-memory or the CPU default)
    weight_bytes_per_device: int
    activation_bytes: int
    runtime_bytes: int
    kv_budget_bytes: int
    kv_dtype_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_request: int  # one request of input_len + output_len tokens
    max_num_requests: int  # requests of input_len + output_len that fit at once
    max_context_at_concurrency: int  # longest sequence when `concurrency` requests share the cache
    max_context_single_request: int  # longest sequence that fits alone (capped at max_model_len)
    max_model_len: int
    concurrency: int

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def weights_fit(self) -> bool:
        return self.kv_budget_bytes > 0

    @property
    def max_model_len_fits(self) -> bool:
        """vLLM refuses to start unless one max_model_len request fits in the KV cache."""
        return self.max_context_single_request >= self.max_model_len

    @property
    def fits_workload(self) -> bool:
        return self.max_num_requests >= self.concurrency

    @property
    def workload_margin_bytes(self) -> int:
        """KV bytes left (negative: missing) with `concurrency` requests of the workload in flight."""
        return self.kv_budget_bytes - self.concurrency * self.kv_bytes_per_request


def activation_bytes(spec: ModelSpec, inputs: FitInputs, act_bytes: int, tp: int) -> int:
    """Peak activation estimate for one step of max_num_batched_tokens tokens (see module docstring)."""
    h, hd = spec.hidden_size, spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * hd
    attn_out = spec.num_attention_heads * hd
    if spec.moe is not None:
        inter = spec.moe.expert_intermediate_size * (spec.moe.num_experts_per_tok + spec.moe.num_shared_experts)
    else:
        inter = spec.intermediate_size
    per_token = 2 * h + (qkv + attn_out + 3 * inter) / tp
    logits = inputs.max_num_seqs * spec.vocab_size * 4 * 2
    return round(inputs.max_num_batched_tokens * per_token * act_bytes + logits)


def _max_context(spec: ModelSpec, budget: int, concurrency: int, kvb: int, tp: int, pp: int,
                 block: int, limit: int) -> int:
    """Longest sequence such that `concurrency` of them fit in `budget` (binary search; 0 if none)."""
    def fits(n: int) -> bool:
        return concurrency * math.ceil(kv_bytes_per_sequence(spec, n, kvb, tp, block) / pp) <= budget
    if budget <= 0 or not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_memory(model: LoadedModel, group: DeviceGroup, inputs: FitInputs) -> MemoryPlan:
    """Memory plan for `model` on `group` (all devices identical). Raises FitError on bad dtypes."""
    spec = model.spec
    par = parallelism_for(spec, group.count)
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    # a CPU's auto: bf16 or fp32, as kvpilot picks
    dtype = device_dtype(inputs.dtype, group.device.is_gpu, int8_packed=int8_packed(model, inputs.weight_dtype))
    weights = weight_bytes(model, inputs.weight_dtype, dtype, on_gpu=group.device.is_gpu)
    kvb = kv_dtype_bytes(inputs.kv_cache_dtype, spec, dtype)
    act = activation_bytes(spec, inputs, dtype_bytes(compute_dtype(spec, dtype)), tp)
    runtime = RUNTIME_GPU_BYTES if group.device.is_gpu else RUNTIME_CPU_BYTES
    total = group.device.memory_bytes
    # A fixed KV size replaces the utilization fraction, as in vLLM; it cannot exceed what is free.
    fixed_kv = inputs.kv_cache_memory_bytes
    if fixed_kv is None and not group.device.is_gpu:
        fixed_kv = CPU_DEFAULT_KV_CACHE_BYTES
    budget = total if fixed_kv is not None else math.floor(total * inputs.gpu_memory_utilization)
    weights_per_device = math.ceil(weights.num_bytes / par.num_devices)
    kv_budget = budget - weights_per_device - act - runtime
    if fixed_kv is not None:
        kv_budget = min(kv_budget, fixed_kv)
    per_token = math.ceil(kv_bytes_per_token(spec, kvb, tp) / pp)
    num_blocks = max(0, kv_budget // (per_token * inputs.block_size))
    limit = inputs.max_model_len or model.context_length
    per_request = math.ceil(kv_bytes_per_sequence(spec, inputs.seq_len, kvb, tp, inputs.block_size) / pp)
    plan = MemoryPlan(
        parallelism=par,
        weights=weights,
        total_bytes=total,
        budget_bytes=budget,
        fixed_kv_bytes=fixed_kv,
        weight_bytes_per_device=weights_per_device,
        activation_bytes=act,
        runtime_bytes=runtime,
        kv_budget_bytes=kv_budget,
        kv_dtype_bytes=kvb,
        kv_bytes_per_token=per_token,
        block_size=inputs.block_size,
        num_kv_blocks=num_blocks,
        kv_bytes_per_request=per_request,
        max_num_requests=max(0, kv_budget // per_request) if kv_budget > 0 else 0,
        max_context_at_concurrency=_max_context(spec, kv_budget, inputs.concurrency, kvb, tp, pp,
                                                inputs.block_size, limit),
        max_context_single_request=_max_context(spec, kv_budget, 1, kvb, tp, pp, inputs.block_size, limit),
        max_model_len=limit,
        concurrency=inputs.concurrency,
    )
    return plan

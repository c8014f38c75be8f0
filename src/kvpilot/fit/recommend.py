"""Recommended serving flags (vLLM names; kvpilot serve uses the same names) from a memory plan."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.memory import MemoryPlan
from kvpilot.fit.workload import FitInputs


@dataclass(frozen=True)
class RecommendedFlags:
    """Flags under which the server starts and serves the workload without preemption.
    Invariant: max_model_len fits one request; max_num_seqs requests of the workload fit together."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    kv_cache_dtype: str
    block_size: int
    quantization: str | None  # vLLM --quantization for on-the-fly fp8; None otherwise
    kv_cache_memory_bytes: int | None  # fixed KV size (replaces the utilization fraction)

    def vllm_args(self) -> list[str]:
        args = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            args += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.kv_cache_memory_bytes is None:
            args += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        else:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        args += ["--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                 "--kv-cache-dtype", self.kv_cache_dtype, "--block-size", str(self.block_size)]
        if self.quantization:
            args += ["--quantization", self.quantization]
        return args

    def kvpilot_args(self) -> list[str]:
        """kvpilot's engine flags (one device, no parallelism; its KV cache is in the compute dtype)."""
        if self.kv_cache_memory_bytes is None:
            memory = ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        else:
            memory = ["--kv-cache-memory", _size_text(self.kv_cache_memory_bytes)]
        return [*memory, "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--block-size", str(self.block_size)]


def _size_text(num_bytes: int) -> str:
    """Bytes in kvpilot's size syntax: '2GiB', '512MiB', or the plain count."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def recommend_flags(plan: MemoryPlan, inputs: FitInputs, checkpoint_quantization: str | None) -> RecommendedFlags:
    """Flags for a plan whose weights fit (callers check `plan.weights_fit` first)."""
    quantization = "fp8" if plan.weights.format_name == "fp8" and checkpoint_quantization != "fp8" else None
    return RecommendedFlags(
        tensor_parallel_size=plan.parallelism.tensor_parallel_size,
        pipeline_parallel_size=plan.parallelism.pipeline_parallel_size,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        max_model_len=min(plan.max_model_len, plan.max_context_single_request),
        # no more than fit without preemption, nor than the activation estimate assumed
        max_num_seqs=max(1, min(plan.max_num_requests, inputs.max_num_seqs)),
        kv_cache_dtype=inputs.kv_cache_dtype,
        block_size=inputs.block_size,
        quantization=quantization,
        kv_cache_memory_bytes=plan.fixed_kv_bytes,
    )

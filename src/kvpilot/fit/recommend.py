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

    def vllm_args(self) -> list[str]:
        args = [
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--kv-cache-dtype", self.kv_cache_dtype,
        ]
        if self.pipeline_parallel_size > 1:
            args += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.quantization:
            args += ["--quantization", self.quantization]
        return args

    def kvpilot_args(self) -> list[str]:
        """kvpilot serve runs one device: no parallelism flags."""
        return [
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--kv-cache-dtype", self.kv_cache_dtype,
            "--block-size", str(self.block_size),
        ]


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
    )

"""FitInputs: the user's deployment choices and workload, with vLLM's defaults and flag names."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.errors import FitError

# vLLM's default for --gpu-memory-utilization (fraction of total GPU memory the engine may use).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# vLLM's default paged-attention block size on GPUs.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class FitInputs:
    """Deployment knobs and workload shape. Invariant (checked by `validate`): lengths and limits
    positive, 0 < gpu_memory_utilization <= 1."""

    weight_dtype: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None  # fixed KV budget per device (vLLM --kv-cache-memory-bytes)
    input_len: int = 1024
    output_len: int = 256
    concurrency: int = 16  # target number of requests in flight
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = 8192  # tokens per engine step: sizes the activation peak
    max_num_seqs: int = 256  # sequences per step: sizes the logits buffer
    price_per_hour: float | None = None  # per device, in any currency

    @property
    def seq_len(self) -> int:
        return self.input_len + self.output_len

    def validate(self) -> FitInputs:
        positive = {
            "--input-len": self.input_len, "--output-len": self.output_len,
            "--concurrency": self.concurrency, "--block-size": self.block_size,
            "--max-num-batched-tokens": self.max_num_batched_tokens, "--max-num-seqs": self.max_num_seqs,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise FitError(f"{flag} must be a positive integer, got {value}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise FitError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise FitError(f"--max-model-len must be positive, got {self.max_model_len}.")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise FitError(f"--price-per-hour must not be negative, got {self.price_per_hour}.")
        return self

"""EngineInfo: the served engine's fixed facts, built once by the engine core and sent to the server at start.

Torch-free and picklable: the HTTP side reads these instead of the engine (which may live in another process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV cache as allocated, computed once when the engine is built.

    Invariants: num_blocks >= 1; bytes_per_block = 2 (K and V) * num_cache_layers * block_size *
    num_key_value_heads * head_dim * dtype_bytes, num_cache_layers being num_hidden_layers (0 here) unless the
    model's layers form several KV groups (engine/kv_groups.py: then a group's size); kv_group_windows the
    groups' windows (None: full attention) when any layer slides, else (); `budget_bytes` is the memory the
    cache was sized from (kv_cache_memory, the CPU default, or on CUDA what was allocated from
    gpu_memory_utilization).
    """

    dtype: str
    dtype_bytes: int
    block_size: int
    num_blocks: int
    bytes_per_block: int
    budget_bytes: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    num_offload_blocks: int = 0  # KV offload's host tier (vLLM's num_cpu_blocks); 0: off
    num_disk_offload_blocks: int = 0
    num_cache_layers: int = 0
    kv_group_windows: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class EngineInfo:
    """Fixed at start-up. `vocab_size` bounds valid prompt token ids; `max_model_len` prompt + output.
    `max_num_seqs`, `enable_prefix_caching` and `dtype` (weights) are reported for tools (`kvpilot doctor`);
    `fit_model` / `fit_device` name the model and device as `kvpilot fit` takes them (a GGUF file or model
    directory, a catalog name; "cpu" or a catalog GPU; "" when unknown), so the doctor can draw the roofline
    without --model/--gpu. `prompt_gemm_dtype`: the dtype CPU prompt GEMMs run in (measured at load for bf16
    activations, model/layers/prompt_gemm.py; "" on GPUs). `quantization`: how the linear weights are held
    ("none", "gguf", "int8", "int4", "fp8"); `weight_bits`: bits a weight takes as the decode reads it (0:
    unknown), so the doctor does not advise quantizing weights that already are."""

    model: str
    max_model_len: int
    max_num_batched_tokens: int
    vocab_size: int
    kv: KVCacheInfo
    max_num_seqs: int = 0
    enable_prefix_caching: bool = True
    dtype: str = ""
    fit_model: str = ""
    fit_device: str = ""
    prompt_gemm_dtype: str = ""
    quantization: str = ""
    weight_bits: float = 0.0
    kv_role: str = ""  # disaggregation: --kv-role ("": off), so the HTTP side checks kv_transfer_params

    @property
    def capacity(self) -> dict[str, Any]:
        """The GET /v1/kvpilot/capacity JSON (the contract of fit/server_capacity.py)."""
        kv = self.kv
        return {"model": self.model, "num_hidden_layers": kv.num_hidden_layers,
                "num_key_value_heads": kv.num_key_value_heads, "head_dim": kv.head_dim,
                "kv_dtype_bytes": kv.dtype_bytes, "kv_cache_dtype": kv.dtype,
                "kv_cache_memory_bytes": kv.budget_bytes, "block_size": kv.block_size,
                "num_blocks": kv.num_blocks, "bytes_per_block": kv.bytes_per_block,
                "num_cache_layers": kv.num_cache_layers or kv.num_hidden_layers,
                "kv_group_windows": list(kv.kv_group_windows),
                "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "enable_prefix_caching": self.enable_prefix_caching, "dtype": self.dtype,
                "fit_model": self.fit_model, "fit_device": self.fit_device,
                "prompt_gemm_dtype": self.prompt_gemm_dtype, "quantization": self.quantization,
                "weight_bits": round(self.weight_bits, 2)}


@dataclass(frozen=True)
class EngineCapacity:
    """What the live engine's scheduler was configured with (the reply to CapacityQuery): lets tests and
    tools check the capacity endpoint against the engine itself, across the process boundary."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int

"""Bytes per parameter for weight formats (fp32 ... int4, GGUF block types) and KV-cache dtypes.

Constants and where they come from:
- fp8 (vLLM `--quantization fp8`, DeepSeek-V3's block fp8): 8 bits per linear weight; block scales
  (one fp32 per 128x128 block) add 0.002 bits and are ignored. Embeddings, lm_head and norms stay in
  the model dtype, as vLLM's fp8 method quantizes only linear layers.
- int8 (W8A8 / W8A16, per-output-channel scales): 8 bits; one fp16 scale per row is negligible.
- int4 (AWQ / GPTQ, group_size 128): 4 bits + one fp16 scale and one 4-bit zero point per 128 weights
  = 4.15625 bits per weight. Embeddings and lm_head stay 16-bit.
- GGUF block types (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...): bits = 8 * type_size / block_size from
  ggml's block layouts (`gguf.GGML_QUANT_SIZES`); llama.cpp also quantizes the embedding; norms are F32.
  Real GGUF files mix types per tensor: a GGUF file, and llama.cpp's mixes by name (q4_k_m, q8_0, ...), are
  sized tensor by tensor instead, as kvpilot holds them (weights.py, gguf_holding.py, gguf_mixes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.fit.errors import FitError, suggest
from kvpilot.fit.fingerprint import cpu_has_fast_bf16
from kvpilot.fit.gguf_mixes import MIXES
from kvpilot.fit.model_spec import ModelSpec

_DTYPE_BITS: dict[str, int] = {
    "fp32": 32, "float32": 32, "float": 32,
    "bf16": 16, "bfloat16": 16, "fp16": 16, "float16": 16, "half": 16,
}
_CANONICAL_DTYPE = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_INT4_GROUP_BITS = 4 + (16 + 4) / 128

# GGML integer and f64 types hold indices or metadata, never model weights.
_NOT_WEIGHT_TYPES = frozenset({"f64", "i8", "i16", "i32", "i64"})

_KV_DTYPE_BYTES: dict[str, int] = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class WeightFormat:
    """Storage bits per parameter by role. Invariant: all bit widths are > 0."""

    name: str
    bits_linear: float  # decoder-layer 2-D weights
    bits_embedding: float  # embedding table and untied lm_head
    bits_vector: float  # norms and biases


def canonical_dtype(dtype: str) -> str:
    """'bfloat16' -> 'bf16' etc.; FitError for a dtype that is not fp32/bf16/fp16."""
    key = dtype.strip().lower()
    if key not in _DTYPE_BITS:
        raise FitError(f"unknown dtype '{dtype}': use one of fp32, bf16, fp16 (or auto).")
    return _CANONICAL_DTYPE.get(key, key)


def compute_dtype(spec: ModelSpec, dtype: str = "auto") -> str:
    """Activation / KV dtype. `auto` follows the checkpoint but runs fp32 checkpoints in bf16,
    as vLLM does on GPUs."""
    if dtype != "auto":
        return canonical_dtype(dtype)
    resolved = canonical_dtype(spec.torch_dtype) if spec.torch_dtype.lower() in _DTYPE_BITS else "bf16"
    return "bf16" if resolved == "fp32" else resolved


def device_dtype(dtype: str, on_gpu: bool, cpu_fast_bf16: bool | None = None, int8_packed: bool = False) -> str:
    """--dtype as kvpilot takes it on the target: on a CPU "auto" is bf16 where the CPU computes bf16 natively or
    the model's linear weights all run packed on the int8 path (`int8_packed`: gguf_holding.int8_path_takes_all),
    else fp32 (model/dtypes.resolve_dtype), whatever the checkpoint's dtype; on a GPU, and any explicit dtype,
    unchanged. `cpu_fast_bf16` None: this machine's CPU (fit's CPU device is this machine)."""
    if on_gpu or dtype.strip().lower() != "auto":
        return dtype
    fast = cpu_has_fast_bf16() if cpu_fast_bf16 is None else cpu_fast_bf16
    return "bf16" if fast or int8_packed else "fp32"


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BITS[canonical_dtype(dtype)] // 8


def _gguf_type_bits() -> dict[str, float]:
    """GGML block types by lowercase name -> bits per weight (block layouts from the gguf package)."""
    from gguf import GGML_QUANT_SIZES

    return {qtype.name.lower(): 8 * type_size / block_size
            for qtype, (block_size, type_size) in GGML_QUANT_SIZES.items()
            if qtype.name.lower() not in _NOT_WEIGHT_TYPES}


def weight_format(name: str, spec: ModelSpec, dtype: str = "auto") -> WeightFormat:
    """Resolve `--weight-dtype`: auto, fp32, bf16, fp16, fp8, int8, int4 or a GGUF type (q4_k, q8_0...).

    `auto` is the checkpoint's own format: fp8 for fp8 checkpoints (DeepSeek-V3), else its dtype.
    """
    key = name.strip().lower()
    model_bits = 8 * dtype_bytes(compute_dtype(spec, dtype))
    if key == "auto":
        key = "fp8" if spec.checkpoint_quantization == "fp8" else compute_dtype(spec, dtype)
    if key in _DTYPE_BITS:
        bits = _DTYPE_BITS[key]
        return WeightFormat(canonical_dtype(key), bits, bits, bits)
    fixed = {"fp8": 8.0, "int8": 8.0, "int4": _INT4_GROUP_BITS}
    if key in fixed:
        return WeightFormat(key, fixed[key], model_bits, model_bits)
    gguf_bits = _gguf_type_bits()
    if key in gguf_bits:
        return WeightFormat(key, gguf_bits[key], gguf_bits[key], 32)
    choices = ["auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4", *MIXES, *gguf_bits]
    raise FitError(suggest(name, choices, "weight dtype"))


def kv_dtype_bytes(kv_cache_dtype: str, spec: ModelSpec, dtype: str = "auto") -> int:
    """Bytes per KV element for vLLM's `--kv-cache-dtype` values: auto (= compute dtype) or fp8*."""
    key = kv_cache_dtype.strip().lower()
    if key == "auto":
        return dtype_bytes(compute_dtype(spec, dtype))
    if key in _KV_DTYPE_BYTES:
        return _KV_DTYPE_BYTES[key]
    if key in _DTYPE_BITS:
        return _DTYPE_BITS[key] // 8
    raise FitError(suggest(kv_cache_dtype, ["auto", *_KV_DTYPE_BYTES, "bf16", "fp16", "fp32"], "kv cache dtype"))

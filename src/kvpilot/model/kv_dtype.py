"""`kv_cache_dtype`: how K/V are stored, independent of the compute dtype (like vLLM's --kv-cache-dtype).

A 2-byte or 1-byte KV cache holds 2-4x the tokens of a float32 one in the same memory, and on CPU makes
decode attention (memory-bound: it streams the whole cache every step) faster. Values are rounded when
stored and widened to the compute dtype when read, so outputs may differ slightly from "auto".
"""

from __future__ import annotations

import torch

from kvpilot.model.choices import KV_CACHE_DTYPE_NAMES, check_kv_cache_dtype

__all__ = ["FP8_DTYPES", "KV_CACHE_DTYPES", "check_kv_cache_dtype", "kv_dtype_name", "resolve_kv_cache_dtype"]

_TORCH_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's compute dtype
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
}
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {alias: _TORCH_DTYPES[name]
                                                   for alias, name in KV_CACHE_DTYPE_NAMES.items()}
FP8_DTYPES = (torch.float8_e4m3fn,)


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype K/V are stored in ("auto": the compute dtype)."""
    check_kv_cache_dtype(name)
    chosen = KV_CACHE_DTYPES[name.strip().lower()]
    return compute_dtype if chosen is None else chosen


def kv_dtype_name(dtype: torch.dtype) -> str:
    """Short name for logs and the capacity endpoint: float32, bfloat16, float16, fp8_e4m3."""
    return "fp8_e4m3" if dtype in FP8_DTYPES else str(dtype).removeprefix("torch.")

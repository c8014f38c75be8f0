"""`kv_cache_dtype`: how K/V are stored, independent of the compute dtype (like vLLM's --kv-cache-dtype).

A 2-byte or 1-byte KV cache holds 2-4x the tokens of a float32 one in the same memory, and on CPU makes
decode attention (memory-bound: it streams the whole cache every step) faster. Values are rounded when
stored and widened to the compute dtype when read, so outputs may differ slightly from "auto".
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's compute dtype
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
}
FP8_DTYPES = (torch.float8_e4m3fn,)


def check_kv_cache_dtype(name: str) -> None:
    """ValueError naming the accepted values when `name` is not one."""
    if name.strip().lower() not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8 (e4m3); got "
                         f"{name!r}")


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype K/V are stored in ("auto": the compute dtype)."""
    check_kv_cache_dtype(name)
    chosen = KV_CACHE_DTYPES[name.strip().lower()]
    return compute_dtype if chosen is None else chosen


def kv_dtype_name(dtype: torch.dtype) -> str:
    """Short name for logs and the capacity endpoint: float32, bfloat16, float16, fp8_e4m3."""
    return "fp8_e4m3" if dtype in FP8_DTYPES else str(dtype).removeprefix("torch.")

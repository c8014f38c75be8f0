"""Names the engine settings accept for model-side choices, torch-free: EngineArgs validates a server's flags
with them before the model (and torch) is ever imported in the HTTP process."""

from __future__ import annotations

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")

# kv_cache_dtype spellings -> the canonical name (kv_dtype.py maps canonical names to torch dtypes)
KV_CACHE_DTYPE_NAMES: dict[str, str] = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
}


def check_kv_cache_dtype(name: str) -> None:
    """ValueError naming the accepted values when `name` is not one."""
    if name.strip().lower() not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8 (e4m3); got "
                         f"{name!r}")

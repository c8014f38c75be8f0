"""Names the engine settings accept for model-side choices, torch-free: EngineArgs validates a server's flags
with them before the model (and torch) is ever imported in the HTTP process."""

from __future__ import annotations

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "cpu", "triton")
# the dtype of packed CPU layers' many-row GEMMs under bf16 activations (model/layers/prompt_gemm.py); int8: prompt
# rows take the int8 path's tiled copies too (quant/linear.Int8Gate), the other layers auto's dtype
PROMPT_GEMM_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32", "int8")

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


def check_prompt_gemm_dtype(name: str) -> None:
    """ValueError naming the accepted values when `name` is not one."""
    if name not in PROMPT_GEMM_DTYPES:
        raise ValueError(f"prompt_gemm_dtype must be one of {', '.join(PROMPT_GEMM_DTYPES)}; got {name!r}")


def cuda_graph_sizes(max_num_seqs: int, requested: tuple[int, ...] | list[int] | None = None) -> list[int]:
    """Decode batch sizes to capture CUDA graphs at, ascending: `requested` (--cuda-graph-sizes) clipped to
    max_num_seqs (as vLLM: larger decode batches run eagerly), or by default 1, 2, 4, 8, then every 16 up to
    max_num_seqs, and max_num_seqs itself, so every decode batch fits a graph (padded up to the next size: at
    most 15 idle rows). ValueError for a size below 1."""
    if requested:
        bad = [s for s in requested if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"cuda_graph_sizes must be positive integers, got {bad}")
        return sorted({min(s, max_num_seqs) for s in requested})
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs} | set(range(16, max_num_seqs + 1, 16))
    return sorted(sizes | {max_num_seqs})

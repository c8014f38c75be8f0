"""Compiles the Triton attention kernels for Hopper (sm_90) with no GPU, as the GPU would at first launch,
and prints one JSON line per kernel variant: compiled or the compiler's error, shared memory, and
registers / spill stack from the bundled cuobjdump. Run with TRITON_INTERPRET unset (a separate process:
the interpreter replaces the kernels when it is set).

    python tests/model/triton_sm90_compile.py [--head-dims 64 128 256] [--dtypes bf16 fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvpilot.model.attention import triton_decode, triton_kv_write, triton_prefill
from kvpilot.model.layers import triton_small_ops

HOPPER = GPUTarget("cuda", 90, 32)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FLOAT_SCALARS = {"qk_scale", "cached_qk_scale", "v_scale", "inv_k_scale", "inv_v_scale", "eps", "fp8_max",
                 "min_scale", "cap_log2"}
PLAIN = {"SOFTCAP": False, "SINKS": False}  # a Llama-like layer; FEATURES: Gemma 2's soft-cap, gpt-oss's sinks
FEATURES = {"SOFTCAP": True, "SINKS": True}
INDEX_POINTERS = {"decode_seqs_ptr", "prefill_seqs_ptr", "query_start_ptr", "seq_lens_ptr", "block_tables_ptr",
                  "slot_ptr"}
# the variants whose code changes with an fp8 cache, each built over one once: the reduce reads no cache, and the
# soft-cap, sinks and window act on tiles already widened to the query dtype (decode's loads, prefill's
# _cached_tile), so their fp8 builds would compile plain decode's and prefill's fp8 code again
FP8_DISTINCT = {"decode_split", "decode_single", "prefill", "kv_write"}


def _signature(fn, dtype: str, kv_dtype: str, constexprs: dict) -> dict[str, str]:
    """Triton type strings for fn's arguments: caches in kv_dtype, partials fp32, index arrays int32."""
    types = {}
    for name in fn.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in FLOAT_SCALARS:
            types[name] = "fp32"
        elif name in INDEX_POINTERS:
            types[name] = "*i32"
        elif name.startswith("fp8_"):
            types[name] = "*fp8e4nv"
        elif name.startswith("part_") or name == "scales_ptr":
            types[name] = "*fp32"
        elif "cache" in name:
            types[name] = f"*{kv_dtype}"
        elif name.endswith("_ptr"):
            types[name] = f"*{dtype}"
        else:
            types[name] = "i32"
    return types


def _resources(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = next((line.split() for line in text.splitlines() if "REG:" in line), [])
    return {k.lower(): int(v) for k, v in (f.split(":") for f in fields if f.split(":")[0] in ("REG", "STACK"))}


def compile_variant(label: str, fn, dtype: str, kv_dtype: str, constexprs: dict, options: dict) -> dict:
    record = {"kernel": label, "dtype": dtype, "kv_dtype": kv_dtype,
              **{k: v for k, v in constexprs.items() if k.isupper()}, **options,
              "unspecialized": [p.name for p in fn.params if p.do_not_specialize]}
    try:
        kernel = triton.compile(ASTSource(fn, _signature(fn, dtype, kv_dtype, constexprs), constexprs=constexprs),
                                target=HOPPER, options=options)
    except Exception as exc:  # the compiler's own message is the result
        return {**record, "compiled": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    return {**record, "compiled": True, "shared": kernel.metadata.shared, **_resources(kernel.asm["cubin"])}


def variants(head_dim: int, dtype: str, kv_dtype: str) -> list[tuple]:
    torch_dtype = TORCH_DTYPES[dtype]
    precision = triton_decode.dot_precision(torch_dtype)
    block_m, block_n, warps, stages = triton_prefill.prefill_tiles(head_dim, torch_dtype)
    fp8 = kv_dtype.startswith("fp8")
    decode = {"GROUP": 4, "BLOCK_G": 16, "BLOCK_D": head_dim, "BLOCK_N": triton_decode.key_tile(head_dim, torch_dtype),
              "PRECISION": precision, "WIDE": False}
    prefill = {"GROUP": 4, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": head_dim, "V_SCALED": fp8,
               "PRECISION": precision, "WIDE": False}
    tiles = {"num_warps": warps, "num_stages": stages}
    every = [
        ("decode_split", triton_decode._decode_split_kernel, {**decode, **PLAIN, "SINGLE": False}, {}),
        ("decode_single", triton_decode._decode_split_kernel, {**decode, **PLAIN, "SINGLE": True}, {}),
        ("decode_reduce", triton_decode._decode_reduce_kernel, {"BLOCK_S": 64, "BLOCK_D": head_dim, "SINKS": False}, {}),
        ("prefill", triton_prefill._prefill_kernel, {**prefill, **PLAIN, "WINDOW": False}, tiles),
        ("decode_split_features", triton_decode._decode_split_kernel, {**decode, **FEATURES, "SINGLE": False}, {}),
        ("decode_single_features", triton_decode._decode_split_kernel, {**decode, **FEATURES, "SINGLE": True}, {}),
        ("decode_reduce_sinks", triton_decode._decode_reduce_kernel, {"BLOCK_S": 64, "BLOCK_D": head_dim, "SINKS": True},
         {}),
        ("prefill_features", triton_prefill._prefill_kernel, {**prefill, **FEATURES, "WINDOW": True}, tiles),
        ("kv_write", triton_kv_write._write_kv_kernel, {"BLOCK_H": 8, "BLOCK_D": head_dim, "SCALED": fp8}, {}),
    ]
    return [v for v in every if not fp8 or v[0] in FP8_DISTINCT]


def small_op_variants(dtype: str) -> list[tuple]:
    """The fused small ops (RMSNorm at a 4,096-wide hidden state, rotary at head dim 128, SiLU-and-mul, fp8
    row quantization)."""
    return [("rms_norm", triton_small_ops._rms_norm_kernel, {"BLOCK": 4096}, {"num_warps": 8}),
            ("rotary", triton_small_ops._rope_kernel, {"BLOCK": 64}, {}),
            ("silu_mul", triton_small_ops._silu_mul_kernel, {"BLOCK": 1024}, {}),
            ("quantize_fp8", triton_small_ops._quantize_rows_fp8_kernel, {"BLOCK": 4096}, {"num_warps": 8})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--dtypes", nargs="*", default=["bf16", "fp16", "fp32"])
    parser.add_argument("--fp8-kv", action="store_true", help="Also 16-bit queries over an fp8 (e4m3) cache.")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels that are compiled here")
    for dtype in args.dtypes:
        for label, fn, constexprs, options in small_op_variants(dtype):
            print(json.dumps(compile_variant(label, fn, dtype, dtype, constexprs, options)), flush=True)
        kv_dtypes = [dtype] + (["fp8e4nv"] if args.fp8_kv and dtype != "fp32" else [])
        for kv_dtype in kv_dtypes:
            for head_dim in args.head_dims:
                for label, fn, constexprs, options in variants(head_dim, dtype, kv_dtype):
                    print(json.dumps(compile_variant(label, fn, dtype, kv_dtype, constexprs, options)), flush=True)


if __name__ == "__main__":
    main()

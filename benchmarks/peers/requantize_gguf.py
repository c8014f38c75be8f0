"""Run by the llama.cpp venv's Python: `requantize_gguf.py SOURCE OUT --type TYPE --threads N [--head-type T]`
writes SOURCE as llama.cpp's TYPE (a LLAMA_FTYPE_MOSTLY_ suffix: Q4_0, Q4_K_M, ...) to OUT.

llama.cpp's own quantizer (`llama_model_quantize`, allow_requantize: the source is already Q4_1, so its
blocks are dequantized and quantized again), with its own type mix per tensor for TYPE. `--head-type` asks
for one GGML type on the token embedding and the output head instead of llama.cpp's choice (peers/quantize.py
says which copies do and why).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import llama_cpp


def constant(prefix: str, name: str) -> int:
    value = getattr(llama_cpp, prefix + name.upper(), None)
    if value is None:
        sys.exit(f"this llama-cpp-python has no {prefix}{name.upper()}")
    return value


def requantize(source: str, out: str, type_name: str, num_threads: int, head_type: str | None) -> None:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = num_threads
    params.ftype = constant("LLAMA_FTYPE_MOSTLY_", type_name)
    params.allow_requantize = True
    if head_type:
        params.output_tensor_type = constant("GGML_TYPE_", head_type)
        params.token_embedding_type = constant("GGML_TYPE_", head_type)
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    if status != 0:
        sys.exit(f"llama_model_quantize({source} -> {out}, {type_name}) returned {status}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--type", required=True, help="llama.cpp's quantization type, e.g. Q4_0, Q4_K_M")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--head-type", help="GGML type of the token embedding and output head (default: llama.cpp's)")
    args = parser.parse_args()
    requantize(args.source, args.out, args.type, args.threads, args.head_type)

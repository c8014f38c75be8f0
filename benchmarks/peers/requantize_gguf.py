"""Run by the llama.cpp venv's Python: `requantize_gguf.py SOURCE OUT THREADS` writes SOURCE as Q4_0 to OUT.

llama.cpp's own quantizer (`llama_model_quantize`, allow_requantize: the source is already Q4_1, so its
blocks are dequantized and quantized again). The token embedding (also the tied output head) is asked to be
Q8_0, as in the source: llama.cpp would otherwise pick Q6_K for it, which kvpilot's packed kernels do not
take, and the comparison would no longer be on the same weights.
"""

from __future__ import annotations

import ctypes
import sys

import llama_cpp


def requantize(source: str, out: str, num_threads: int) -> None:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = num_threads
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.output_tensor_type = llama_cpp.GGML_TYPE_Q8_0
    params.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params))
    if status != 0:
        sys.exit(f"llama_model_quantize({source} -> {out}) returned {status}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: requantize_gguf.py SOURCE OUT THREADS")
    requantize(sys.argv[1], sys.argv[2], int(sys.argv[3]))

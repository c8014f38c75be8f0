"""The C++ packed quantized-linear kernel (layers/csrc/quant_*: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K,
Q5_K, Q6_K; quant_moe_cpu.cpp, packed GGUF experts grouped by expert; quant_tile_blocks_cpu.cpp, GGUF blocks to
int8 tiles at load), built once with
torch's cpp_extension like the decode-attention kernel (JIT, cached on disk by torch, source hash in the name).

One build serves every x86 CPU: the AVX-512 and AVX2 paths carry target attributes and `cpu_isa()` picks
the best the CPU runs at run time (the portable path otherwise), so no -march=native binary is cached for
one CPU and loaded on another. If the build is impossible (no compiler or ninja), or KVPILOT_CPU_KERNELS=0,
`get_quant_kernel()` returns None and GGUF weights are dequantized at load as before.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from kvpilot.model.layers.cpp_build import CppKernel, build_cpp_kernel

_CSRC = Path(__file__).resolve().parent.parent / "layers" / "csrc"
# concatenated in this order into one translation unit (the headers are not on an include path)
SOURCE_NAMES = ("quant_common.h", "quant_blocks.h", "quant_avx512.h", "quant_avx2.h", "quant_blocks_avx2.h",
                "quant_vnni.h",
                "quant_vnni_gemm.h", "quant_tiled_avx2.h", "quant_tiled_kq.h", "quant_tiled_kq_avx2.h",
                "quant_linear_cpu.cpp", "quant_tiled_cpu.cpp",
                "quant_tiled_set_cpu.cpp")
# this module's alone (the fused decode kernel builds SOURCE_NAMES and needs none of it): packed GGUF experts and
# the conversion of their blocks to int8 tiles at load
MOE_SOURCE_NAMES = ("moe_groups.h", "quant_moe_cpu.cpp", "quant_tile_blocks_cpu.cpp")
SOURCE_PATHS = tuple(_CSRC / name for name in SOURCE_NAMES + MOE_SOURCE_NAMES)
FUNCTIONS = ["quant_matmul", "quant_dequantize", "cpu_isa", "quant_parallel_width", "quant_matmul_interleaved",
             "quant_matmul_tiled", "quant_dequantize_tiled", "quant_argmax_tiled", "has_vnni", "has_int8_tiles",
             "quant_matmul_tiled_set", "quant_dequantize_tiled_set", "quant_argmax_tiled_set", "quant_moe_tiled",
             "quant_tile_blocks"]
ISA_NAMES = ("portable", "avx2", "avx512")

_KERNEL = CppKernel(label="CPU quantized-linear kernel", name_prefix="kvpilot_cpu_quant_", sources=SOURCE_PATHS,
                    functions=tuple(FUNCTIONS), cflags=("-O3", "-ffast-math"),
                    serial="packed matmuls run on one thread",
                    fallback="GGUF weights will be dequantized at load")


@lru_cache(maxsize=1)
def get_quant_kernel() -> Any | None:
    """The compiled module, or None when it cannot be built or is switched off (KVPILOT_CPU_KERNELS=0)."""
    return build_cpp_kernel(_KERNEL)


def loaded_quant_kernel() -> Any | None:
    """The compiled module if this process has already built or loaded it; never starts a build (a GPU load,
    which builds no CPU kernels, gets None)."""
    return get_quant_kernel() if get_quant_kernel.cache_info().currsize else None


def require_quant_kernel() -> Any:
    """The compiled module; RuntimeError when it is unavailable (callers that hold packed weights need it)."""
    kernel = get_quant_kernel()
    if kernel is None:
        raise RuntimeError("the CPU quantized-linear kernel is unavailable (no compiler, or KVPILOT_CPU_KERNELS=0)")
    return kernel


def best_isa() -> int:
    """The best ISA level the kernel runs on this CPU: 0 portable, 1 AVX2, 2 AVX-512 (-1: no kernel)."""
    kernel = get_quant_kernel()
    return -1 if kernel is None else int(kernel.cpu_isa())


def has_vnni() -> bool:
    """Whether the whole int8-activation path runs on this CPU (AVX-512 VNNI): every tiled format, tiled sets,
    interleaved copies and packed experts."""
    kernel = get_quant_kernel()
    return kernel is not None and bool(kernel.has_vnni())


def int8_path() -> str:
    """This CPU's int8 path, as fit names it (fit/fingerprint.cpu_int8_path): vnni, avx2 or none."""
    return "vnni" if has_vnni() else "avx2" if has_int8_tiles() else "none"


def has_int8_tiles() -> bool:
    """Whether the int8-activation path's column-tiled Q8_0 / Q4_0 / Q4_1 copies run on this CPU: with VNNI, or
    AVX2 (vpmaddubsw; the other int8 copies need VNNI)."""
    kernel = get_quant_kernel()
    return kernel is not None and bool(kernel.has_int8_tiles())

"""The C++ packed quantized-linear kernel (layers/csrc/quant_*: Q8_0, Q4_0 and Q4_1 blocks), built once with
torch's cpp_extension like the decode-attention kernel (JIT, cached on disk by torch, source hash in the name).

One build serves every x86 CPU: the AVX-512 and AVX2 paths carry target attributes and `cpu_isa()` picks
the best the CPU runs at run time (the portable path otherwise), so no -march=native binary is cached for
one CPU and loaded on another. If the build is impossible (no compiler or ninja), or KVPILOT_CPU_KERNELS=0,
`get_quant_kernel()` returns None and GGUF weights are dequantized at load as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvpilot")

_CSRC = Path(__file__).resolve().parent.parent / "layers" / "csrc"
# concatenated in this order into one translation unit (the headers are not on an include path)
SOURCE_PATHS = tuple(_CSRC / name for name in ("quant_common.h", "quant_avx512.h", "quant_avx2.h",
                                               "quant_vnni.h", "quant_linear_cpu.cpp"))
FUNCTIONS = ["quant_matmul", "quant_dequantize", "cpu_isa", "quant_parallel_width", "quant_matmul_q8act"]
ISA_NAMES = ("portable", "avx2", "avx512")

# OpenMP first: ATen's parallel_for is inlined into the module and, built without it, runs on one thread
_BUILDS = (("-fopenmp",), ())


@lru_cache(maxsize=1)
def get_quant_kernel() -> Any | None:
    """The compiled module, or None when it cannot be built or is switched off (KVPILOT_CPU_KERNELS=0)."""
    if os.environ.get("KVPILOT_CPU_KERNELS", "1") == "0":
        return None
    source = "\n".join(path.read_text(encoding="utf-8") for path in SOURCE_PATHS)
    # the name carries the source hash: an edited kernel is rebuilt, never a stale cached one loaded
    name = "kvpilot_cpu_quant_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    error: Exception | None = None
    for openmp in _BUILDS:
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(name=name if openmp else name + "_serial", cpp_sources=[source],
                                 functions=FUNCTIONS, extra_cflags=["-O3", "-ffast-math", *openmp],
                                 extra_ldflags=list(openmp), verbose=False)
        except Exception as exc:  # no compiler / ninja / headers / OpenMP: try the next build, then give up
            error = exc
            continue
        if not openmp:
            logger.warning("CPU quantized-linear kernel built without OpenMP: packed matmuls run on one thread")
        return module
    logger.warning("CPU quantized-linear kernel unavailable, GGUF weights will be dequantized at load (%s: %s)",
                   type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    return None


def best_isa() -> int:
    """The best ISA level the kernel runs on this CPU: 0 portable, 1 AVX2, 2 AVX-512 (-1: no kernel)."""
    kernel = get_quant_kernel()
    return -1 if kernel is None else int(kernel.cpu_isa())

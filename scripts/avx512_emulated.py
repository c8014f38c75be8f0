"""Runs kernel tests on the AVX-512 (and VNNI) paths of kvpilot's packed quantized-linear kernel on a CPU without
them: the same C++ sources built with SIMDe (https://github.com/simd-everywhere/simde, the `simde-py` package), whose
portable code stands in for every x86 intrinsic, and the run-time CPU checks answering "AVX-512 VNNI present".

CPUs differ between the project's machines (docs/benchmarks.md names them): a change to the AVX-512 code made on an
AVX2-only box would otherwise reach users untested. This checks the logic (lane layouts, lookups, scales); it says
nothing about speed, and it is slow (a build of several minutes, kernels ~100x slower), so it is a developer's
check, not part of the suite.

    .venv/bin/pip install simde-py
    .venv/bin/python scripts/avx512_emulated.py tests/model/test_quant_kquant.py [pytest args...]

The tests run with the emulated module in place of the quant kernel (kvpilot.model.quant.kernel.get_quant_kernel);
tests that build other C++ kernels (fused decode, attention) use the native ones, whose AVX-512 paths stay off.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Emulated instructions are plain C++: no function may be compiled for an ISA this CPU lacks
_TARGET = re.compile(r'__attribute__\(\(target\("[^"]*"\)\)\)')
_CPU_CHECK = re.compile(r'__builtin_cpu_supports\("[a-z0-9_]+"\)')
# torch's headers bring the system's vector types in (x86intrin.h): the kernel's must name SIMDe's
_TYPES = ("__m128", "__m128i", "__m128d", "__m256", "__m256i", "__m256d", "__m512", "__m512i", "__m512d")
# intrinsics the kernels use that SIMDe 0.8.2 lacks, lane by lane
_MISSING = r"""
static inline simde__m256i kvp_cvtepi32_epi16(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a);
  simde__m256i_private r;
  for (int i = 0; i < 16; ++i) r.i16[i] = static_cast<int16_t>(p.i32[i]);
  return simde__m256i_from_private(r);
}
static inline simde__m512i kvp_cvtepi8_epi32(simde__m128i a) {
  simde__m128i_private p = simde__m128i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.i8[i];
  return simde__m512i_from_private(r);
}
static inline simde__m512i kvp_cvtepu8_epi32(simde__m128i a) {
  simde__m128i_private p = simde__m128i_to_private(a);
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = p.u8[i];
  return simde__m512i_from_private(r);
}
static inline int kvp_reduce_add_epi32(simde__m512i a) {
  simde__m512i_private p = simde__m512i_to_private(a);
  int sum = 0;
  for (int i = 0; i < 16; ++i) sum += p.i32[i];
  return sum;
}
static inline float kvp_reduce_add_ps(simde__m512 a) {
  simde__m512_private p = simde__m512_to_private(a);
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += p.f32[i];
  return sum;
}
static inline float kvp_cvtsh_ss(uint16_t h) { return simde_float16_to_float32(simde_uint16_as_float16(h)); }
#define _cvtsh_ss kvp_cvtsh_ss
#define _mm512_cvtepi32_epi16 kvp_cvtepi32_epi16
#define _mm512_cvtepi8_epi32 kvp_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 kvp_cvtepu8_epi32
#define _mm512_reduce_add_epi32 kvp_reduce_add_epi32
#define _mm512_reduce_add_ps kvp_reduce_add_ps
"""
_SIMDE = ("#define SIMDE_ENABLE_NATIVE_ALIASES\n#include <simde/x86/avx512.h>\n#include <simde/x86/f16c.h>\n"
          "#include <simde/x86/fma.h>\n" + "".join(f"#define {t} simde{t}\n" for t in _TYPES) + _MISSING)


def emulated_source(source: str) -> str:
    """The kernel's translation unit with SIMDe in place of the system intrinsics header (whose vector types would
    clash with SIMDe's), no target attributes, and every CPU feature check true."""
    source = _CPU_CHECK.sub("true", _TARGET.sub("", source))
    return source.replace("#include <immintrin.h>\n", _SIMDE)


def build_emulated_quant_kernel() -> Any:
    """The quant kernel module built on SIMDe (cached by torch under an emulated name: rebuilt when sources change)."""
    import hashlib

    import simde_py
    from torch.utils.cpp_extension import load_inline

    from kvpilot.model.layers.cpp_build import PRELUDE
    from kvpilot.model.quant.kernel import _KERNEL

    source = emulated_source("\n".join(p.read_text(encoding="utf-8") for p in (PRELUDE, *_KERNEL.sources)))
    name = "kvpilot_emulated_quant_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    include = Path(simde_py.get_include())
    print(f"building the SIMDe-emulated quant kernel ({name}); several minutes the first time", file=sys.stderr)
    return load_inline(name=name, cpp_sources=[source], no_implicit_headers=True, functions=list(_KERNEL.functions),
                       extra_cflags=["-O2", "-fopenmp", f"-I{include}", "-w"], extra_ldflags=["-fopenmp"],
                       verbose=False)


def main(argv: list[str]) -> int:
    import importlib.util

    if importlib.util.find_spec("simde_py") is None:
        print("needs SIMDe's headers: .venv/bin/pip install simde-py", file=sys.stderr)
        return 2
    import pytest

    import kvpilot.model.quant.kernel as quant_kernel

    emulated = build_emulated_quant_kernel()
    quant_kernel.get_quant_kernel.cache_clear()
    quant_kernel.build_cpp_kernel = lambda kernel: emulated if kernel is quant_kernel._KERNEL else None
    if not quant_kernel.has_vnni():
        print("the emulated kernel does not report VNNI: nothing to check", file=sys.stderr)
        return 2
    return int(pytest.main(["-p", "no:cacheprovider", *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

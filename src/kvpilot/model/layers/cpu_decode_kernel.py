"""A C++ paged decode-attention kernel for float32 on CPU, built once with torch's cpp_extension (JIT).

Why: the torch-ops decode path gathers every sequence's K/V blocks into a new tensor each step and layer
(read + write + read); this kernel reads each K/V row once, in place, through the block table, with one
task per (sequence, KV head) spread over torch's thread pool. If the build is impossible (no compiler or
ninja), or KVPILOT_CPU_KERNELS=0, `get_kernel()` returns None and the torch path is used.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Any

logger = logging.getLogger("kvpilot")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// out, q: [B, H, D] float32; k_cache, v_cache: [kvH, num_blocks, block_size, D] float32 contiguous;
// block_tables: [B, max_blocks] int64; context_lens: [B] int64. Query heads h*G..h*G+G-1 use KV head h.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t kvH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t G = H / kvH, MB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * kvH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, maxs, sums;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kvH, h = i % kvH, L = cl[b];
      const float* qb = qp + (b * H + h * G) * D;
      scores.assign(G * L, 0.f);
      maxs.assign(G, std::numeric_limits<float>::lowest());
      for (int64_t t = 0; t < L; ++t) {
        const float* krow = kp + ((h * NB + bt[b * MB + t / BS]) * BS + t % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * krow[d];
          s *= fscale;
          scores[g * L + t] = s;
          if (s > maxs[g]) maxs[g] = s;
        }
      }
      sums.assign(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t t = 0; t < L; ++t) {
          const float e = std::exp(scores[g * L + t] - maxs[g]);
          scores[g * L + t] = e;
          sums[g] += e;
        }
      }
      acc.assign(G * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* vrow = vp + ((h * NB + bt[b * MB + t / BS]) * BS + t % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vrow[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* og = op + (b * H + h * G + g) * D;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) og[d] = acc[g * D + d] * inv;
      }
    }
  });
}
"""


@lru_cache(maxsize=1)
def get_kernel() -> Any | None:
    """The compiled module (cached on disk by torch under ~/.cache/torch_extensions), or None."""
    if os.environ.get("KVPILOT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(name="kvpilot_cpu_decode", cpp_sources=[_SOURCE], functions=["paged_decode"],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"], verbose=False)
    except Exception as exc:  # no compiler / ninja / headers: the torch path still works
        logger.warning("CPU decode kernel unavailable, using the torch path (%s: %s)", type(exc).__name__,
                       str(exc).splitlines()[0] if str(exc) else "")
        return None

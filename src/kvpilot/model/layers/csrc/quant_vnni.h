// Packed weights times int8-quantized activations with AVX-512 VNNI dot products (llama.cpp's q8 scheme: each
// 32-value block of x gets its own scale). Quantizing activations changes results by up to ~1/254 of a
// block's largest value, where the float32 path matches dequantize-then-matmul to rounding: the model uses
// it only where results are already rounded to bf16 (PackedLinear.int8_activations, the hybrid layout).
// quant_matmul_q8act() runs it.
//
// Per weight block, the unsigned operand of vpdpbusd is the block's 32 quants: Q4_0/Q4_1 nibbles as they are
// (their offset, -8 d or m, comes back through sum(xq)), Q8_0's |q| with q's sign moved onto x. Up to kVnniMR
// x rows share each unpacked weight block, so a weight row is read from memory once for the whole batch.
#define KVP_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace {

// x rows per tile (weights unpacked once per tile; a weight row stays in L1 across tiles). 2 measured
// fastest on the Zen 4 EPYC: 4-row tiles were no faster than two 2-row passes, 8-block zmm variants slower.
constexpr int kVnniMR = 2;

// x [K] -> int8 blocks xq, per-block scales xd and xd * sum(xq) (for Q4_1's minimum term)
KVP_VNNI void quantize_row_q8(const float* x, int64_t KB, int8_t* xq, float* xd, float* xs) {
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    xd[b] = d;
    xs[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

KVP_VNNI inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[i * ldo] for MR x rows (quantized: xq [MR, K], xd/xs [MR, KB]) times one weight row (quants q, float
// scales ds, block offsets os: m for Q4_1, -8 d for Q4_0, unused for Q8_0)
template <int MR, int64_t FMT>
KVP_VNNI void vnni_tile(const uint8_t* q, const float* ds, const float* os, int64_t KB, const int8_t* xq,
                        const float* xd, const float* xs, float* out, int64_t ldo) {
  const int64_t K = KB * kBlock;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[MR];
  float offset_term[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    offset_term[i] = 0.f;
  }
  for (int64_t b = 0; b < KB; ++b) {
    __m256i wq, sign;
    if constexpr (FMT == kQ8_0) {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
      wq = _mm256_sign_epi8(sign, sign);  // |q| (-128 reads as 128 unsigned)
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
    }
    for (int i = 0; i < MR; ++i) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + b * kBlock));
      if constexpr (FMT == kQ8_0) xv = _mm256_sign_epi8(xv, sign);
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xv);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ds[b] * xd[i * KB + b]), acc[i]);
      if constexpr (FMT != kQ8_0) offset_term[i] += os[b] * xs[i * KB + b];
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum8(acc[i]) + offset_term[i];
}

template <int64_t FMT>
KVP_VNNI void vnni_row_tiles(const uint8_t* q, const float* ds, const float* os, int64_t KB, const int8_t* xq,
                             const float* xd, const float* xs, int64_t M, float* out, int64_t ldo) {
  const int64_t K = KB * kBlock;
  for (int64_t i = 0; i < M; i += kVnniMR) {
    const int64_t mr = std::min<int64_t>(kVnniMR, M - i);
    const int8_t* x = xq + i * K;
    float* o = out + i * ldo;
    if (mr == 2) vnni_tile<2, FMT>(q, ds, os, KB, x, xd + i * KB, xs + i * KB, o, ldo);
    else vnni_tile<1, FMT>(q, ds, os, KB, x, xd + i * KB, xs + i * KB, o, ldo);
  }
}

// out[i * ldo + n] for rows i < M of quantized x, weight rows [n0, n1); scales: 2 * KB floats of scratch
KVP_VNNI void rows_vnni(const Packed& w, int64_t n0, int64_t n1, const int8_t* xq, const float* xd,
                        const float* xs, int64_t M, float* out, int64_t ldo, float* scales) {
  float* ds = scales;
  float* os = scales + w.KB;
  for (int64_t n = n0; n < n1; ++n) {
    convert_scales512(w.d + n * w.KB, w.KB, ds);
    const uint8_t* q = w.qs + n * w.qs_row();
    if (w.fmt == kQ8_0) {
      vnni_row_tiles<kQ8_0>(q, ds, os, w.KB, xq, xd, xs, M, out + n, ldo);
    } else if (w.fmt == kQ4_1) {
      convert_scales512(w.m + n * w.KB, w.KB, os);
      vnni_row_tiles<kQ4_1>(q, ds, os, w.KB, xq, xd, xs, M, out + n, ldo);
    } else {
      for (int64_t b = 0; b < w.KB; ++b) os[b] = -8.0f * ds[b];
      vnni_row_tiles<kQ4_0>(q, ds, os, w.KB, xq, xd, xs, M, out + n, ldo);
    }
  }
}

}  // namespace

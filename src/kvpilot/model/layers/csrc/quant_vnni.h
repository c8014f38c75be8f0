// Q4_1 weights times int8-quantized activations with AVX-512 VNNI dot products (llama.cpp's q8 scheme: each
// 32-value block of x gets its own scale). Quantizing activations changes results by up to ~1/254 of a
// block's largest value, where the float32 path matches dequantize-then-matmul to rounding: the model uses
// it only where results are already rounded to bf16 (PackedLinear.int8_activations, the hybrid layout).
// quant_matmul_q8act() runs it.
#define KVP_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace {

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

// out[i * ldo + n] for rows i < M of quantized x, weight rows [n0, n1)
KVP_VNNI void q41_rows_vnni(const Packed& w, int64_t n0, int64_t n1, const int8_t* xq, const float* xd,
                            const float* xs, int64_t M, float* out, int64_t ldo, float* scales) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    float* ds = scales;
    float* ms = scales + w.KB;
    convert_scales512(w.d + n * w.KB, w.KB, ds);
    convert_scales512(w.m + n * w.KB, w.KB, ms);
    const uint8_t* q = w.qs + n * w.qs_row();
    for (int64_t i = 0; i < M; ++i) {
      const int8_t* xi = xq + i * w.K;
      __m256 acc = _mm256_setzero_ps();
      float min_term = 0.f;
      for (int64_t b = 0; b < w.KB; ++b) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
        const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + b * 32));
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xv);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ds[b] * xd[i * w.KB + b]), acc);
        min_term += ms[b] * xs[i * w.KB + b];
      }
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[i * ldo + n] = _mm_cvtss_f32(s) + min_term;
    }
  }
}

}  // namespace

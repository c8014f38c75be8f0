// The AVX2 path of the packed quantized-linear kernel (8 float lanes): the same steps as quant_avx512.h,
// with x-row tiles of at most 2 (2 x 4 accumulators + 4 weight vectors fit AVX2's 16 registers).
#define KVP_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

KVP_AVX2 void convert_scales256(const uint16_t* src, int64_t count, float* dst) {
  int64_t b = 0;
  for (; b + 8 <= count; b += 8)
    _mm256_storeu_ps(dst + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + b))));
  for (; b < count; ++b) dst[b] = _cvtsh_ss(src[b]);
}

KVP_AVX2 void dequant_row256(const Packed& w, int64_t n, float* out, float* scales) {
  float* ds = scales;
  float* ms = scales + w.KB;
  convert_scales256(w.d + n * w.KB, w.KB, ds);
  if (w.fmt == kQ4_1) convert_scales256(w.m + n * w.KB, w.KB, ms);
  const uint8_t* q = w.qs + n * w.qs_row();
  if (w.fmt == kQ8_0) {
    for (int64_t b = 0; b < w.KB; ++b) {
      const __m256 d = _mm256_set1_ps(ds[b]);
      for (int part = 0; part < 4; ++part) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * kBlock + part * 8));
        _mm256_storeu_ps(out + b * kBlock + part * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d));
      }
    }
    return;
  }
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < w.KB; ++b) {
    const __m256 d = _mm256_set1_ps(ds[b]);
    const __m256 off = _mm256_set1_ps(w.fmt == kQ4_1 ? ms[b] : -8.0f * ds[b]);
    for (int half = 0; half < 2; ++half) {  // bytes 0-7 then 8-15: values j and j + 16
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * 16 + half * 8));
      const __m256i bytes = _mm256_cvtepu8_epi32(raw);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
      _mm256_storeu_ps(out + b * kBlock + half * 8, _mm256_fmadd_ps(lo, d, off));
      _mm256_storeu_ps(out + b * kBlock + 16 + half * 8, _mm256_fmadd_ps(hi, d, off));
    }
  }
}

KVP_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MR, int NR>
KVP_AVX2 void tile256_fixed(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = hsum256(acc[i][j]);
}

using TileFn256 = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);

template <int MR>
constexpr TileFn256 kTiles256Row[4] = {tile256_fixed<MR, 1>, tile256_fixed<MR, 2>, tile256_fixed<MR, 3>,
                                       tile256_fixed<MR, 4>};

void tile256(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo, int mr, int nr) {
  static const TileFn256* const table[2] = {kTiles256Row<1>, kTiles256Row<2>};
  table[mr - 1][nr - 1](x, ldx, w, K, out, ldo);
}

}  // namespace

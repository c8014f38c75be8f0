// The AVX-512 path of the packed quantized-linear kernel (16 float lanes). Compiled with a target attribute
// and chosen at run time by cpu_isa(), so one build serves AVX-512, AVX2 and older CPUs alike.
//
// Why dequantize to float32 and FMA (not int8 activations with VNNI dot products as llama.cpp does): the
// result must match dequantize-then-matmul to float32 rounding (greedy output of a packed model equals the
// dequantized one); quantizing activations to int8 per block changes results by ~1/127 of a block's
// largest activation. Decode reads ~96 MB of packed weights per token: this path stays memory-bound.
#define KVP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace {

KVP_AVX512 void convert_scales512(const uint16_t* src, int64_t count, float* dst) {
  int64_t b = 0;
  for (; b + 16 <= count; b += 16)
    _mm512_storeu_ps(dst + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + b))));
  for (; b < count; ++b) dst[b] = _cvtsh_ss(src[b]);
}

KVP_AVX512 void dequant_row512(const Packed& w, int64_t n, float* out, float* scales) {
  float* ds = scales;
  float* ms = scales + w.KB;
  convert_scales512(w.d + n * w.KB, w.KB, ds);
  if (w.fmt == kQ4_1) convert_scales512(w.m + n * w.KB, w.KB, ms);
  const uint8_t* q = w.qs + n * w.qs_row();
  if (w.fmt == kQ8_0) {
    for (int64_t b = 0; b < w.KB; ++b) {
      const __m512 d = _mm512_set1_ps(ds[b]);
      const uint8_t* qb = q + b * kBlock;
      const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
      const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)));
      _mm512_storeu_ps(out + b * kBlock, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
      _mm512_storeu_ps(out + b * kBlock + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
    }
    return;
  }
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < w.KB; ++b) {
    const __m512 d = _mm512_set1_ps(ds[b]);
    const __m512 off = _mm512_set1_ps(w.fmt == kQ4_1 ? ms[b] : -8.0f * ds[b]);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    _mm512_storeu_ps(out + b * kBlock, _mm512_fmadd_ps(lo, d, off));
    _mm512_storeu_ps(out + b * kBlock + 16, _mm512_fmadd_ps(hi, d, off));
  }
}

// count a multiple of 16 (rows hold whole 32-value blocks)
KVP_AVX512 void to_bf16_512(const float* in, uint16_t* out, int64_t count) {
  const __m512i round = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (int64_t k = 0; k < count; k += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(in + k));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(round, odd)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm512_cvtepi32_epi16(rounded));
  }
}

template <int MR, int NR>
KVP_AVX512 void tile512_fixed(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// Few x rows (decode): each weight block is dequantized in registers and multiplied with the MR x rows at
// once, with no float32 copy of the weights in between (measured 1.3-2x faster than dequant_row512 + a tile
// at 1-4 rows, where that copy's stores and reloads cost as much as the arithmetic).
template <int MR>
KVP_AVX512 void fused512_fixed(const Packed& w, int64_t n0, int nr, const float* x, int64_t ldx, float* out,
                               int64_t ldo, float* scales) {
  __m512 acc[MR][kNR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kNR; ++j) acc[i][j] = _mm512_setzero_ps();
  float* ds = scales;  // [kNR][KB] each
  float* ms = scales + kNR * w.KB;
  for (int j = 0; j < nr; ++j) {
    convert_scales512(w.d + (n0 + j) * w.KB, w.KB, ds + j * w.KB);
    if (w.fmt == kQ4_1) convert_scales512(w.m + (n0 + j) * w.KB, w.KB, ms + j * w.KB);
  }
  const int64_t row_bytes = w.qs_row();
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < w.KB; ++b) {
    __m512 xlo[MR], xhi[MR];
    for (int i = 0; i < MR; ++i) {
      xlo[i] = _mm512_loadu_ps(x + i * ldx + b * kBlock);
      xhi[i] = _mm512_loadu_ps(x + i * ldx + b * kBlock + 16);
    }
    for (int j = 0; j < nr; ++j) {
      const uint8_t* q = w.qs + (n0 + j) * row_bytes;
      const float dj = ds[j * w.KB + b];
      __m512 lo, hi;
      if (w.fmt == kQ8_0) {
        const __m512 d = _mm512_set1_ps(dj);
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock)))), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock + 16)))), d);
      } else {
        const __m512 d = _mm512_set1_ps(dj);
        const __m512 off = _mm512_set1_ps(w.fmt == kQ4_1 ? ms[j * w.KB + b] : -8.0f * dj);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4)), d, off);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, off);
      }
      for (int i = 0; i < MR; ++i) {
        acc[i][j] = _mm512_fmadd_ps(lo, xlo[i], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(hi, xhi[i], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

void fused512(const Packed& w, int64_t n0, int nr, const float* x, int64_t ldx, int mr, float* out, int64_t ldo,
              float* scales) {
  switch (mr) {
    case 1: fused512_fixed<1>(w, n0, nr, x, ldx, out, ldo, scales); break;
    case 2: fused512_fixed<2>(w, n0, nr, x, ldx, out, ldo, scales); break;
    case 3: fused512_fixed<3>(w, n0, nr, x, ldx, out, ldo, scales); break;
    default: fused512_fixed<4>(w, n0, nr, x, ldx, out, ldo, scales); break;
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);

template <int MR>
constexpr TileFn kTiles512Row[4] = {tile512_fixed<MR, 1>, tile512_fixed<MR, 2>, tile512_fixed<MR, 3>,
                                    tile512_fixed<MR, 4>};

void tile512(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo, int mr, int nr) {
  static const TileFn* const table[4] = {kTiles512Row<1>, kTiles512Row<2>, kTiles512Row<3>, kTiles512Row<4>};
  table[mr - 1][nr - 1](x, ldx, w, K, out, ldo);
}

}  // namespace

// The AVX-512 path of the CPU decode kernel: explicit 16-lane vectors for head dims that are multiples of 16
// (compiled for 64 and 128) and float32 / bfloat16 / float16 K/V. Without AVX-512 decode_avx2.h gives the same in
// 8 lanes; for other dtypes and dims `kHasVectorPath` is false and paged_decode_cpu.cpp's portable loops run.
//
// Why explicit: with 2 threads the portable loops read K/V at ~11 GB/s (batch 64, context 300) against the
// ~21 GB/s this CPU streams, and at ~21 GB/s from cache: they are compute-bound. This path reaches ~18 and
// ~29 GB/s: each K or V row is one to eight vector loads and FMAs per query head, dot products of four
// rows in flight, softmax 16 scores at a time, and the next block prefetched (docs/benchmarks.md, v3).
#if defined(__AVX512F__)
#include <immintrin.h>
#include <type_traits>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const Bf16* p) {  // bfloat16 is float32's upper half: widen by a 16-bit shift
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int kD, typename KV>
constexpr bool kHasVectorPath = (kD == 64 || kD == 128) &&
    (std::is_same_v<KV, float> || std::is_same_v<KV, Bf16> || std::is_same_v<KV, Half>);

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// The four horizontal sums of a0..a3, in that order: interleaving adds fold the four vectors into one whose
// 128-bit lanes each hold a partial sum of every input, then the lanes are added (13 instructions for the four,
// where four separate reductions took ~32: the reductions were a third of the score work).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));  // a0 a1 a0 a1 per lane
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));  // a0 a1 a2 a3 per lane
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(
      _mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of the n rows of one K block against query head qg (already scaled): four rows at a time so
// their FMA chains and horizontal sums overlap.
template <int kD, typename KV>
inline void block_scores(float* dst, const float* qg, const KV* rows, int64_t n) {
  constexpr int NV = kD / 16;
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qg + c * 16);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const KV* r = rows + t * kD;
    __m512 a0 = _mm512_mul_ps(qv[0], load16(r));
    __m512 a1 = _mm512_mul_ps(qv[0], load16(r + kD));
    __m512 a2 = _mm512_mul_ps(qv[0], load16(r + 2 * kD));
    __m512 a3 = _mm512_mul_ps(qv[0], load16(r + 3 * kD));
    for (int c = 1; c < NV; ++c) {
      a0 = _mm512_fmadd_ps(qv[c], load16(r + c * 16), a0);
      a1 = _mm512_fmadd_ps(qv[c], load16(r + kD + c * 16), a1);
      a2 = _mm512_fmadd_ps(qv[c], load16(r + 2 * kD + c * 16), a2);
      a3 = _mm512_fmadd_ps(qv[c], load16(r + 3 * kD + c * 16), a3);
    }
    _mm_storeu_ps(dst + t, sum4(a0, a1, a2, a3));
  }
  for (; t < n; ++t) {
    const KV* r = rows + t * kD;
    __m512 a = _mm512_mul_ps(qv[0], load16(r));
    for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(qv[c], load16(r + c * 16), a);
    dst[t] = _mm512_reduce_add_ps(a);
  }
}

// block_scores for all G query heads of a KV head at once (qs: G pre-scaled rows of kD; head g's scores to dst +
// g * ld): each K row is loaded and widened once for all heads instead of once per head. Per (row, head) the
// products, their order and the four-row sums are block_scores', so the scores are bit for bit the same.
template <int kD, typename KV, int G>
inline void block_scores_heads(float* dst, int64_t ld, const float* qs, const KV* rows, int64_t n) {
  constexpr int NV = kD / 16;
  __m512 qv[G][NV];  // in registers where they fit beside the 4 x G sums (G x NV <= 12)
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) qv[g][c] = _mm512_loadu_ps(qs + g * kD + c * 16);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const KV* r = rows + t * kD;
    __m512 a[4][G];
    for (int j = 0; j < 4; ++j) {
      const __m512 k = load16(r + j * kD);
      for (int g = 0; g < G; ++g) a[j][g] = _mm512_mul_ps(qv[g][0], k);
    }
    for (int c = 1; c < NV; ++c) {
      for (int j = 0; j < 4; ++j) {
        const __m512 k = load16(r + j * kD + c * 16);
        for (int g = 0; g < G; ++g) a[j][g] = _mm512_fmadd_ps(qv[g][c], k, a[j][g]);
      }
    }
    for (int g = 0; g < G; ++g) _mm_storeu_ps(dst + g * ld + t, sum4(a[0][g], a[1][g], a[2][g], a[3][g]));
  }
  for (; t < n; ++t) {
    const KV* r = rows + t * kD;
    __m512 a[G];
    const __m512 k0 = load16(r);
    for (int g = 0; g < G; ++g) a[g] = _mm512_mul_ps(qv[g][0], k0);
    for (int c = 1; c < NV; ++c) {
      const __m512 k = load16(r + c * 16);
      for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(qv[g][c], k, a[g]);
    }
    for (int g = 0; g < G; ++g) dst[g * ld + t] = _mm512_reduce_add_ps(a[g]);
  }
}

// block_values for all G query heads at once (head g's probabilities at p + g * ld, its accumulator at acc + g * kD):
// each V row is loaded and widened once; per head the same FMAs in the same order as block_values.
template <int kD, typename KV, int G>
inline void block_values_heads(float* acc, const float* p, int64_t ld, const KV* rows, int64_t n) {
  constexpr int NV = kD / 16;
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * kD + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    const KV* r = rows + t * kD;
    __m512 v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load16(r + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ld + t]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * kD + c * 16, a[g][c]);
}

// The query heads a KV head serves that the *_heads steps take at once: their accumulators (G x kD / 16 vectors
// for values) must stay in registers. 0: head by head.
template <int kD>
constexpr int64_t kMaxFusedHeads = kD == 64 ? 4 : kD == 128 ? 2 : 0;

// In place: row[0..L) -> exp(row - max); returns 1 / sum. With a sink (a logit with no value) it counts in the
// max and the sum.
inline float softmax_numerators(float* row, int64_t L, const float* sink) {
  __m512 m = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + t));
  if (t < L) m = _mm512_mask_max_ps(m, tail_mask(L - t), m, _mm512_maskz_loadu_ps(tail_mask(L - t), row + t));
  float row_max = _mm512_reduce_max_ps(m);
  if (sink != nullptr) row_max = std::max(row_max, *sink);
  const __m512 mx = _mm512_set1_ps(row_max);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= L; t += 16) {
    const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mx));
    _mm512_storeu_ps(row + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < L) {
    const __mmask16 k = tail_mask(L - t);
    const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), mx));
    _mm512_mask_storeu_ps(row + t, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  const float sink_term = sink != nullptr ? exp_nonpos(*sink - row_max) : 0.f;
  return 1.0f / (_mm512_reduce_add_ps(sum) + sink_term);
}

// In place: row[0..L) -> softcap * tanh(row / softcap), 16 lanes at a time.
inline void softcap_row(float* row, int64_t L, float softcap) {
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) _mm512_storeu_ps(row + t, softcap16(_mm512_loadu_ps(row + t), softcap));
  if (t < L) {
    const __mmask16 k = tail_mask(L - t);
    _mm512_mask_storeu_ps(row + t, k, softcap16(_mm512_maskz_loadu_ps(k, row + t), softcap));
  }
}

// acc (kD floats of one query head) += sum over the block's n rows of p[t] * V[t].
template <int kD, typename KV>
inline void block_values(float* acc, const float* p, const KV* rows, int64_t n) {
  constexpr int NV = kD / 16;
  __m512 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm512_loadu_ps(acc + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 w = _mm512_set1_ps(p[t]);
    const KV* r = rows + t * kD;
    for (int c = 0; c < NV; ++c) a[c] = _mm512_fmadd_ps(w, load16(r + c * 16), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
}

// dst[0..n) = src[0..n) * scale (n a multiple of 16: whole query heads)
inline void scale_rows(float* dst, const float* src, int64_t n, float scale) {
  const __m512 k = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(src + i), k));
}

}  // namespace
#endif

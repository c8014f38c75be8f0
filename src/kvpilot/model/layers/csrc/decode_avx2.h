// The AVX2 path of the CPU decode kernel (CPUs with AVX2, FMA and F16C but no AVX-512: Zen 3, Haswell to Alder
// Lake): decode_avx512.h's steps in 8-lane vectors for head dims 64 and 128 and float32 / bfloat16 / float16 K/V;
// decode_vector.h's attend_one_vector runs them. The portable loops' dot products reduce every row on its own and
// keep each value accumulator in memory: here four rows' sums fold together and the accumulators stay in registers.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <type_traits>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const Bf16* p) {  // bfloat16 is float32's upper half: widen by a 16-bit shift
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <int kD, typename KV>
constexpr bool kHasVectorPath = (kD == 64 || kD == 128) &&
    (std::is_same_v<KV, float> || std::is_same_v<KV, Bf16> || std::is_same_v<KV, Half>);

inline float lanes_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The four horizontal sums of a0..a3, in that order
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit lane: a0 a1 a2 a3
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of the n rows of one K block against query head qg (already scaled): four rows at a time so their FMA
// chains and horizontal sums overlap
template <int kD, typename KV>
inline void block_scores(float* dst, const float* qg, const KV* rows, int64_t n) {
  constexpr int NV = kD / 8;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const KV* r = rows + t * kD;
    __m256 q = _mm256_loadu_ps(qg);
    __m256 a0 = _mm256_mul_ps(q, load8(r)), a1 = _mm256_mul_ps(q, load8(r + kD));
    __m256 a2 = _mm256_mul_ps(q, load8(r + 2 * kD)), a3 = _mm256_mul_ps(q, load8(r + 3 * kD));
    for (int c = 1; c < NV; ++c) {
      q = _mm256_loadu_ps(qg + c * 8);  // from L1: 16 query vectors (dim 128) would not fit in registers
      a0 = _mm256_fmadd_ps(q, load8(r + c * 8), a0);
      a1 = _mm256_fmadd_ps(q, load8(r + kD + c * 8), a1);
      a2 = _mm256_fmadd_ps(q, load8(r + 2 * kD + c * 8), a2);
      a3 = _mm256_fmadd_ps(q, load8(r + 3 * kD + c * 8), a3);
    }
    _mm_storeu_ps(dst + t, sum4(a0, a1, a2, a3));
  }
  for (; t < n; ++t) {
    const KV* r = rows + t * kD;
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), load8(r));
    for (int c = 1; c < NV; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c * 8), load8(r + c * 8), a);
    dst[t] = lanes_sum8(a);
  }
}

// In place: row[0..L) -> softcap * tanh(row / softcap) (decode_common.h's loop: rare, Gemma 2 only)
inline void softcap_row(float* row, int64_t L, float softcap) { softcap_scores(row, L, softcap); }

// In place: row[0..L) -> exp(row - max); returns 1 / sum. With a sink (a logit with no value) it counts in the
// max and the sum.
inline float softmax_numerators(float* row, int64_t L, const float* sink) {
  __m256 m = _mm256_set1_ps(std::numeric_limits<float>::lowest());
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + t));
  float row_max = lanes_max8(m);
  for (int64_t u = t; u < L; ++u) row_max = std::max(row_max, row[u]);
  if (sink != nullptr) row_max = std::max(row_max, *sink);
  const __m256 mx = _mm256_set1_ps(row_max);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= L; t += 8) {
    const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(row + t), mx));
    _mm256_storeu_ps(row + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = lanes_sum8(sum);
  for (; t < L; ++t) {
    row[t] = exp_nonpos(row[t] - row_max);
    total += row[t];
  }
  return 1.0f / (total + (sink != nullptr ? exp_nonpos(*sink - row_max) : 0.f));
}

// acc (kD floats of one query head) += sum over the block's n rows of p[t] * V[t]
template <int kD, typename KV>
inline void block_values(float* acc, const float* p, const KV* rows, int64_t n) {
  constexpr int NV = kD / 8;
  __m256 a[NV];
  for (int c = 0; c < NV; ++c) a[c] = _mm256_loadu_ps(acc + c * 8);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const KV* r = rows + t * kD;
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(w, load8(r + c * 8), a[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + c * 8, a[c]);
}

// dst[0..n) = src[0..n) * scale (n a multiple of 8: whole query heads)
inline void scale_rows(float* dst, const float* src, int64_t n, float scale) {
  const __m256 k = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), k));
}

}  // namespace
#endif

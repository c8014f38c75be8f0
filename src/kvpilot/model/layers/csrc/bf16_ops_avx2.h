// AVX2 rows of the bf16 small ops (concatenated after bf16_ops_avx512.h, before bf16_ops_cpu.cpp, which calls them)
// for CPUs with AVX2 and FMA but no AVX-512 (Zen 3, Haswell to Alder Lake): bf16_ops_avx512.h's rows in 8 float32
// lanes, step for step (RMSNorm's sum of squares in 8 lanes, SiLU's exp simd_exp.h's polynomial in exp_nonpos8).
// Why: the scalar loops they replace (std::exp a value, a rounding function call a value) took ~15 us a decode
// step's layer for SiLU-and-mul alone on the embedded model, and a prompt's rows as many times over.
// Widths as the AVX-512 rows take them (norm and SiLU multiples of 16, rotations of 32), so the scalar rows keep
// the same widths on every CPU. Target attributes, not -march: bf16_avx2() checks the CPU at run time.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#define KVP_BF16_AVX2 __attribute__((target("avx2,fma")))

namespace {

inline bool bf16_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// 8 bfloat16 values widened to float32
KVP_BF16_AVX2 inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// float32 -> bfloat16 bits, round to nearest even as torch (NaN stays a quiet NaN), in the low half of 32-bit lanes
KVP_BF16_AVX2 inline __m256i round_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)),
                                            16);
  // both sides non-negative as int32, so the signed compare is the unsigned one
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

KVP_BF16_AVX2 inline __m256 bf16_round_trip8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16x8(v), 16));
}

KVP_BF16_AVX2 inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i r = round_bf16x8(v);  // each lane <= 0xFFFF: the unsigned saturating pack keeps it
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// out = bf16(a + b) for one row, K a multiple of 8 (add_row512's arithmetic in 8 lanes)
KVP_BF16_AVX2 void add_row256(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t K) {
  for (int64_t k = 0; k < K; k += 8) store_bf16x8(out + k, _mm256_add_ps(load_bf16x8(a + k), load_bf16x8(b + k)));
}

// RMSNorm of one row, K a multiple of 16: norm_row's arithmetic with the sum of squares in 8 lanes
KVP_BF16_AVX2 void norm_row256(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t K, float eps) {
  __m256 sums = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = load_bf16x8(x + k);
    sums = _mm256_fmadd_ps(v, v, sums);
  }
  const float inv = 1.0f / std::sqrt(lanes_sum8(sums) / static_cast<float>(K) + eps);
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 normed = bf16_round_trip8(_mm256_mul_ps(load_bf16x8(x + k), scale));
    store_bf16x8(out + k, _mm256_mul_ps(load_bf16x8(w + k), normed));
  }
}

// The rotary embedding of one head row, D a multiple of 32: rope_bf16's arithmetic, 8 values at a time
KVP_BF16_AVX2 void rope_row256(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* o, int64_t D) {
  const int64_t half = D / 2;
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
  for (int64_t j = 0; j < D; j += 8) {
    const __m256 xj = load_bf16x8(x + j);
    const __m256 other = load_bf16x8(x + (j < half ? j + half : j - half));
    const __m256 rot = j < half ? _mm256_xor_ps(other, sign) : other;
    const __m256 a = bf16_round_trip8(_mm256_mul_ps(xj, load_bf16x8(c + j)));
    const __m256 b = bf16_round_trip8(_mm256_mul_ps(rot, load_bf16x8(s + j)));
    store_bf16x8(o + j, _mm256_add_ps(a, b));
  }
}

// silu(g) = g / (1 + exp(-g)), as g * e / (1 + e) with e = exp(g) for g < 0 so that exp never overflows
KVP_BF16_AVX2 inline __m256 silu8(__m256 g) {
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = exp_nonpos8(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), g, negative));
  const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), negative);
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// out = bf16(bf16(silu(gate)) * up) over I values, I a multiple of 16: silu_mul_row's arithmetic
KVP_BF16_AVX2 void silu_mul_row256(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t I) {
  for (int64_t i = 0; i < I; i += 8) {
    const __m256 act = bf16_round_trip8(silu8(load_bf16x8(gate + i)));
    store_bf16x8(out + i, _mm256_mul_ps(act, load_bf16x8(up + i)));
  }
}

// The first n - n % 8 values of a row widened to float32 (exact) / rounded to bfloat16; the caller converts the rest
KVP_BF16_AVX2 void widen_row256(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load_bf16x8(in + i));
}

KVP_BF16_AVX2 void narrow_row256(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8) store_bf16x8(out + i, _mm256_loadu_ps(in + i));
}

}  // namespace

#pragma GCC pop_options
#else
namespace {
inline bool bf16_avx2() { return false; }
inline void widen_row256(const uint16_t*, float*, int64_t) {}
inline void narrow_row256(const float*, uint16_t*, int64_t) {}
inline void norm_row256(const uint16_t*, const uint16_t*, uint16_t*, int64_t, float) {}
inline void add_row256(const uint16_t*, const uint16_t*, uint16_t*, int64_t) {}
inline void rope_row256(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t) {}
inline void silu_mul_row256(const uint16_t*, const uint16_t*, uint16_t*, int64_t) {}
}  // namespace
#endif

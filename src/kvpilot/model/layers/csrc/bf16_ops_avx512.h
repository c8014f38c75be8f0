// AVX-512 rows of the bf16 small ops (concatenated after simd_exp.h, before bf16_ops_cpu.cpp, which calls them):
// RMSNorm, the rotary embedding and SiLU-and-mul, 16 float32 lanes at a time (and the fused decode layer's
// widening and rounding of attention rows). Why: the scalar loops took ~0.5 us a
// row; a 1,536-token prefill step of the embedded model spent ~110 ms of ~1,080 in them.
//
// RMSNorm and RoPE compute what their scalar twins in bf16_ops_cpu.cpp compute, rounding for rounding (products
// rounded to bfloat16 where torch rounds them), except RMSNorm's sum of squares, summed in 16 lanes (an order
// torch does not use either). SiLU uses simd_exp.h's polynomial exp, the scalar twin std::exp. Built with target
// attributes, not -march, so one module serves any CPU and these run only where it has AVX-512 (bf16_avx512()
// checks at run time); elsewhere (not x86) they are never-called stubs.
#include <cmath>
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#define KVP_BF16_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace {

inline bool bf16_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

// 16 bfloat16 values widened to float32
KVP_BF16_AVX512 inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> bfloat16 bits, round to nearest even as torch (NaN stays a quiet NaN), in the low half of 32-bit lanes
KVP_BF16_AVX512 inline __m512i round_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)),
                                            16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

// v rounded to bfloat16 and widened back (a torch bf16 result used as the next op's float32 operand)
KVP_BF16_AVX512 inline __m512 bf16_round_trip(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16x16(v), 16));
}

KVP_BF16_AVX512 inline void store_bf16x16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16x16(v)));
}

// RMSNorm of one row, K a multiple of 16: norm_row's arithmetic with the sum of squares in 16 lanes
KVP_BF16_AVX512 void norm_row512(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t K, float eps) {
  __m512 sums = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load_bf16x16(x + k);
    sums = _mm512_fmadd_ps(v, v, sums);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sums) / static_cast<float>(K) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 normed = bf16_round_trip(_mm512_mul_ps(load_bf16x16(x + k), scale));
    store_bf16x16(out + k, _mm512_mul_ps(load_bf16x16(w + k), normed));
  }
}

// The rotary embedding of one head row, D a multiple of 32: rope_bf16's arithmetic, 16 values at a time
KVP_BF16_AVX512 void rope_row512(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* o, int64_t D) {
  const int64_t half = D / 2;
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int64_t j = 0; j < D; j += 16) {
    const __m512 xj = load_bf16x16(x + j);
    const __m512 other = load_bf16x16(x + (j < half ? j + half : j - half));
    const __m512 rot = j < half ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(other), sign)) : other;
    const __m512 a = bf16_round_trip(_mm512_mul_ps(xj, load_bf16x16(c + j)));
    const __m512 b = bf16_round_trip(_mm512_mul_ps(rot, load_bf16x16(s + j)));
    store_bf16x16(o + j, _mm512_add_ps(a, b));
  }
}

// silu(g) = g / (1 + exp(-g)), as g * e / (1 + e) with e = exp(g) for g < 0 so that exp never overflows
KVP_BF16_AVX512 inline __m512 silu16(__m512 g) {
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 e = exp_nonpos16(_mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_setzero_ps(), g), g));
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
  const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
  return _mm512_div_ps(numerator, denominator);
}

// out = bf16(bf16(silu(gate)) * up) over I values, I a multiple of 16: silu_mul_row's arithmetic
KVP_BF16_AVX512 void silu_mul_row512(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __m512 act = bf16_round_trip(silu16(load_bf16x16(gate + i)));
    store_bf16x16(out + i, _mm512_mul_ps(act, load_bf16x16(up + i)));
  }
}

// out = bf16(a + b) for one row, K a multiple of 16 (the float32 sum rounded once, as torch adds bf16 tensors)
KVP_BF16_AVX512 void add_row512(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t K) {
  for (int64_t k = 0; k < K; k += 16) store_bf16x16(out + k, _mm512_add_ps(load_bf16x16(a + k), load_bf16x16(b + k)));
}

// The first n - n % 16 values of a row widened to float32 (exact) / rounded to bfloat16 (nearest even, as torch);
// the caller converts the rest
KVP_BF16_AVX512 void widen_row512(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, load_bf16x16(in + i));
}

KVP_BF16_AVX512 void narrow_row512(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) store_bf16x16(out + i, _mm512_loadu_ps(in + i));
}

}  // namespace

#pragma GCC pop_options
#else
namespace {
inline bool bf16_avx512() { return false; }
inline void widen_row512(const uint16_t*, float*, int64_t) {}
inline void narrow_row512(const float*, uint16_t*, int64_t) {}
inline void norm_row512(const uint16_t*, const uint16_t*, uint16_t*, int64_t, float) {}
inline void add_row512(const uint16_t*, const uint16_t*, uint16_t*, int64_t) {}
inline void rope_row512(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t) {}
inline void silu_mul_row512(const uint16_t*, const uint16_t*, uint16_t*, int64_t) {}
}  // namespace
#endif

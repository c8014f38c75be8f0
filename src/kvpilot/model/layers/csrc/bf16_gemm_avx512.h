// y[M, N] = x[M, K] . W[N, K]^T (+ bias) on bfloat16 x and W, W as nn.Linear stores it (row-major [out, in]), with
// AVX512_BF16 dot products (vdpbf16ps), float32 sums, out float32 or bfloat16 (the sum + bias rounded once, to
// nearest even). Concatenated after bf16_ops_avx512.h (its round_bf16x16's rounding) and before bf16_ops_cpu.cpp.
//
// Why: a decode step multiplies few rows by every weight, so it is bound by the weight bytes read. oneDNN's bf16
// GEMM, prepacked or not, read them at ~half the memory bandwidth at 1-16 rows, and a vocabulary-wide output
// layer (the embedding table, never prepacked) was reordered on every call. Here W is read once, in its own
// layout, each 4-row block prefetched ahead of its use, and multiplied by up to 4 x rows at a time in registers.
//
// Invariant (batch-invariance): every output is summed in one order whatever M, the blocking or the threads:
// k in 32-value chunks, in order, into 16 float32 lanes (each lane adds a pair of products per chunk, as
// vdpbf16ps defines), then the 16 lanes by one fixed tree (reduce4). So a row's result does not depend on which
// other rows share the call. Built with target attributes (one module serves any x86 CPU); bf16_gemm_avx512()
// says at run time whether this CPU has the instructions.
#include <algorithm>
#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

#define KVP_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

namespace {

inline bool bf16_gemm_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

constexpr int64_t kGemmRows = 4;        // W rows (outputs) of a block, one accumulator each per x row
constexpr int64_t kGemmMaxMr = 4;       // x rows of a block
constexpr int64_t kPrefetchBlocks = 2;  // W blocks ahead of the one being multiplied

// The 4 sums of 4 accumulators' lanes, one fixed tree for each: lanes i and i + 2 of each 128-bit quarter, then
// i and i + 1, then the quarters 0 + 2, 1 + 3, then those two.
KVP_BF16_DOT inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Where a block's results go: `out` [M, N] (ld N) float32 or bfloat16, `bias` [N] bfloat16 or null.
struct GemmOut {
  void* out;
  bool bf16;
  const uint16_t* bias;
  int64_t N;
};

KVP_BF16_DOT inline void store_block(const GemmOut& o, int64_t m, int64_t n0, int64_t valid, __m128 sums) {
  const __mmask8 mask = static_cast<__mmask8>((1u << valid) - 1);
  if (o.bias != nullptr) {
    const __m128i raw = _mm_maskz_loadu_epi16(mask, o.bias + n0);
    sums = _mm_add_ps(sums, _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16)));
  }
  if (!o.bf16) {
    _mm_mask_storeu_ps(static_cast<float*>(o.out) + m * o.N + n0, mask, sums);
    return;
  }
  const __m512i rounded = round_bf16x16(_mm512_castps128_ps512(sums));
  _mm_mask_storeu_epi16(static_cast<uint16_t*>(o.out) + m * o.N + n0, mask,
                        _mm256_castsi256_si128(_mm512_cvtepi32_epi16(rounded)));
}

// MR x rows (stride ldx) times the 4 W rows `w[j]` (K values each); `pf`, when not null, W rows to prefetch, one
// cache line per row and 32-value chunk, rows [pf_first, pf_end).
template <int MR>
KVP_BF16_DOT inline void gemm_block(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t K,
                                    const GemmOut& o, int64_t m, int64_t n0, int64_t valid,
                                    const uint16_t* const* pf, int pf_first, int pf_end) {
  __m512 acc[MR][kGemmRows];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kGemmRows; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[kGemmRows];
    for (int j = 0; j < kGemmRows; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + k);
    if (pf != nullptr)
      for (int j = pf_first; j < pf_end; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf[j] + k), _MM_HINT_T0);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
      for (int j = 0; j < kGemmRows; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  if (k < K) {  // the last chunk, zero-filled (zero products leave the sums as they are)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[kGemmRows];
    for (int j = 0; j < kGemmRows; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[j] + k);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
      for (int j = 0; j < kGemmRows; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < MR; ++r) store_block(o, m + r, n0, valid, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// The W rows of block b (a short last block repeats its first row: read, never stored)
inline void block_rows(const uint16_t* w, int64_t K, int64_t N, int64_t b, const uint16_t** rows, int64_t* valid) {
  const int64_t n0 = b * kGemmRows;
  *valid = std::min<int64_t>(kGemmRows, N - n0);
  for (int64_t j = 0; j < kGemmRows; ++j) rows[j] = w + (n0 + (j < *valid ? j : 0)) * K;
}

// The M x rows in groups of up to 4 times W block b; `pf`'s rows spread over the groups (null: none).
KVP_BF16_DOT inline void gemm_rows(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, const GemmOut& o,
                                   int64_t b, const uint16_t* const* pf) {
  const uint16_t* rows[kGemmRows];
  int64_t valid;
  block_rows(w, K, o.N, b, rows, &valid);
  const int64_t n0 = b * kGemmRows, groups = (M + kGemmMaxMr - 1) / kGemmMaxMr;
  for (int64_t g = 0, m = 0; m < M; ++g, m += kGemmMaxMr) {
    // the prefetched rows spread over the groups, so the loads stream while every group computes
    const int first = static_cast<int>(g * kGemmRows / groups), end = static_cast<int>((g + 1) * kGemmRows / groups);
    const uint16_t* xr = x + m * K;
    switch (std::min<int64_t>(kGemmMaxMr, M - m)) {
      case 4: gemm_block<4>(xr, K, rows, K, o, m, n0, valid, pf, first, end); break;
      case 3: gemm_block<3>(xr, K, rows, K, o, m, n0, valid, pf, first, end); break;
      case 2: gemm_block<2>(xr, K, rows, K, o, m, n0, valid, pf, first, end); break;
      default: gemm_block<1>(xr, K, rows, K, o, m, n0, valid, pf, first, end); break;
    }
  }
}

// Blocks [b0, b1), each against all x rows in turn: W streams in once, prefetched kPrefetchBlocks blocks ahead,
// and the rows stay in cache (measured against splitting W into cache-sized chunks that each group of rows passes
// in turn: as fast or faster at every M up to 128).
KVP_BF16_DOT void bf16_gemm_blocks(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, const GemmOut& o,
                                   int64_t b0, int64_t b1) {
  const int64_t num_blocks = (o.N + kGemmRows - 1) / kGemmRows;
  const uint16_t* pf_rows[kGemmRows];
  for (int64_t b = b0; b < b1; ++b) {
    const bool ahead = b + kPrefetchBlocks < num_blocks;
    if (ahead) {
      int64_t unused;
      block_rows(w, K, o.N, b + kPrefetchBlocks, pf_rows, &unused);
    }
    gemm_rows(x, M, w, K, o, b, ahead ? pf_rows : nullptr);
  }
}

}  // namespace

#pragma GCC pop_options

#else
namespace {
inline bool bf16_gemm_avx512() { return false; }
struct GemmOut {
  void* out;
  bool bf16;
  const uint16_t* bias;
  int64_t N;
};
constexpr int64_t kGemmRows = 4;
inline void bf16_gemm_blocks(const uint16_t*, int64_t, const uint16_t*, int64_t, const GemmOut&, int64_t, int64_t) {}
}  // namespace
#endif

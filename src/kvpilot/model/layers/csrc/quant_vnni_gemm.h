// The int8 GEMM for many rows (prefill, big batches): Q4_0 / Q4_1 / Q8_0 weights in a column-tiled copy times
// int8-quantized activations (quantize_row_q8, llama.cpp's q8 scheme), by AVX-512 VNNI dot products.
//
// Why a second layout: the interleaved one (quant_vnni.h) puts 8 blocks of one weight row in a register, which
// is right for a few rows but ends every output value with a horizontal sum. Here a 512-bit register holds 16
// weight rows (output columns) side by side, 4 values each, so one vpdpbusd advances 16 outputs of one x row and
// an 8-row tile of x reuses every weight register 8 times: no horizontal sums, and the block scaling is two FMAs
// per 16 outputs and block.
//
// The tiled layout (kvpilot/model/quant/vnni_gemm.py builds it at load): for each tile of 16 weight rows and each
// block b, Q4: 256 bytes: pair p (0..3) holds, for weight row j of the tile, 4 bytes: the GGUF nibble bytes
// 4p..4p+3 of that row's block (low nibble: values 4p.., high nibble: values 16 + 4p..); Q8_0: 512 bytes: group g
// (0..7) holds values 4g..4g+3 of each row as q + 128 (vpdpbusd's unsigned operand). td / to: float16
// [N / 16, KB, 16], the block scales and offsets, so a value is d * q + o. Only Q4_1 stores its offsets (m); Q4_0's
// and Q8_0's are -8 d and -128 d, exact in float32 from d, so their tiles carry none (to == nullptr): a stream of
// 32 bytes a block less to read (docs/benchmark-log.md, 2026-12-02).
namespace {

// The offset of a block of Q4 (Q4_0) or Q8 (Q8_0) tiles that carry none, as a multiple of its scale
template <bool Q8>
constexpr float kDerivedOffset = Q8 ? -128.f : -8.f;

// The 16 offsets of a tile's block: stored (to) or derived from the scales d
template <bool Q8>
KVP_VNNI inline __m512 block_offsets512(const uint16_t* to, int64_t s, __m512 d) {
  if (to == nullptr) return _mm512_mul_ps(d, _mm512_set1_ps(kDerivedOffset<Q8>));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(to + s)));
}

// x rows per call: one tile (16 columns) takes 8 rows (8 int32 and 8 float accumulators); a pair of tiles (32
// columns) takes 4 (the same 16 registers), so every broadcast x value feeds two vpdpbusd instead of one: a
// broadcast load per vpdpbusd held the VNNI units to ~73% of their rate (a loop of independent vpdpbusd on one core
// of the EPYC family 26: 7.1 G/s, 5.2 G/s with a broadcast load each). Pairs from kPairMinRows rows, where the GEMM
// is compute-bound (faster from 24 rows in the embedded model's decode step, even at 16); below, the weights stream
// from memory and pairs were slower (docs/benchmark-log.md, "Figures moved out of the code").
constexpr int kTiledMR = 8;
constexpr int kPairMR = 4;
constexpr int64_t kPairMinRows = 16;

// out[r * ldo + 16 j + c] for x rows r < MR and tiles j < NT (tile j's blocks KB * width bytes after tile j - 1's):
// per block, the int32 dot products of each row with 16 weight rows, then d * xd * dot + o * xs into float sums.
// Each output value sees the same operations in the same order whatever NT is.
template <int MR, int NT, bool Q8>
KVP_VNNI void tiled_tile(const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB, const int8_t* xq,
                         const float* xd, const float* xs, int64_t K, float* out, int64_t ldo) {
  constexpr int64_t width = Q8 ? 512 : 256;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512i dot[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NT; ++j) dot[r][j] = _mm512_setzero_si512();
    for (int g = 0; Q8 && g < 8; ++g) {
      __m512i w[NT];
      for (int j = 0; j < NT; ++j) w[j] = _mm512_loadu_si512(tq + (j * KB + b) * width + g * 64);
      for (int r = 0; r < MR; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + b * kBlock + 4 * g, 4);
        const __m512i x = _mm512_set1_epi32(x4);
        for (int j = 0; j < NT; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], x);
      }
    }
    for (int p = 0; !Q8 && p < 4; ++p) {
      __m512i lo[NT], hi[NT];
      for (int j = 0; j < NT; ++j) {
        const __m512i raw = _mm512_loadu_si512(tq + (j * KB + b) * width + p * 64);
        lo[j] = _mm512_and_si512(raw, low4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq + r * K + b * kBlock + 4 * p;
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, x, 4);
        std::memcpy(&x_hi, x + 16, 4);
        const __m512i xl = _mm512_set1_epi32(x_lo), xh = _mm512_set1_epi32(x_hi);
        for (int j = 0; j < NT; ++j) {
          dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], lo[j], xl);
          dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], hi[j], xh);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const int64_t s = (j * KB + b) * 16;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(td + s)));
      const __m512 o = block_offsets512<Q8>(to, s, d);
      for (int r = 0; r < MR; ++r) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * KB + b])),
                                    acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[r * KB + b]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) _mm512_storeu_ps(out + r * ldo + 16 * j, acc[r][j]);
}

// tiled_tile for mr (1..MR) rows: the template for that count
template <int MR, int NT, bool Q8>
KVP_VNNI void tiled_tile_rows(int64_t mr, const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB,
                              const int8_t* xq, const float* xd, const float* xs, int64_t K, float* out, int64_t ldo) {
  if constexpr (MR > 1) {
    if (mr < MR) return tiled_tile_rows<MR - 1, NT, Q8>(mr, tq, td, to, KB, xq, xd, xs, K, out, ldo);
  }
  tiled_tile<MR, NT, Q8>(tq, td, to, KB, xq, xd, xs, K, out, ldo);
}

// out[i * ldo + 16 (t - t0) + c] for x rows i < M and the weight-row tiles t in [t0, t1) (16 weight rows each; from
// kPairMinRows rows in pairs, a last odd one alone): float32, or bfloat16 (rounded to nearest even, as torch) when
// out_bf16 is given instead
template <bool Q8>
KVP_VNNI void tiled_rows(const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB, int64_t t0,
                         int64_t t1, const int8_t* xq, const float* xd, const float* xs, int64_t M, float* out,
                         uint16_t* out_bf16, int64_t ldo) {
  const int64_t K = KB * kBlock;
  float tile_out[std::max(kTiledMR * 16, kPairMR * 32)];
  for (int64_t t = t0; t < t1;) {  // the tiles' weights (KB * 256 bytes each) stay in L1 across all x rows
    const int nt = t + 1 < t1 && M >= kPairMinRows ? 2 : 1, step = nt == 2 ? kPairMR : kTiledMR;
    const uint8_t* q = tq + t * KB * (Q8 ? 512 : 256);
    const uint16_t* d = td + t * KB * 16;
    const uint16_t* o = to != nullptr ? to + t * KB * 16 : nullptr;
    for (int64_t i = 0; i < M; i += step) {
      const int64_t mr = std::min<int64_t>(step, M - i);
      const int8_t* x = xq + i * K;
      const float* xdi = xd + i * KB;
      const float* xsi = xs + i * KB;
      float* dst = out_bf16 != nullptr ? tile_out : out + i * ldo + (t - t0) * 16;
      const int64_t ld = out_bf16 != nullptr ? 16 * nt : ldo;
      if (nt == 2) tiled_tile_rows<kPairMR, 2, Q8>(mr, q, d, o, KB, x, xdi, xsi, K, dst, ld);
      else tiled_tile_rows<kTiledMR, 1, Q8>(mr, q, d, o, KB, x, xdi, xsi, K, dst, ld);
      if (out_bf16 != nullptr)
        for (int64_t r = 0; r < mr; ++r)
          to_bf16_512(tile_out + r * 16 * nt, out_bf16 + (i + r) * ldo + (t - t0) * 16, 16 * nt);
    }
    t += nt;
  }
}

// The dense [16 * (t1 - t0), K] rows of tiles [t0, t1): d * q + o per block (one fused multiply-add, as the packed
// blocks' own dequantization; offsets as tiled_tile's), float32 into out or rounded to bfloat16 (nearest even) into
// out_bf16; row n of
// the result at (n - 16 t0) * K. A row's block gathers its 4-byte groups back into GGUF order: Q4 16 nibble bytes
// (low nibbles values 0..15, high 16..31), Q8_0 32 bytes of q + 128.
template <bool Q8>
KVP_VNNI void tiled_dequant_rows(const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB, int64_t t0,
                                 int64_t t1, float* out, uint16_t* out_bf16) {
  const int64_t K = KB * kBlock, width = Q8 ? 512 : 256;
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  alignas(64) float block[kBlock];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* w = tq + (t * KB + b) * width;
      const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(td + (t * KB + b) * 16)));
      const __m512 o16 = block_offsets512<Q8>(to, (t * KB + b) * 16, d16);
      alignas(64) float ds[16], os[16];
      _mm512_store_ps(ds, d16);
      _mm512_store_ps(os, o16);
      for (int64_t r = 0; r < 16; ++r) {
        int32_t g[8];
        for (int p = 0; p < (Q8 ? 8 : 4); ++p) std::memcpy(g + p, w + p * 64 + r * 4, 4);
        const __m512 d = _mm512_set1_ps(ds[r]), o = _mm512_set1_ps(os[r]);
        __m512 lo, hi;
        if (Q8) {
          lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g))));
          hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 4))));
        } else {
          const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
          lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4));
          hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        }
        const int64_t row = (t - t0) * 16 + r;
        if (out_bf16 != nullptr) {
          _mm512_store_ps(block, _mm512_fmadd_ps(lo, d, o));
          _mm512_store_ps(block + 16, _mm512_fmadd_ps(hi, d, o));
          to_bf16_512(block, out_bf16 + row * K + b * kBlock, kBlock);
        } else {
          _mm512_storeu_ps(out + row * K + b * kBlock, _mm512_fmadd_ps(lo, d, o));
          _mm512_storeu_ps(out + row * K + b * kBlock + 16, _mm512_fmadd_ps(hi, d, o));
        }
      }
    }
}

}  // namespace

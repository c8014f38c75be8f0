// The column-tiled int8 GEMM (quant_vnni_gemm.h's layout and activations) on AVX2 CPUs without AVX-512 VNNI, for
// Q4_0 / Q4_1 / Q8_0 tiles. vpdpbusd (4 u8 x s8 products summed into an int32 lane) is emulated by vpmaddubsw
// (pairs into saturating int16) and vpmaddwd with ones (pairs of those into int32):
// - Q4: unsigned nibbles (0..15) times activations in [-127, 127]: a pair is at most 2 * 15 * 127 = 3810, so the
//   8 pairs of a block's row (4 byte groups, low and high nibbles) add up in int16 (<= 30480) before one vpmaddwd.
// - Q8_0: the tiles hold q + 128, which vpmaddubsw's saturation cannot take (2 * 255 * 127). The signs move to the
//   activations instead (llama.cpp's AVX2 trick): |q| as unsigned times sign(q) * x, a pair at most 2 * 128 * 127.
//   That sums q * x itself, so the block's offset term (o = -128 d times xd * sum(x)) is left out: the same value
//   as the VNNI kernel's d * xd * sum((q + 128) x) + o * xs in exact arithmetic, with less rounding.
// An 16-row tile is two 8-lane halves. Built after quant_vnni_gemm.h, in quant_linear_cpu.cpp's translation unit.
namespace {

constexpr int kTiledMR256 = 4;  // x rows per call: 4 x 2 float accumulators, the weights' 4 registers, spills of int16 sums

KVP_AVX2 inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVP_AVX2 inline int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// quantize_row_q8 (quant_vnni.h) in 8-lane vectors: the same scale, the same rounding of x * 127 / amax to nearest
// even and the same sums, so both ISAs quantize a row to the same int8 blocks
KVP_AVX2 void quantize_row_q8_256(const float* x, int64_t KB, int8_t* xq, float* xd, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs leave 4-byte groups lane-interleaved
  for (int64_t b = 0; b < KB; ++b) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    const float amax = hmax256(m);
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock), _mm256_permutevar8x32_epi32(packed, order));
    xd[b] = d;
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    xs[b] = d * static_cast<float>(hsum256_epi32(sum));
  }
}

// 4 x bytes at p broadcast to every 4-byte group
inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Block b's int32 dot products of MR x rows with one tile's 16 weight rows (dot[r][h]: rows 8h..8h+7)
template <int MR, bool Q8>
KVP_AVX2 inline void block_dots256(const uint8_t* w, const int8_t* xq, int64_t K, int64_t b, __m256i (&dot)[MR][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      __m256i q[2], mag[2];
      for (int h = 0; h < 2; ++h) {
        q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + h * 32)), flip);
        mag[h] = _mm256_abs_epi8(q[h]);
      }
      for (int r = 0; r < MR; ++r) {
        const __m256i x = _mm256_set1_epi32(load4(xq + r * K + b * kBlock + 4 * g));
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(x, q[h]));
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i sums[MR][2];
    for (int r = 0; r < MR; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + h * 32));
        lo[h] = _mm256_and_si256(raw, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq + r * K + b * kBlock + 4 * p;
        const __m256i xl = _mm256_set1_epi32(load4(x)), xh = _mm256_set1_epi32(load4(x + 16));
        for (int h = 0; h < 2; ++h) {
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_maddubs_epi16(lo[h], xl));
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_maddubs_epi16(hi[h], xh));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(sums[r][h], ones);
  }
}

// out[r * ldo + c] for x rows r < MR and the 16 columns of one tile: tiled_tile's sums, per block d * xd * dot
// (+ o * xs for Q4) into float32 accumulators
template <int MR, bool Q8>
KVP_AVX2 void tiled_tile256(const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB, const int8_t* xq,
                            const float* xd, const float* xs, int64_t K, float* out, int64_t ldo) {
  constexpr int64_t width = Q8 ? 512 : 256;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m256i dot[MR][2];
    block_dots256<MR, Q8>(tq + b * width, xq, K, b, dot);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(td + b * 16 + 8 * h)));
      const __m256 o = to != nullptr
          ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(to + b * 16 + 8 * h)))
          : _mm256_mul_ps(d, _mm256_set1_ps(kDerivedOffset<Q8>));
      for (int r = 0; r < MR; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * KB + b])),
                                    acc[r][h]);
        if constexpr (!Q8) acc[r][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[r * KB + b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r][h]);
}

template <int MR, bool Q8>
KVP_AVX2 void tiled_tile256_rows(int64_t mr, const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB,
                                 const int8_t* xq, const float* xd, const float* xs, int64_t K, float* out,
                                 int64_t ldo) {
  if constexpr (MR > 1) {
    if (mr < MR) return tiled_tile256_rows<MR - 1, Q8>(mr, tq, td, to, KB, xq, xd, xs, K, out, ldo);
  }
  tiled_tile256<MR, Q8>(tq, td, to, KB, xq, xd, xs, K, out, ldo);
}

// tiled_rows (quant_vnni_gemm.h) on AVX2: the same arguments and outputs, one tile at a time
template <bool Q8>
KVP_AVX2 void tiled_rows256(const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB, int64_t t0,
                            int64_t t1, const int8_t* xq, const float* xd, const float* xs, int64_t M, float* out,
                            uint16_t* out_bf16, int64_t ldo) {
  const int64_t K = KB * kBlock;
  float tile_out[kTiledMR256 * 16];
  for (int64_t t = t0; t < t1; ++t) {  // a tile's weights (KB * 256 or 512 bytes) stay in L1 across all x rows
    const uint8_t* q = tq + t * KB * (Q8 ? 512 : 256);
    const uint16_t* d = td + t * KB * 16;
    const uint16_t* o = to != nullptr ? to + t * KB * 16 : nullptr;
    for (int64_t i = 0; i < M; i += kTiledMR256) {
      const int64_t mr = std::min<int64_t>(kTiledMR256, M - i);
      float* dst = out_bf16 != nullptr ? tile_out : out + i * ldo + (t - t0) * 16;
      const int64_t ld = out_bf16 != nullptr ? 16 : ldo;
      tiled_tile256_rows<kTiledMR256, Q8>(mr, q, d, o, KB, xq + i * K, xd + i * KB, xs + i * KB, K, dst, ld);
      if (out_bf16 != nullptr)
        for (int64_t r = 0; r < mr; ++r) to_bf16_scalar(tile_out + r * 16, out_bf16 + (i + r) * ldo + (t - t0) * 16, 16);
    }
  }
}

// tiled_dequant_rows (quant_vnni_gemm.h) without AVX-512: the same values, d * q + o by one fused multiply-add
template <bool Q8>
KVP_AVX2 void tiled_dequant_rows256(const uint8_t* tq, const uint16_t* td, const uint16_t* to, int64_t KB, int64_t t0,
                                   int64_t t1, float* out, uint16_t* out_bf16) {
  const int64_t K = KB * kBlock, width = Q8 ? 512 : 256;
  float block[kBlock];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* w = tq + (t * KB + b) * width;
      for (int64_t r = 0; r < 16; ++r) {
        const float d = _cvtsh_ss(td[(t * KB + b) * 16 + r]);
        const float o = to != nullptr ? _cvtsh_ss(to[(t * KB + b) * 16 + r]) : d * kDerivedOffset<Q8>;
        const int64_t row = (t - t0) * 16 + r;
        float* dst = out_bf16 != nullptr ? block : out + row * K + b * kBlock;
        for (int p = 0; p < (Q8 ? 8 : 4); ++p)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = w[p * 64 + r * 4 + k];
            if (Q8) {
              dst[4 * p + k] = std::fma(static_cast<float>(byte), d, o);
            } else {
              dst[4 * p + k] = std::fma(static_cast<float>(byte & 0x0F), d, o);
              dst[16 + 4 * p + k] = std::fma(static_cast<float>(byte >> 4), d, o);
            }
          }
        if (out_bf16 != nullptr) to_bf16_scalar(block, out_bf16 + row * K + b * kBlock, kBlock);
      }
    }
}

}  // namespace

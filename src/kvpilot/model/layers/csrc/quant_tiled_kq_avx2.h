// The column-tiled copies of the formats kept as GGUF blocks (quant_tiled_kq.h's layout: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
// IQ4_NL, MXFP4, IQ4_XS) on AVX2 CPUs without AVX-512 VNNI: their int8 GEMM and dense values, as quant_tiled_avx2.h
// does for Q8_0 / Q4_0 / Q4_1. A 16-row tile is two 8-row halves (G = 0, 1: rows 8 G..8 G + 7, the second 32 bytes of
// each 64-byte plane); vpdpbusd is emulated by vpmaddubsw (unsigned weight bytes times int8 x, pairs into saturating
// int16) and vpmaddwd with ones. The int16 sums are widened to int32 before they can saturate (x in [-127, 127]):
// - 4-bit values (Q4_K, 0..15): after 8 vpmaddubsw (8 x 2 x 15 x 127 = 30,480);
// - 5-bit values (Q5_0, Q5_1, Q5_K, 0..31): after 4 (31,496);
// - Q6_K (0..63): after 2 (32,004);
// - the table formats' values + 128 (the VNNI kernel's unsigned bytes) would saturate one pair (2 x 255 x 127), so
//   here they are the signed table values, |v| as unsigned times sign(v) x (llama.cpp's AVX2 trick, as for Q8_0):
//   IQ4_NL / IQ4_XS widened after each vpmaddubsw (2 x 127 x 127 = 32,258), MXFP4 (|v| <= 12) after 8. Their sums are
//   v . x itself, so the offset term (-128 d times x's block sum) is left out: the same value in exact arithmetic
//   as the VNNI kernel's, with less rounding.
// Built after quant_tiled_kq.h (KTile, ktile_qbytes) and quant_tiled_avx2.h (kTiledMR256, load4).
namespace {

template <int F>
constexpr int ktile_widen256() {
  using L = KTile<F>;
  return F == kQ4_K || F == kMXFP4 ? 8 : L::kHigh1 ? 4 : L::kQ6 ? 2 : 1;
}

template <int S>
KVP_AVX2 inline __m256i shift_bits256(__m256i v) {
  if constexpr (S > 0) return _mm256_slli_epi32(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi32(v, -S);
  else return v;
}

// A table format's 16 signed values, in each 128-bit lane (vpshufb looks up within a lane)
template <int F>
KVP_AVX2 inline __m256i table_lanes256() {
  const int8_t* t = F == kMXFP4 ? kMXFP4Values : kIQ4NLValues;
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}

KVP_AVX2 inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Pair P of one tile's block q, rows 8 G..8 G + 7: values 8P..8P+3 (lo) and 8P+4..8P+7 (hi) as unsigned bytes (the
// table formats': their signed values)
template <int F, int P>
KVP_AVX2 inline void ktile_pair256(const uint8_t* q, int G, __m256i& lo, __m256i& hi) {
  using L = KTile<F>;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i raw = load256(q + P * 64 + G * 32);
  lo = _mm256_and_si256(raw, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
  if constexpr (L::kHigh1) {  // the 5th bits: bit 8k + P of a row's uint32 for lo's byte k, bit 8k + 4 + P for hi's
    const __m256i h = load256(q + 256 + G * 32), bit4 = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift_bits256<4 - P>(h), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift_bits256<-P>(h), bit4));
  } else if constexpr (L::kTable) {
    const __m256i table = table_lanes256<F>();
    lo = _mm256_shuffle_epi8(table, lo);
    hi = _mm256_shuffle_epi8(table, hi);
  } else if constexpr (L::kQ6) {  // the 2 high bits, pairs 0-1 in the first plane, 2-3 in the second
    const __m256i h = load256(q + 256 + (P / 2) * 64 + G * 32), bits45 = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift_bits256<4 - 4 * (P % 2)>(h), bits45));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift_bits256<2 - 4 * (P % 2)>(h), bits45));
  }
}

// vpmaddubsw of weight bytes w (unsigned; the table formats' signed) with x
template <int F>
KVP_AVX2 inline __m256i maddubs256(__m256i w, __m256i x) {
  if constexpr (KTile<F>::kTable) return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  else return _mm256_maddubs_epi16(w, x);
}

// dot[r][G] += the int32 dot products of x rows r (a block at x + r K) with pairs P..PEnd-1 (from P0) of the tile's
// block q; sums[r][G] holds the int16 sums not yet widened
template <int MR, int F, int P0, int P, int PEnd>
KVP_AVX2 inline void ktile_dots256(const uint8_t* q, const int8_t* x, int64_t K, __m256i (&sums)[MR][2],
                                   __m256i (&dot)[MR][2]) {
  if constexpr (P < PEnd) {
    constexpr int widen = ktile_widen256<F>();
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lo[2], hi[2];
    for (int G = 0; G < 2; ++G) ktile_pair256<F, P>(q, G, lo[G], hi[G]);
    for (int r = 0; r < MR; ++r) {
      const __m256i xl = _mm256_set1_epi32(load4(x + r * K + 8 * P)), xh = _mm256_set1_epi32(load4(x + r * K + 8 * P + 4));
      for (int G = 0; G < 2; ++G) {
        const __m256i a = maddubs256<F>(lo[G], xl), b = maddubs256<F>(hi[G], xh);
        if constexpr (widen == 1) {
          dot[r][G] = _mm256_add_epi32(dot[r][G], _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)));
        } else {
          sums[r][G] = _mm256_add_epi16(sums[r][G], _mm256_add_epi16(a, b));
          if constexpr ((2 * (P + 1 - P0)) % widen == 0 || P + 1 == PEnd) {
            dot[r][G] = _mm256_add_epi32(dot[r][G], _mm256_madd_epi16(sums[r][G], ones));
            sums[r][G] = _mm256_setzero_si256();
          }
        }
      }
    }
    ktile_dots256<MR, F, P0, P + 1, PEnd>(q, x, K, sums, dot);
  }
}

KVP_AVX2 inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KVP_AVX2 inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

KVP_AVX2 inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Rows 8 G..8 G + 7's scale s and offset o of block b (half V for Q6_K) of one tile: a value is s q + o (the same
// float32 operations as quant_tiled_kq.h's ktile_scales); the table formats' q is signed here, so o = 0
template <int F, int V>
KVP_AVX2 inline void ktile_scales256(const uint16_t* td, const uint8_t* ts, int64_t b, int G, __m256& s, __m256& o) {
  const int r0 = 8 * G;
  if constexpr (F == kIQ4_XS) {
    s = _mm256_mul_ps(half8(td + (b / 8) * 16 + r0), i8x8(ts + b * 16 + r0));
    o = _mm256_setzero_ps();
  } else if constexpr (KTile<F>::kTable) {
    s = half8(td + b * 16 + r0);
    o = _mm256_setzero_ps();
  } else if constexpr (F == kQ5_0) {
    s = half8(td + b * 16 + r0);
    o = _mm256_mul_ps(s, _mm256_set1_ps(-16.0f));
  } else if constexpr (F == kQ5_1) {
    s = half8(td + b * 32 + r0);
    o = half8(td + b * 32 + 16 + r0);
  } else if constexpr (F == kQ6_K) {
    s = _mm256_mul_ps(half8(td + (b / 8) * 16 + r0), i8x8(ts + b * 32 + 16 * V + r0));
    o = _mm256_mul_ps(s, _mm256_set1_ps(-32.0f));
  } else {
    const uint16_t* sd = td + (b / 8) * 32;
    s = _mm256_mul_ps(half8(sd + r0), u8x8(ts + b * 32 + r0));
    o = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(half8(sd + 16 + r0), u8x8(ts + b * 32 + 16 + r0)));
  }
}

// Half V of block b (Q6_K: values 16 V..16 V + 15; else V = 0, all 32) of one tile into acc (quant_tiled_kq.h's
// ktile_half: Q6_K's -32 taken off the integer sums with x32, the split offsets' o times x's block sums)
template <int MR, int F, int V>
KVP_AVX2 inline void ktile_half256(const uint8_t* q, const uint16_t* td, const uint8_t* ts, int64_t b, int64_t KB,
                                   const int8_t* xq, const float* xd, const float* xs, const int32_t* x32, int64_t K,
                                   __m256 (&acc)[MR][2]) {
  using L = KTile<F>;
  constexpr int P0 = L::kQ6 ? 2 * V : 0, P1 = L::kQ6 ? 2 * V + 2 : 4;
  __m256i sums[MR][2], dot[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int G = 0; G < 2; ++G) sums[r][G] = dot[r][G] = _mm256_setzero_si256();
  ktile_dots256<MR, F, P0, P0, P1>(q, xq + b * kBlock, K, sums, dot);
  for (int G = 0; G < 2; ++G) {
    __m256 s, o;
    ktile_scales256<F, V>(td, ts, b, G, s, o);
    for (int r = 0; r < MR; ++r) {
      const __m256 sx = _mm256_mul_ps(s, _mm256_set1_ps(xd[r * KB + b]));
      if constexpr (L::kQ6) {
        const __m256i corrected = _mm256_sub_epi32(dot[r][G], _mm256_set1_epi32(x32[r * (K / 16) + 2 * b + V]));
        acc[r][G] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corrected), sx, acc[r][G]);
      } else {
        acc[r][G] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][G]), sx, acc[r][G]);
        if constexpr (!L::kTable) acc[r][G] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[r * KB + b]), acc[r][G]);
      }
    }
  }
}

// out[r * ldo + c] for x rows r < MR and the 16 columns of one tile (its blocks at tq, its scales at td / ts)
template <int MR, int F>
KVP_AVX2 void ktiled_tile256(const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB, const int8_t* xq,
                             const float* xd, const float* xs, const int32_t* x32, int64_t K, float* out, int64_t ldo) {
  using L = KTile<F>;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* q = tq + b * L::kQBytes;
    ktile_half256<MR, F, 0>(q, td, ts, b, KB, xq, xd, xs, x32, K, acc);
    if constexpr (L::kQ6) ktile_half256<MR, F, 1>(q, td, ts, b, KB, xq, xd, xs, x32, K, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int G = 0; G < 2; ++G) _mm256_storeu_ps(out + r * ldo + 8 * G, acc[r][G]);
}

template <int MR, int F>
KVP_AVX2 void ktiled_tile256_rows(int64_t mr, const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB,
                                  const int8_t* xq, const float* xd, const float* xs, const int32_t* x32, int64_t K,
                                  float* out, int64_t ldo) {
  if constexpr (MR > 1) {
    if (mr < MR) return ktiled_tile256_rows<MR - 1, F>(mr, tq, td, ts, KB, xq, xd, xs, x32, K, out, ldo);
  }
  ktiled_tile256<MR, F>(tq, td, ts, KB, xq, xd, xs, x32, K, out, ldo);
}

// ktiled_rows (quant_tiled_kq.h) on AVX2: the same arguments and outputs, one tile at a time
template <int F>
KVP_AVX2 void ktiled_rows256(const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB, int64_t t0,
                             int64_t t1, const int8_t* xq, const float* xd, const float* xs, const int32_t* x32,
                             int64_t M, float* out, uint16_t* out_bf16, int64_t ldo) {
  using L = KTile<F>;
  const int64_t K = KB * kBlock, G = L::kSuper ? KB / 8 : KB;
  float tile_out[kTiledMR256 * 16];
  for (int64_t t = t0; t < t1; ++t) {  // a tile's blocks stay in L1 across all x rows
    const uint8_t* q = tq + t * KB * L::kQBytes;
    const uint16_t* d = td + t * G * L::kTdWidth;
    const uint8_t* s = L::kHasTs ? ts + t * KB * L::kTsWidth : nullptr;
    for (int64_t i = 0; i < M; i += kTiledMR256) {
      const int64_t mr = std::min<int64_t>(kTiledMR256, M - i);
      float* dst = out_bf16 != nullptr ? tile_out : out + i * ldo + (t - t0) * 16;
      const int64_t ld = out_bf16 != nullptr ? 16 : ldo;
      const int32_t* x32i = L::kQ6 ? x32 + i * (K / 16) : nullptr;
      ktiled_tile256_rows<kTiledMR256, F>(mr, q, d, s, KB, xq + i * K, xd + i * KB, xs + i * KB, x32i, K, dst, ld);
      if (out_bf16 != nullptr)
        for (int64_t r = 0; r < mr; ++r) to_bf16_scalar(tile_out + r * 16, out_bf16 + (i + r) * ldo + (t - t0) * 16, 16);
    }
  }
}

// The 8 groups of 4 values (group g: values 4g..4g+3) of a tile's block as bytes (ktile_pair256's), row j's at 4 j
template <int F, int P = 0>
KVP_AVX2 inline void ktile_unpack256(const uint8_t* q, uint8_t (&groups)[8][64]) {
  if constexpr (P < 4) {
    for (int G = 0; G < 2; ++G) {
      __m256i lo, hi;
      ktile_pair256<F, P>(q, G, lo, hi);
      _mm256_store_si256(reinterpret_cast<__m256i*>(groups[2 * P] + 32 * G), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(groups[2 * P + 1] + 32 * G), hi);
    }
    ktile_unpack256<F, P + 1>(q, groups);
  }
}

// ktiled_dequant_rows (quant_tiled_kq.h) on AVX2: the same values (s q + o by one fused multiply-add; the table
// formats' signed q with o = 0 gives the same rounded product), float32 into out or bfloat16 into out_bf16
template <int F>
KVP_AVX2 void ktiled_dequant_rows256(const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB, int64_t t0,
                                     int64_t t1, float* out, uint16_t* out_bf16) {
  using L = KTile<F>;
  const int64_t K = KB * kBlock, G = L::kSuper ? KB / 8 : KB;
  alignas(32) uint8_t groups[8][64];  // values 4g..4g+3 of the 16 rows (row j's at 4 j)
  alignas(32) float sv[2][16], ov[2][16], block[kBlock];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < KB; ++b) {
      const uint8_t* q = tq + (t * KB + b) * L::kQBytes;
      const uint16_t* d = td + t * G * L::kTdWidth;
      const uint8_t* s = L::kHasTs ? ts + t * KB * L::kTsWidth : nullptr;
      ktile_unpack256<F>(q, groups);
      for (int half = 0; half < 2; ++half) {
        __m256 sc, of;
        ktile_scales256<F, 0>(d, s, b, half, sc, of);
        _mm256_store_ps(sv[0] + 8 * half, sc);
        _mm256_store_ps(ov[0] + 8 * half, of);
        if constexpr (L::kQ6) ktile_scales256<F, 1>(d, s, b, half, sc, of);
        _mm256_store_ps(sv[1] + 8 * half, sc);
        _mm256_store_ps(ov[1] + 8 * half, of);
      }
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = (t - t0) * 16 + r;
        float* dst = out_bf16 != nullptr ? block : out + row * K + b * kBlock;
        for (int v = 0; v < kBlock; ++v) {
          const uint8_t byte = groups[v / 4][4 * r + v % 4];
          const float value = L::kTable ? static_cast<float>(static_cast<int8_t>(byte)) : static_cast<float>(byte);
          dst[v] = std::fma(value, sv[v / 16][r], ov[v / 16][r]);
        }
        if (out_bf16 != nullptr) to_bf16_scalar(block, out_bf16 + row * K + b * kBlock, kBlock);
      }
    }
}

}  // namespace

// The int8 GEMM on column-tiled copies of the formats kept as GGUF blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4,
// IQ4_XS) times int8-quantized activations (quantize_row_q8: a scale per 32 values), by AVX-512 VNNI dot products;
// after quant_vnni_gemm.h, whose scheme it follows (16 weight rows side by side in a register, 8 x rows a tile, pairs
// of tiles on 4 rows from kPairMinRows rows).
//
// Why a layout of its own rather than GGUF's super-blocks: one vpdpbusd must advance 16 output columns, so each
// register holds 4 values of 16 weight rows; the values are unpacked to unsigned bytes (0..15, 0..31 or 0..63) and the
// sub-block scales applied per 32 values of x, as for Q4_1, with the K-quants' two-level scales multiplied out in
// registers (d * sc and dmin * mn are exact in float32, so no precision is lost to a stored product).
//
// The layout (kvpilot/model/quant/tiled_kquant.py builds it at load), per tile of 16 weight rows and 32-value block b:
//   tq [T, KB, QB]: 256 bytes of nibbles: pair p (0..3) holds 4 bytes per row j: byte k's low nibble is value 8p + k,
//     its high nibble value 8p + 4 + k. Then Q5_0 / Q5_1 / Q5_K: 64 bytes, a uint32 per row whose bit 8k + p is value
//     (8p + k)'s 5th bit and bit 8k + 4 + p value (8p + 4 + k)'s; Q6_K: 128 bytes, two uint32 per row (pairs 0-1, then
//     2-3): for pair p = 2r + i, bits 8k + 4i (and 8k + 4i + 2) hold the 2 high bits of value 8p + k (8p + 4 + k).
//     QB = 256 (Q4_K), 320 (5-bit formats), 384 (Q6_K).
//   td float16: Q5_0 [T, KB, 16] d; Q5_1 [T, KB, 32] d, then m; Q4_K / Q5_K [T, KB / 8, 32] the super-block's d, then
//     dmin; Q6_K [T, KB / 8, 16] d.
//   ts uint8 [T, KB, 32], the K-quants: Q4_K / Q5_K the 16 rows' 6-bit scales, then minimums, of sub-block b % 8;
//     Q6_K the int8 scales of block b's two 16-value halves (sub-blocks 2 (b % 8) and 2 (b % 8) + 1).
//   IQ4_NL / MXFP4: the nibble plane of 4-bit table indices (QB = 256); td float16 [T, KB, 16] d (MXFP4: 2^(e - 128),
//     exact in float16 for e in [104, 143]; other exponents keep the float32 kernel: tiled_kquant.py).
//   IQ4_XS: the nibble plane of IQ4_NL indices; td float16 [T, KB / 8, 16] the super-block's d; ts int8 [T, KB, 16]
//     ls - 32 of sub-block b % 8 (s = d (ls - 32) is exact in float32: 11 x 6 bits).
// Values: Q5_0 d (q - 16); Q5_1 d q + m; Q4_K / Q5_K (d sc) q - dmin mn; Q6_K (d sc) (q - 32); IQ4_NL / MXFP4
// d (u - 128), u = table[q] + 128 looked up in registers (vpshufb); IQ4_XS the same with d (ls - 32) for d: as a row
// d * q + o with s, o per 32 values (per 16 for Q6_K, whose -32 is taken off the integer dot product with x's
// 16-value sums).
// Bytes per weight: Q5_0 5.5, Q5_1 6, Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625, IQ4_NL 4.5, MXFP4 4.5, IQ4_XS 4.3125
// (the GGUF blocks: 5.5, 6, 4.5, 5.5, 6.5625, 4.5, 4.25, 4.25).
#define KVP_VNNI_INLINE KVP_VNNI __attribute__((always_inline)) inline

namespace {

// A tile's bytes a block (tq), float16 scales a group (td), sub-scale bytes a block (ts), and its groups of blocks
constexpr int64_t ktile_qbytes(int64_t fmt) {
  return fmt == kQ6_K ? 384 : fmt == kQ4_K || fmt == kIQ4_XS || is_table_format(fmt) ? 256 : 320;
}
constexpr int64_t ktile_td_width(int64_t fmt) { return fmt == kQ5_1 || fmt == kQ4_K || fmt == kQ5_K ? 32 : 16; }
constexpr int64_t ktile_ts_width(int64_t fmt) { return is_kquant(fmt) ? 32 : fmt == kIQ4_XS ? 16 : 0; }
constexpr int64_t ktile_groups(int64_t fmt, int64_t KB) { return has_super_blocks(fmt) ? KB / 8 : KB; }

template <int F>
struct KTile {
  static constexpr bool kQ6 = F == kQ6_K;
  static constexpr bool kHigh1 = F == kQ5_0 || F == kQ5_1 || F == kQ5_K;
  static constexpr bool kSuper = has_super_blocks(F);
  static constexpr bool kTable = F == kIQ4_NL || F == kMXFP4 || F == kIQ4_XS;
  static constexpr int64_t kQBytes = ktile_qbytes(F);
  static constexpr int64_t kTdWidth = ktile_td_width(F);
  static constexpr bool kHasTs = kSuper;
  static constexpr int64_t kTsWidth = ktile_ts_width(F);
};

// A table format's 16 values + 128 as unsigned bytes, in each 128-bit lane (vpshufb looks up within a lane)
template <int F>
KVP_VNNI_INLINE __m512i table_lanes() {
  const int8_t* t = F == kMXFP4 ? kMXFP4Values : kIQ4NLValues;
  alignas(16) uint8_t biased[16];
  for (int i = 0; i < 16; ++i) biased[i] = static_cast<uint8_t>(t[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(biased)));
}

template <int S>
KVP_VNNI_INLINE __m512i shift_bits(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi32(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi32(v, -S);
  else return v;
}

// Pair P of one tile's block q: the 16 rows' values 8P..8P+3 (lo) and 8P+4..8P+7 (hi) as unsigned bytes
template <int F, int P>
KVP_VNNI_INLINE void ktile_pair(const uint8_t* q, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i raw = _mm512_loadu_si512(q + P * 64);
  lo = _mm512_and_si512(raw, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  if constexpr (KTile<F>::kHigh1) {  // lo | (h << (4 - P) & 0x10), hi | (h >> P & 0x10) per byte
    const __m512i h = _mm512_loadu_si512(q + 256), bit4 = _mm512_set1_epi8(0x10);
    lo = _mm512_ternarylogic_epi32(lo, shift_bits<4 - P>(h), bit4, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, shift_bits<-P>(h), bit4, 0xF8);
  } else if constexpr (KTile<F>::kTable) {
    const __m512i table = table_lanes<F>();
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  } else if constexpr (KTile<F>::kQ6) {
    const __m512i h = _mm512_loadu_si512(q + 256 + (P / 2) * 64), bits45 = _mm512_set1_epi8(0x30);
    lo = _mm512_ternarylogic_epi32(lo, shift_bits<4 - 4 * (P % 2)>(h), bits45, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, shift_bits<2 - 4 * (P % 2)>(h), bits45, 0xF8);
  }
}

KVP_VNNI_INLINE __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

KVP_VNNI_INLINE __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

KVP_VNNI_INLINE __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The 16 rows' scale s and offset o of block b (half H for Q6_K) of one tile: a value is s q + o
template <int F, int H>
KVP_VNNI_INLINE void ktile_scales(const uint16_t* td, const uint8_t* ts, int64_t b, __m512& s, __m512& o) {
  if constexpr (F == kIQ4_XS) {  // d (ls - 32): exact in float32, as are s u and -128 s
    s = _mm512_mul_ps(half16(td + (b / 8) * 16), i8x16(ts + b * 16));
    o = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
  } else if constexpr (F == kQ5_0 || KTile<F>::kTable) {
    s = half16(td + b * 16);
    o = _mm512_mul_ps(s, _mm512_set1_ps(KTile<F>::kTable ? -128.0f : -16.0f));
  } else if constexpr (F == kQ5_1) {
    s = half16(td + b * 32);
    o = half16(td + b * 32 + 16);
  } else if constexpr (F == kQ6_K) {
    s = _mm512_mul_ps(half16(td + (b / 8) * 16), i8x16(ts + b * 32 + 16 * H));
    o = _mm512_mul_ps(s, _mm512_set1_ps(-32.0f));
  } else {
    const uint16_t* sd = td + (b / 8) * 32;
    s = _mm512_mul_ps(half16(sd), u8x16(ts + b * 32));
    o = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(sd + 16), u8x16(ts + b * 32 + 16)));
  }
}

// dot[r][j] += the int32 dot products of x rows r (block at x + r K) with pairs P..PEnd-1 of tiles j (blocks at q[j])
template <int MR, int NT, int F, int P, int PEnd>
KVP_VNNI_INLINE void ktile_dots(const uint8_t* const* q, const int8_t* x, int64_t K, __m512i (&dot)[MR][NT]) {
  if constexpr (P < PEnd) {
    __m512i lo[NT], hi[NT];
    for (int j = 0; j < NT; ++j) ktile_pair<F, P>(q[j], lo[j], hi[j]);
    for (int r = 0; r < MR; ++r) {
      int32_t x_lo, x_hi;
      std::memcpy(&x_lo, x + r * K + 8 * P, 4);
      std::memcpy(&x_hi, x + r * K + 8 * P + 4, 4);
      const __m512i xl = _mm512_set1_epi32(x_lo), xh = _mm512_set1_epi32(x_hi);
      for (int j = 0; j < NT; ++j) {
        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], lo[j], xl);
        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], hi[j], xh);
      }
    }
    ktile_dots<MR, NT, F, P + 1, PEnd>(q, x, K, dot);
  }
}

// Half H of block b (Q6_K: values 16 H..16 H + 15; else H = 0, all 32) into acc. x32: per x row and 16 values, 32
// times the sum of their int8 values (Q6_K only: dot(q - 32, x) = dot(q, x) - that, exactly)
template <int MR, int NT, int F, int H>
KVP_VNNI_INLINE void ktile_half(const uint8_t* const* q, const uint16_t* const* td, const uint8_t* const* ts, int64_t b,
                                int64_t KB, const int8_t* xq, const float* xd, const float* xs, const int32_t* x32,
                                int64_t K, __m512 (&acc)[MR][NT]) {
  constexpr int P0 = KTile<F>::kQ6 ? 2 * H : 0, P1 = KTile<F>::kQ6 ? 2 * H + 2 : 4;
  __m512i dot[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) dot[r][j] = _mm512_setzero_si512();
  ktile_dots<MR, NT, F, P0, P1>(q, xq + b * kBlock, K, dot);
  for (int j = 0; j < NT; ++j) {
    __m512 s, o;
    ktile_scales<F, H>(td[j], ts[j], b, s, o);
    for (int r = 0; r < MR; ++r) {
      const __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(xd[r * KB + b]));
      if constexpr (KTile<F>::kQ6) {
        const __m512i corrected = _mm512_sub_epi32(dot[r][j], _mm512_set1_epi32(x32[r * (K / 16) + 2 * b + H]));
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(corrected), sx, acc[r][j]);
      } else {
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]), sx, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[r * KB + b]), acc[r][j]);
      }
    }
  }
}

// out[r * ldo + 16 j + c] for x rows r < MR and tiles j < NT (tile j's arrays one tile after tile j - 1's)
template <int MR, int NT, int F>
KVP_VNNI void ktiled_tile(const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB, const int8_t* xq,
                          const float* xd, const float* xs, const int32_t* x32, int64_t K, float* out, int64_t ldo) {
  using L = KTile<F>;
  const int64_t G = L::kSuper ? KB / 8 : KB;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* tdj[NT];
  const uint8_t* tsj[NT];
  for (int j = 0; j < NT; ++j) {
    tdj[j] = td + j * G * L::kTdWidth;
    tsj[j] = L::kHasTs ? ts + j * KB * L::kTsWidth : nullptr;
  }
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* q[NT];
    for (int j = 0; j < NT; ++j) q[j] = tq + (j * KB + b) * L::kQBytes;
    ktile_half<MR, NT, F, 0>(q, tdj, tsj, b, KB, xq, xd, xs, x32, K, acc);
    if constexpr (L::kQ6) ktile_half<MR, NT, F, 1>(q, tdj, tsj, b, KB, xq, xd, xs, x32, K, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) _mm512_storeu_ps(out + r * ldo + 16 * j, acc[r][j]);
}

template <int MR, int NT, int F>
KVP_VNNI void ktiled_tile_rows(int64_t mr, const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB,
                               const int8_t* xq, const float* xd, const float* xs, const int32_t* x32, int64_t K,
                               float* out, int64_t ldo) {
  if constexpr (MR > 1) {
    if (mr < MR) return ktiled_tile_rows<MR - 1, NT, F>(mr, tq, td, ts, KB, xq, xd, xs, x32, K, out, ldo);
  }
  ktiled_tile<MR, NT, F>(tq, td, ts, KB, xq, xd, xs, x32, K, out, ldo);
}

// As tiled_rows (quant_vnni_gemm.h) for format F: x rows i < M times tiles [t0, t1), float32 into out or bfloat16
// into out_bf16 (columns from tile t0's first)
template <int F>
KVP_VNNI void ktiled_rows(const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB, int64_t t0, int64_t t1,
                          const int8_t* xq, const float* xd, const float* xs, const int32_t* x32, int64_t M, float* out,
                          uint16_t* out_bf16, int64_t ldo) {
  using L = KTile<F>;
  const int64_t K = KB * kBlock, G = L::kSuper ? KB / 8 : KB;
  float tile_out[std::max(kTiledMR * 16, kPairMR * 32)];
  for (int64_t t = t0; t < t1;) {
    const int nt = t + 1 < t1 && M >= kPairMinRows ? 2 : 1, step = nt == 2 ? kPairMR : kTiledMR;
    const uint8_t* q = tq + t * KB * L::kQBytes;
    const uint16_t* d = td + t * G * L::kTdWidth;
    const uint8_t* s = L::kHasTs ? ts + t * KB * L::kTsWidth : nullptr;
    for (int64_t i = 0; i < M; i += step) {
      const int64_t mr = std::min<int64_t>(step, M - i);
      float* dst = out_bf16 != nullptr ? tile_out : out + i * ldo + (t - t0) * 16;
      const int64_t ld = out_bf16 != nullptr ? 16 * nt : ldo;
      const int32_t* x32i = L::kQ6 ? x32 + i * (K / 16) : nullptr;
      if (nt == 2)
        ktiled_tile_rows<kPairMR, 2, F>(mr, q, d, s, KB, xq + i * K, xd + i * KB, xs + i * KB, x32i, K, dst, ld);
      else
        ktiled_tile_rows<kTiledMR, 1, F>(mr, q, d, s, KB, xq + i * K, xd + i * KB, xs + i * KB, x32i, K, dst, ld);
      if (out_bf16 != nullptr)
        for (int64_t r = 0; r < mr; ++r)
          to_bf16_512(tile_out + r * 16 * nt, out_bf16 + (i + r) * ldo + (t - t0) * 16, 16 * nt);
    }
    t += nt;
  }
}

// The 8 groups of 4 values (group g: values 4g..4g+3) of a tile's block as unsigned bytes, 64 bytes a group (row j's
// at 4 j)
template <int F, int P = 0>
KVP_VNNI_INLINE void ktile_unpack(const uint8_t* q, uint8_t (&groups)[8][64]) {
  if constexpr (P < 4) {
    __m512i lo, hi;
    ktile_pair<F, P>(q, lo, hi);
    _mm512_storeu_si512(groups[2 * P], lo);
    _mm512_storeu_si512(groups[2 * P + 1], hi);
    ktile_unpack<F, P + 1>(q, groups);
  }
}

// The dense rows of tiles [t0, t1) (row n of the result at (n - 16 t0) K): s q + o in one fused multiply-add (exact
// products, one rounding: the gguf package's float32 values), float32 into out or bfloat16 (nearest even) into out_bf16
template <int F>
KVP_VNNI void ktiled_dequant_rows(const uint8_t* tq, const uint16_t* td, const uint8_t* ts, int64_t KB, int64_t t0,
                                  int64_t t1, float* out, uint16_t* out_bf16) {
  using L = KTile<F>;
  const int64_t K = KB * kBlock, G = L::kSuper ? KB / 8 : KB;
  alignas(64) uint8_t groups[8][64];
  alignas(64) float sv[2][16], ov[2][16], block[kBlock];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < KB; ++b) {
      const uint16_t* d = td + t * G * L::kTdWidth;
      const uint8_t* s = L::kHasTs ? ts + t * KB * L::kTsWidth : nullptr;
      ktile_unpack<F>(tq + (t * KB + b) * L::kQBytes, groups);
      __m512 sc, of;
      ktile_scales<F, 0>(d, s, b, sc, of);
      _mm512_store_ps(sv[0], sc);
      _mm512_store_ps(ov[0], of);
      if constexpr (L::kQ6) ktile_scales<F, 1>(d, s, b, sc, of);
      _mm512_store_ps(sv[1], sc);
      _mm512_store_ps(ov[1], of);
      for (int64_t r = 0; r < 16; ++r) {
        alignas(16) uint8_t values[kBlock];
        for (int g = 0; g < 8; ++g) std::memcpy(values + 4 * g, groups[g] + 4 * r, 4);
        const __m512 lo = u8x16(values), hi = u8x16(values + 16);
        const __m512 v0 = _mm512_fmadd_ps(lo, _mm512_set1_ps(sv[0][r]), _mm512_set1_ps(ov[0][r]));
        const __m512 v1 = _mm512_fmadd_ps(hi, _mm512_set1_ps(sv[1][r]), _mm512_set1_ps(ov[1][r]));
        const int64_t row = (t - t0) * 16 + r;
        if (out_bf16 != nullptr) {
          _mm512_store_ps(block, v0);
          _mm512_store_ps(block + 16, v1);
          to_bf16_512(block, out_bf16 + row * K + b * kBlock, kBlock);
        } else {
          _mm512_storeu_ps(out + row * K + b * kBlock, v0);
          _mm512_storeu_ps(out + row * K + b * kBlock + 16, v1);
        }
      }
    }
}

}  // namespace

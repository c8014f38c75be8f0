// AVX2 dequantization of the formats kept as GGUF blocks (after quant_blocks.h and quant_avx2.h): the layouts and
// arithmetic of quant_blocks.h, 8 values a vector. Each value is the same one rounding of the same exact products
// (an FMA rounds d * q + m once, as the scalar code's exact product then sum), so the float32 values are bit for
// bit the scalar ones. Without VNNI every step of these formats dequantizes its weights here.
namespace {

// 8 bytes at p widened to 8 int32 lanes
KVP_AVX2 inline __m256i widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

KVP_AVX2 inline __m256i shift_right(__m256i v, int bits) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(bits)); }

// Q5_0 / Q5_1: lane i holds 16 if bit first + i of qh is set (the value's 5th bit), else 0
KVP_AVX2 inline __m256i fifth_bits(uint32_t qh, int first) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh >> first)), lanes);
  return _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4);
}

KVP_AVX2 void dequant_q5_blocks256(const uint8_t* row, int64_t blocks, bool has_min, float* out) {
  const int64_t bytes = has_min ? 24 : 22;
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = f16_at(blk);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(has_min ? f16_at(blk + 2) : -16.0f * d);
    uint32_t qh;
    std::memcpy(&qh, blk + (has_min ? 4 : 2), 4);
    const uint8_t* qs = blk + (has_min ? 8 : 6);
    for (int half = 0; half < 2; ++half) {  // bytes 8 half..: values 8 half + i (low nibbles), 16 + 8 half + i
      const __m256i raw = widen8(qs + 8 * half);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low4), fifth_bits(qh, 8 * half));
      const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(raw, 4), fifth_bits(qh, 16 + 8 * half));
      _mm256_storeu_ps(out + b * 32 + 8 * half, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), vd, vm));
      _mm256_storeu_ps(out + b * 32 + 16 + 8 * half, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), vd, vm));
    }
  }
}

KVP_AVX2 void dequant_qk_blocks256(const uint8_t* row, int64_t blocks, bool five_bits, float* out) {
  const int64_t bytes = five_bits ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (five_bits ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k_scale_min(blk + 4, j, sc, mn);
      const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc)), dm = _mm256_set1_ps(-dmin * static_cast<float>(mn));
      const uint8_t* q = qs + 32 * (j / 2);
      for (int l = 0; l < 32; l += 8) {
        __m256i v = _mm256_and_si256(shift_right(widen8(q + l), 4 * (j % 2)), low4);
        if (five_bits)
          v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(shift_right(widen8(qh + l), j), one), 4));
        _mm256_storeu_ps(out + b * 256 + j * 32 + l, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), ds, dm));
      }
    }
  }
}

KVP_AVX2 void dequant_q6k_blocks256(const uint8_t* row, int64_t blocks, float* out) {
  const __m256i low4 = _mm256_set1_epi32(0x0F), low2 = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * 210;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = f16_at(blk + 208);
    for (int v = 0; v < 256; v += 8) {  // 8 values share their nibble, their 2 bits and their scale
      const int h = v / 128, w = v % 128;
      const __m256i lo = _mm256_and_si256(shift_right(widen8(blk + 64 * h + w % 64), 4 * (w / 64)), low4);
      const __m256i hi = _mm256_and_si256(shift_right(widen8(blk + 128 + 32 * h + w % 32), 2 * (w / 32)), low2);
      const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), bias);
      _mm256_storeu_ps(out + b * 256 + v,
                       _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d * static_cast<float>(sc[v / 16]))));
    }
  }
}

// IQ4_NL / MXFP4: the 16 table values looked up in one register (pshufb), 16 indices at a time
KVP_AVX2 void dequant_table_blocks256(const uint8_t* row, int64_t blocks, bool mxfp4, float* out) {
  const int64_t bytes = mxfp4 ? 17 : 18;
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mxfp4 ? kMXFP4Values : kIQ4NLValues));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const __m256 d = _mm256_set1_ps(mxfp4 ? e8m0_half(blk[0]) : f16_at(blk));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (mxfp4 ? 1 : 2)));
    const __m128i halves[2] = {_mm_shuffle_epi8(table, _mm_and_si128(raw, low4)),
                               _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))};
    for (int h = 0; h < 2; ++h) {  // values 16 h .. 16 h + 15
      const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h]));
      const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(halves[h], 8)));
      _mm256_storeu_ps(out + b * 32 + 16 * h, _mm256_mul_ps(first, d));
      _mm256_storeu_ps(out + b * 32 + 16 * h + 8, _mm256_mul_ps(second, d));
    }
  }
}

// IQ4_XS: sub-blocks of 32 as IQ4_NL blocks, each with its scale d * (ls - 32)
KVP_AVX2 void dequant_iq4xs_blocks256(const uint8_t* row, int64_t blocks, float* out) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLValues));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * 136;
    const float d = f16_at(blk);
    for (int j = 0; j < 8; ++j) {
      const __m256 dl = _mm256_set1_ps(d * static_cast<float>(iq4xs_scale(blk, j) - 32));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8 + 16 * j));
      const __m128i halves[2] = {_mm_shuffle_epi8(table, _mm_and_si128(raw, low4)),
                                 _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))};
      float* o = out + b * 256 + 32 * j;
      for (int h = 0; h < 2; ++h) {
        _mm256_storeu_ps(o + 16 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h])), dl));
        _mm256_storeu_ps(o + 16 * h + 8,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(halves[h], 8))), dl));
      }
    }
  }
}

// dequant_row_blocks (quant_blocks.h) on AVX2
KVP_AVX2 void dequant_row_blocks256(const Packed& w, int64_t n, float* out, float* /*scales*/) {
  const uint8_t* row = w.qs + n * w.qs_row();
  const int64_t blocks = w.K / gguf_block_values(w.fmt);
  switch (w.fmt) {
    case kQ5_0: return dequant_q5_blocks256(row, blocks, false, out);
    case kQ5_1: return dequant_q5_blocks256(row, blocks, true, out);
    case kQ4_K: return dequant_qk_blocks256(row, blocks, false, out);
    case kQ5_K: return dequant_qk_blocks256(row, blocks, true, out);
    case kIQ4_NL: return dequant_table_blocks256(row, blocks, false, out);
    case kMXFP4: return dequant_table_blocks256(row, blocks, true, out);
    case kIQ4_XS: return dequant_iq4xs_blocks256(row, blocks, out);
    default: return dequant_q6k_blocks256(row, blocks, out);
  }
}

}  // namespace

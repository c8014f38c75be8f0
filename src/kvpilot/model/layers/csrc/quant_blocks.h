// The formats kept as GGUF blocks (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, IQ4_XS), dequantized row by row for the
// float32 kernel and the dense copies (after quant_common.h). The block layouts are GGUF's
// (kvpilot/model/quant/formats.py):
//   Q5_0 (32 values, 22 bytes): d f16, qh u32 (bit j: value j's 5th bit), 16 bytes (value j low nibble of byte j,
//        value 16 + j high nibble); value d * (q - 16).
//   Q5_1 (24 bytes): d, m f16, then as Q5_0; value d * q + m.
//   Q4_K (256 values, 144 bytes): d, dmin f16, 12 bytes of 6-bit scales sc[8] and minimums mn[8], 128 bytes: 64
//        values at a time in 32 bytes, sub-block 2c in the low nibbles, 2c + 1 in the high; value of sub-block j
//        (d * sc[j]) * q - (dmin * mn[j]).
//   Q5_K (176 bytes): as Q4_K with 32 bytes qh before the nibbles (bit j of byte l: value l of sub-block j's 5th bit).
//   Q6_K (256 values, 210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales, d f16: value v = 128 h + w has the low
//        nibble (w / 64) of ql[64 h + w % 64] and the 2 bits (w / 32) of qh[32 h + w % 32]; value
//        (d * sc[v / 16]) * (q - 32).
//   IQ4_NL (32 values, 18 bytes): d f16, 16 bytes of 4-bit indices (ordered as Q5_0's nibbles); value d * table[q]
//        (kIQ4NLValues).
//   MXFP4 (32 values, 17 bytes): e (an E8M0 exponent byte), 16 bytes of indices as IQ4_NL; value 2^(e - 128) *
//        table[q] (kMXFP4Values: E2M1 doubled, hence the exponent's -128 rather than -127).
//   IQ4_XS (256 values, 136 bytes): d f16, scales_h u16, scales_l 4 bytes, then 8 sub-blocks of 16 index bytes
//        (each ordered as IQ4_NL's); sub-block j's ls = (4 bits j % 2 of scales_l[j / 2]) | (2 bits j of scales_h)
//        << 4, value (d * (ls - 32)) * table[q] (kIQ4NLValues).
// Each value is computed with one rounding at most (the products d * sc, d * sc * q and dmin * mn are exact in
// float32), so any evaluation order gives the gguf package's float32 values bit for bit.
namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(bits);
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and minimum from the 12 packed bytes
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void dequant_q5_blocks(const uint8_t* row, int64_t blocks, bool has_min, float* out) {
  const int64_t bytes = has_min ? 24 : 22;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = f16_at(blk), m = has_min ? f16_at(blk + 2) : -16.0f * d;
    uint32_t qh;
    std::memcpy(&qh, blk + (has_min ? 4 : 2), 4);
    const uint8_t* qs = blk + (has_min ? 8 : 6);
    for (int j = 0; j < 32; ++j) {
      const int q = ((j < 16 ? qs[j] : qs[j - 16] >> 4) & 0x0F) | (((qh >> j) & 1) << 4);
      out[b * 32 + j] = has_min ? d * static_cast<float>(q) + m : d * static_cast<float>(q - 16);
    }
  }
}

void dequant_qk_blocks(const uint8_t* row, int64_t blocks, bool five_bits, float* out) {
  const int64_t bytes = five_bits ? 176 : 144;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (five_bits ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k_scale_min(blk + 4, j, sc, mn);
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 0x0F;
        if (five_bits) v |= ((qh[l] >> j) & 1) << 4;
        out[b * 256 + j * 32 + l] = ds * static_cast<float>(v) - dm;
      }
    }
  }
}

// MXFP4's scale 2^(e - 128) as float32, bit for bit ggml's e8m0_to_fp32_half (subnormal for e < 2)
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

void dequant_table_blocks(const uint8_t* row, int64_t blocks, bool mxfp4, float* out) {
  const int64_t bytes = mxfp4 ? 17 : 18;
  const int8_t* table = mxfp4 ? kMXFP4Values : kIQ4NLValues;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const float d = mxfp4 ? e8m0_half(blk[0]) : f16_at(blk);
    const uint8_t* qs = blk + (mxfp4 ? 1 : 2);
    for (int j = 0; j < 16; ++j) {
      out[b * 32 + j] = d * static_cast<float>(table[qs[j] & 0x0F]);
      out[b * 32 + j + 16] = d * static_cast<float>(table[qs[j] >> 4]);
    }
  }
}

// IQ4_XS: sub-block j's 6-bit scale
inline int iq4xs_scale(const uint8_t* blk, int j) {
  uint16_t high;
  std::memcpy(&high, blk + 2, 2);
  return ((blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
}

void dequant_iq4xs_blocks(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * 136;
    const float d = f16_at(blk);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(iq4xs_scale(blk, j) - 32);
      const uint8_t* qs = blk + 8 + 16 * j;
      float* o = out + b * 256 + 32 * j;
      for (int l = 0; l < 16; ++l) {
        o[l] = dl * static_cast<float>(kIQ4NLValues[qs[l] & 0x0F]);
        o[l + 16] = dl * static_cast<float>(kIQ4NLValues[qs[l] >> 4]);
      }
    }
  }
}

void dequant_q6k_blocks(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * 210;
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = f16_at(blk + 208);
    for (int v = 0; v < 256; ++v) {
      const int h = v / 128, w = v % 128;
      const int lo = (ql[64 * h + w % 64] >> (4 * (w / 64))) & 0x0F;
      const int hi = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 0x03;
      out[b * 256 + v] = (d * static_cast<float>(sc[v / 16])) * static_cast<float>((lo | (hi << 4)) - 32);
    }
  }
}

// Row n of w (a format kept as blocks) as float32 into out[K]; the Kernels::dequant_row signature.
void dequant_row_blocks(const Packed& w, int64_t n, float* out, float* /*scales*/) {
  const uint8_t* row = w.qs + n * w.qs_row();
  const int64_t blocks = w.K / gguf_block_values(w.fmt);
  switch (w.fmt) {
    case kQ5_0: return dequant_q5_blocks(row, blocks, false, out);
    case kQ5_1: return dequant_q5_blocks(row, blocks, true, out);
    case kQ4_K: return dequant_qk_blocks(row, blocks, false, out);
    case kQ5_K: return dequant_qk_blocks(row, blocks, true, out);
    case kIQ4_NL: return dequant_table_blocks(row, blocks, false, out);
    case kMXFP4: return dequant_table_blocks(row, blocks, true, out);
    case kIQ4_XS: return dequant_iq4xs_blocks(row, blocks, out);
    default: return dequant_q6k_blocks(row, blocks, out);
  }
}

}  // namespace

// GGUF blocks -> the column-tiled int8 copy the tiled kernels read, at load: quant/vnni_gemm.py's tile() layout for
// Q8_0 / Q4_0 / Q4_1 (tq, td, to: Q4_1's offsets, empty for the others) and quant/tiled_kquant.py's ktile() layout
// for the formats kept as GGUF blocks (tq, td, ts; quant_tiled_kq.h's header has it), written straight from the
// blocks into tensors the caller allocated (a slice of a stacked experts' copy: no intermediate arrays). Built
// after quant_tiled_kq.h (ktile_qbytes, ktile_groups, ktile_td_width).
//
// Invariant: the bytes equal those of the numpy tile() / ktile() on the same blocks, for every bit pattern (NaN,
// infinite and subnormal scales included).
namespace {

inline uint16_t load_half(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// MXFP4's scale 2^(e - 128) as float16 bits; the caller checked e in [104, 143] (mxfp4_tiles_exactly)
inline uint16_t mxfp4_half(uint8_t e) {
  const int power = static_cast<int>(e) - 128;
  return power >= -14 ? static_cast<uint16_t>((power + 15) << 10) : static_cast<uint16_t>(1u << (power + 24));
}

// Q4_K / Q5_K: sub-block j (0..7) of super-block b: its 32 quants and its 6-bit scale and minimum
template <bool five_bits>
void decode_k_block(const uint8_t* b, int j, uint8_t* q, uint8_t* sub) {
  const uint8_t* sc = b + 4;  // 12 bytes: 6-bit scales and minimums
  sub[0] = j < 4 ? sc[j] & 0x3F : (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
  sub[1] = j < 4 ? sc[j + 4] & 0x3F : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  const uint8_t* qs = b + (five_bits ? 48 : 16) + (j / 2) * 32;
  for (int l = 0; l < 32; ++l) {
    q[l] = j % 2 == 0 ? qs[l] & 0x0F : qs[l] >> 4;
    if (five_bits) q[l] |= ((b[16 + l] >> j) & 1) << 4;
  }
}

// The 32 quants (0..63) of block kb of a row of a format kept as blocks, with its sub-scales (K-quants: sub[2];
// IQ4_XS: sub[0] = ls - 32 as an int8 byte)
template <int64_t fmt>
void decode_block(const uint8_t* row, int64_t kb, uint8_t* q, uint8_t* sub) {
  if constexpr (is_table_format(fmt) || fmt == kIQ4_XS) {  // the 4-bit indices (the kernel looks the table up)
    const uint8_t* blk = row + (fmt == kIQ4_XS ? kb / 8 : kb) * gguf_block_bytes(fmt);
    const uint8_t* qs = fmt == kIQ4_XS ? blk + 8 + 16 * (kb % 8) : blk + (fmt == kMXFP4 ? 1 : 2);
    if constexpr (fmt == kIQ4_XS) sub[0] = static_cast<uint8_t>(iq4xs_scale(blk, static_cast<int>(kb % 8)) - 32);
    for (int j = 0; j < 16; ++j) {
      q[j] = qs[j] & 0x0F;
      q[j + 16] = qs[j] >> 4;
    }
  } else if constexpr (fmt == kQ5_0 || fmt == kQ5_1) {
    const uint8_t* b = row + kb * gguf_block_bytes(fmt);
    const int64_t h = fmt == kQ5_1 ? 4 : 2;
    const uint32_t qh = b[h] | (b[h + 1] << 8) | (b[h + 2] << 16) | (static_cast<uint32_t>(b[h + 3]) << 24);
    for (int j = 0; j < 32; ++j)
      q[j] = ((j < 16 ? b[h + 4 + j] & 0x0F : b[h + 4 + j - 16] >> 4) | (((qh >> j) & 1) << 4));
  } else if constexpr (fmt == kQ6_K) {
    const uint8_t* b = row + (kb / 8) * gguf_block_bytes(fmt);
    const int j = static_cast<int>(kb % 8);
    for (int l = 0; l < 32; ++l) {
      const int v = j * 32 + l, h = v / 128, r = v % 128;
      const int low = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
      q[l] = low | (((b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3) << 4);
    }
    sub[0] = b[192 + 2 * j];
    sub[1] = b[192 + 2 * j + 1];
  } else {
    decode_k_block<fmt == kQ5_K>(row + (kb / 8) * gguf_block_bytes(fmt), static_cast<int>(kb % 8), q, sub);
  }
}

// Row j of tile t, block kb of a format kept as blocks: its bytes of tq (nibble plane, then 5th-bit or 2-bit plane),
// td and ts
template <int64_t fmt>
void ktile_block(const uint8_t* row, int64_t KB, int64_t t, int64_t kb, int j, uint8_t* tq, uint16_t* td, uint8_t* ts) {
  uint8_t q[32], sub[2];
  decode_block<fmt>(row, kb, q, sub);
  uint8_t* out = tq + (t * KB + kb) * ktile_qbytes(fmt);
  for (int p = 0; p < 4; ++p)
    for (int k = 0; k < 4; ++k) out[p * 64 + j * 4 + k] = (q[8 * p + k] & 0x0F) | ((q[8 * p + 4 + k] & 0x0F) << 4);
  for (int k = 0; k < 4 && (fmt == kQ5_0 || fmt == kQ5_1 || fmt == kQ5_K); ++k) {
    uint8_t bits = 0;
    for (int p = 0; p < 4; ++p)
      for (int h = 0; h < 2; ++h) bits |= ((q[8 * p + 4 * h + k] >> 4) & 1) << (p + 4 * h);
    out[256 + j * 4 + k] = bits;
  }
  for (int r = 0; r < 2 && fmt == kQ6_K; ++r)
    for (int k = 0; k < 4; ++k) {
      uint8_t bits = 0;
      for (int i = 0; i < 2; ++i)
        for (int h = 0; h < 2; ++h) bits |= ((q[8 * (2 * r + i) + 4 * h + k] >> 4) & 3) << (4 * i + 2 * h);
      out[256 + r * 64 + j * 4 + k] = bits;
    }
  const int64_t width = ktile_td_width(fmt), groups = ktile_groups(fmt, KB), ts_width = ktile_ts_width(fmt);
  if constexpr (has_super_blocks(fmt)) {
    for (int c = 0; c < ts_width / 16; ++c) ts[(t * KB + kb) * ts_width + c * 16 + j] = sub[c];
    if (kb % 8 != 0) return;  // the super-block's d (and dmin) once, at its first block
  }
  const int64_t group = has_super_blocks(fmt) ? kb / 8 : kb;
  const uint8_t* b = row + group * gguf_block_bytes(fmt);
  const int64_t at = (t * groups + group) * width;
  const int64_t d_at = fmt == kQ6_K ? 208 : 0;
  if constexpr (fmt == kMXFP4) {
    td[at + j] = mxfp4_half(b[0]);
    return;
  }
  td[at + j] = load_half(b + d_at);
  if (width == 32) td[at + 16 + j] = load_half(b + 2);  // Q5_1's m, Q4_K / Q5_K's dmin
}

// Row j of tile t, block kb of Q8_0 / Q4_0 / Q4_1: its bytes of tq, td and (Q4_1) to
void tile_block(const uint8_t* row, int64_t fmt, int64_t KB, int64_t t, int64_t kb, int j, uint8_t* tq, uint16_t* td,
                uint16_t* to) {
  const int64_t bytes = fmt == kQ8_0 ? 34 : fmt == kQ4_0 ? 18 : 20;
  const uint8_t* b = row + kb * bytes;
  const uint16_t d = load_half(b);
  td[(t * KB + kb) * 16 + j] = d;
  if (fmt == kQ4_1) to[(t * KB + kb) * 16 + j] = load_half(b + 2);
  if (fmt == kQ8_0) {
    uint8_t* out = tq + (t * KB + kb) * 512;
    for (int g = 0; g < 8; ++g)
      for (int k = 0; k < 4; ++k) out[g * 64 + j * 4 + k] = b[2 + 4 * g + k] ^ 0x80;  // int8 q + 128
    return;
  }
  const uint8_t* qs = b + bytes - 16;
  uint8_t* out = tq + (t * KB + kb) * 256;
  for (int p = 0; p < 4; ++p) std::memcpy(out + p * 64 + j * 4, qs + 4 * p, 4);
}

}  // namespace

// Writes the column-tiled copy of `raw` (uint8 [N, row bytes], GGUF blocks of format fmt, N a multiple of 16) into
// tq, td and third, contiguous at the shapes tile() / ktile() give them (third: `to` float16, empty but for Q4_1, or
// `ts` uint8, empty but for the K-quants and IQ4_XS). MXFP4 blocks must tile exactly (every exponent in
// [104, 143]: tiled_kquant.py checks).
void quant_tile_blocks(torch::Tensor raw, int64_t fmt, torch::Tensor tq, torch::Tensor td, torch::Tensor third) {
  TORCH_CHECK(fmt >= kQ8_0 && fmt <= kIQ4_XS, "tile blocks: unknown format ", fmt);
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous() && raw.size(0) % 16 == 0,
              "tile blocks: raw uint8 [N, row bytes], contiguous, N a multiple of 16");
  const int64_t N = raw.size(0), T = N / 16, row_bytes = raw.size(1);
  const bool blocks = kept_as_blocks(fmt);
  const int64_t block_bytes = blocks ? gguf_block_bytes(fmt) : fmt == kQ8_0 ? 34 : fmt == kQ4_0 ? 18 : 20;
  const int64_t KB = row_bytes / block_bytes * (blocks ? gguf_block_values(fmt) / kBlock : 1);
  TORCH_CHECK(row_bytes % block_bytes == 0 && KB > 0, "tile blocks: rows of whole blocks");
  const int64_t qbytes = blocks ? ktile_qbytes(fmt) : fmt == kQ8_0 ? 512 : 256;
  const int64_t td_numel = blocks ? T * ktile_groups(fmt, KB) * ktile_td_width(fmt) : T * KB * 16;
  const int64_t third_numel = !blocks ? (fmt == kQ4_1 ? T * KB * 16 : 0) : T * KB * ktile_ts_width(fmt);
  TORCH_CHECK(tq.scalar_type() == torch::kUInt8 && tq.is_contiguous() && tq.numel() == T * KB * qbytes &&
              td.scalar_type() == torch::kFloat16 && td.is_contiguous() && td.numel() == td_numel &&
              third.is_contiguous() && third.numel() == third_numel &&
              third.scalar_type() == (blocks ? torch::kUInt8 : torch::kFloat16),
              "tile blocks: outputs of the shapes tile() / ktile() give");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* q = tq.data_ptr<uint8_t>();
  uint16_t* d = reinterpret_cast<uint16_t*>(td.data_ptr<at::Half>());
  uint8_t* ts = blocks && third_numel ? third.data_ptr<uint8_t>() : nullptr;
  uint16_t* to = fmt == kQ4_1 ? reinterpret_cast<uint16_t*>(third.data_ptr<at::Half>()) : nullptr;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int j = 0; j < 16; ++j) {
        const uint8_t* row = src + (t * 16 + j) * row_bytes;
        for (int64_t kb = 0; kb < KB; ++kb) {
          if (fmt == kQ5_0)
            ktile_block<kQ5_0>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kQ5_1)
            ktile_block<kQ5_1>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kQ4_K)
            ktile_block<kQ4_K>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kQ5_K)
            ktile_block<kQ5_K>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kQ6_K)
            ktile_block<kQ6_K>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kIQ4_NL)
            ktile_block<kIQ4_NL>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kMXFP4)
            ktile_block<kMXFP4>(row, KB, t, kb, j, q, d, ts);
          else if (fmt == kIQ4_XS)
            ktile_block<kIQ4_XS>(row, KB, t, kb, j, q, d, ts);
          else
            tile_block(row, fmt, KB, t, kb, j, q, d, to);
        }
      }
  });
}

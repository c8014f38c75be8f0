// Shared by the packed quantized-linear sources (concatenated in this order by kvpilot/model/quant/kernel.py:
// quant_common.h, quant_avx512.h, quant_avx2.h, quant_linear_cpu.cpp): the repacked weight layout, the
// portable (scalar, compiler-vectorized) dequantize and dot-product tile, and the per-ISA kernel table.
//
// Layout (the GGUF blocks' own values, split into arrays so SIMD loads are plain): a [N, K] matrix of
// 32-value blocks (KB = K / 32 per row) is `qs` [N, KB * 32] int8 (Q8_0) or [N, KB * 16] uint8 (Q4_0,
// Q4_1: byte j of a block holds value j in its low nibble and value j + 16 in its high nibble, as in
// GGUF), `d` [N, KB] float16 scales and, for Q4_1, `m` [N, KB] float16 minimums.
// Values: Q8_0 d * q; Q4_0 d * (q - 8); Q4_1 d * q + m.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

// Q8_0, Q4_0, Q4_1: split into arrays (below); the rest: GGUF's own blocks (quant_blocks.h), and their column-tiled
// copies for the int8 path (quant_tiled_kq.h). IQ4_NL and MXFP4: a 4-bit index into a table of 16 int8 values.
enum Format : int64_t {
  kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kIQ4_NL = 8, kMXFP4 = 9,
  kIQ4_XS = 10  // IQ4_NL's table in 256-value super-blocks with 6-bit sub-block scales
};
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int64_t kBlock = 32;
constexpr int64_t kNR = 4;  // weight rows dequantized together (one tile's columns)

struct Packed {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;  // nullptr unless Q4_1
  int64_t N, K, KB, fmt;
  int64_t qs_row() const;
};

// The formats kept as GGUF blocks: values and bytes a block
inline bool kept_as_blocks(int64_t fmt) { return fmt >= kQ5_0 && fmt <= kIQ4_XS; }
// The K-quants: 256-value super-blocks with sub-block scales
constexpr bool is_kquant(int64_t fmt) { return fmt >= kQ4_K && fmt <= kQ6_K; }
// The formats of 256-value super-blocks (the K-quants, IQ4_XS): a tile keeps d once a super-block, sub-scales a block
constexpr bool has_super_blocks(int64_t fmt) { return is_kquant(fmt) || fmt == kIQ4_XS; }
// The table formats: value = d * table[4-bit index] (IQ4_NL: d float16; MXFP4: d = 2^(e - 128), e a byte, with the
// table's E2M1 values doubled to integers, as ggml's kvalues_mxfp4)
constexpr bool is_table_format(int64_t fmt) { return fmt == kIQ4_NL || fmt == kMXFP4; }
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline int64_t gguf_block_values(int64_t fmt) { return has_super_blocks(fmt) ? 256 : 32; }
inline int64_t gguf_block_bytes(int64_t fmt) {
  switch (fmt) {
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kIQ4_NL: return 18;
    case kMXFP4: return 17;
    case kIQ4_XS: return 136;
    default: return 210;  // kQ6_K
  }
}

inline int64_t Packed::qs_row() const {
  if (kept_as_blocks(fmt)) return K / gguf_block_values(fmt) * gguf_block_bytes(fmt);
  return KB * (fmt == kQ8_0 ? kBlock : kBlock / 2);
}

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// The offset of a block's values: Q4_0 stores q - 8 as an unsigned nibble, Q4_1 a separate minimum.
inline float block_offset(const Packed& w, float d, int64_t n, int64_t b) {
  if (w.fmt == kQ4_0) return -8.0f * d;
  if (w.fmt == kQ4_1) return half_to_float(w.m[n * w.KB + b]);
  return 0.0f;
}

// Row n of w as float32 into out[K]. `scales` is scratch of 2 * KB floats (used by the SIMD versions).
void dequant_row_scalar(const Packed& w, int64_t n, float* out, float* /*scales*/) {
  const uint8_t* q = w.qs + n * w.qs_row();
  for (int64_t b = 0; b < w.KB; ++b) {
    const float d = half_to_float(w.d[n * w.KB + b]);
    const float off = block_offset(w, d, n, b);
    float* o = out + b * kBlock;
    if (w.fmt == kQ8_0) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(q) + b * kBlock;
      for (int64_t j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(qb[j]);
    } else {
      const uint8_t* qb = q + b * (kBlock / 2);
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        o[j] = d * static_cast<float>(qb[j] & 0x0F) + off;
        o[j + kBlock / 2] = d * static_cast<float>(qb[j] >> 4) + off;
      }
    }
  }
}

// out[i * ldo + j] = dot(x row i, w row j) for i < mr, j < nr; w rows are K apart, K a multiple of 32.
void tile_scalar(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo, int mr, int nr) {
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < nr; ++j) {
      const float* xi = x + i * ldx;
      const float* wj = w + j * K;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xi[k] * wj[k];
      out[i * ldo + j] = acc;
    }
  }
}

// float32 -> bfloat16, round to nearest even (values are finite)
void to_bf16_scalar(const float* in, uint16_t* out, int64_t count) {
  for (int64_t k = 0; k < count; ++k) {
    uint32_t bits;
    std::memcpy(&bits, in + k, 4);
    out[k] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

struct Kernels {
  void (*dequant_row)(const Packed&, int64_t, float*, float*);
  void (*to_bf16)(const float*, uint16_t*, int64_t);
  void (*tile)(const float*, int64_t, const float*, int64_t, float*, int64_t, int, int);
  // optional: up to 4 x rows times weight rows [n0, n0 + nr) dequantized in registers (scratch: 8 * KB floats)
  void (*fused)(const Packed&, int64_t, int, const float*, int64_t, int, float*, int64_t, float*);
  int max_mr;  // x rows per tile (bounded by the vector registers the accumulators take)
};

}  // namespace

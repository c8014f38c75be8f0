// Shared by the CPU decode-attention sources (concatenated in this order by cpu_decode_kernel.py:
// decode_common.h, decode_avx512.h, paged_decode_cpu.cpp): stored K/V element types and their widening to
// float32, a branch-free exp, the task shape, per-thread scratch and the block walk.
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Widening a stored K/V element to float32, branch-free integer and float arithmetic only, so the loops
// over the head dim still vectorize. The 16- and 8-bit formats put the value's exponent and mantissa bits
// where float32 keeps them and rescale by the difference of the exponent biases (exact for normal values);
// their subnormals (exponent field 0) are mantissa x 2^(1 - bias - mantissa bits). Infinities and NaNs are
// never stored (KV values are finite), so they are not special-cased.
struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };
struct Fp8 { uint8_t bits; };  // float8_e4m3fn

inline float from_bits(uint32_t bits) {
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline uint32_t to_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits;
}

inline float widen(float x) { return x; }
inline float widen(Bf16 x) { return from_bits(static_cast<uint32_t>(x.bits) << 16); }

// One sign, E exponent (bias 2^(E-1) - 1) and M mantissa bits in the low 1 + E + M bits. The two scales,
// 2^(127 - bias) and 2^(1 - bias - M), are built as float32 bit patterns (exponent field = power + 127).
template <int E, int M>
inline float widen_small_float(uint32_t bits) {
  constexpr uint32_t sign = 1u << (E + M);
  constexpr int bias = (1 << (E - 1)) - 1;
  const uint32_t mag = bits & (sign - 1u);
  const float normal = from_bits(mag << (23 - M)) * from_bits(static_cast<uint32_t>(254 - bias) << 23);
  const float subnormal = static_cast<float>(mag & ((1u << M) - 1u)) *
                          from_bits(static_cast<uint32_t>(128 - bias - M) << 23);
  const float value = (mag >> M) == 0 ? subnormal : normal;
  return (bits & sign) ? -value : value;
}

inline float widen(Half x) { return widen_small_float<5, 10>(x.bits); }  // bias 15
inline float widen(Fp8 x) { return widen_small_float<4, 3>(x.bits); }    // e4m3fn, bias 7

// exp(x) for x <= 0 (softmax after subtracting the max), written branch-free so the compiler vectorizes
// the loop that calls it: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (~2 ulp).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return from_bits(to_bits(p) + (static_cast<uint32_t>(static_cast<int32_t>(n)) << 23));  // p * 2^n
}

struct Shape {
  int64_t H, kvH, G, NB, BS, MB;
  int64_t q_row, out_row;  // element strides between sequences of q and out (rows may be views of a wider tensor)
};

// A layer's attention variant (kvpilot.model.attention.base.LayerAttention): window 0 = every earlier key,
// else the last `window` keys (the query's own included); softcap 0 = none, else scores become
// softcap * tanh(scores / softcap); sinks nullptr = none, else one logit per query head that joins the softmax
// denominator with no value.
struct Variant {
  int64_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;

  // The first key a decode over keys 0..L-1 sees: blocks wholly before it are never read (a KV manager may
  // have handed them to another sequence).
  int64_t first_key(int64_t L) const { return window > 0 && L > window ? L - window : 0; }
};

// Calls row_fn(row, t) for the cached rows of tokens lo..L-1 (t = token - lo) of KV head h in `cache`, block by
// block through the sequence's block table (no division per token); blocks before lo's are never touched.
template <typename KV, typename RowFn>
inline void for_each_row(const KV* cache, const int64_t* table, int64_t lo, int64_t L, int64_t h, const Shape& s,
                         int64_t D, RowFn row_fn) {
  for (int64_t pos = lo; pos < L;) {
    const int64_t blk = pos / s.BS, off = pos % s.BS;
    const int64_t n = std::min(s.BS - off, L - pos);
    const KV* rows = cache + ((h * s.NB + table[blk]) * s.BS + off) * D;
    for (int64_t t = 0; t < n; ++t) row_fn(rows + t * D, pos - lo + t);
    pos += n;
  }
}

// scores[0..n) -> softcap * tanh(scores / softcap) (Gemma 2's logit soft-capping), in place.
inline void softcap_scores(float* scores, int64_t n, float softcap) {
  const float inv = 1.f / softcap;
  for (int64_t t = 0; t < n; ++t) scores[t] = softcap * std::tanh(scores[t] * inv);
}

// Per-thread buffers, reused across the tasks of one thread (no allocation per task once grown).
// Asks for a later block's bytes while this one is computed: blocks sit at random places, and the hardware
// prefetcher stops at each 4 KiB page, so without this every block starts with a full memory latency. The
// task asks kBlocksAhead blocks ahead (K blocks, then V blocks, as one sequence; the first ones at its start).
// One ahead left it waiting on randomly placed blocks; two and then three were each faster there (consecutive
// blocks unchanged), six or eight no better (docs/benchmark-log.md, "Figures moved out of the code"). A running
// server's tables are mostly scattered (7% of neighbouring blocks consecutive at c64), which is where the third
// block pays. Keep the prefetches written out in the loops: the same logic as a capturing lambda ran the kernel
// 2x slower (GCC 12).
constexpr int64_t kBlocksAhead = 3;

template <typename KV>
inline void prefetch_block(const KV* rows, int64_t n, int64_t row_elems) {
  const char* p = reinterpret_cast<const char*>(rows);
  const int64_t bytes = n * row_elems * static_cast<int64_t>(sizeof(KV));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);  // prefetcht0
}

struct Scratch {
  std::vector<float> scores, acc, inv, q;

  // Sized for one task (G query heads over L tokens, head dim D), accumulators zeroed.
  void prepare(int64_t G, int64_t L, int64_t D) {
    scores.resize(static_cast<size_t>(G * L));
    acc.assign(static_cast<size_t>(G * D), 0.f);
    inv.resize(static_cast<size_t>(G));
  }
};

}  // namespace

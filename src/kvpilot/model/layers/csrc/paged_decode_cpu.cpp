// Paged decode attention on CPU (float32 queries; K/V stored as float32, bfloat16, float16 or fp8 e4m3 and
// widened to float32 as they are read): every decoding sequence's G query heads (sharing one KV head)
// attend over its cached K/V, read in place through its block table. Built at run time by
// kvpilot/model/layers/cpu_decode_kernel.py with torch's cpp_extension.
//
// Why this shape: decode attention streams the whole KV cache from memory every step, so the kernel is
// memory-bound (a 2-byte or 1-byte KV dtype makes it faster as well as smaller); it touches each K and V
// row once (all G heads use it while it is in cache), walks blocks rather than dividing per token, and
// keeps the inner loops over the head dim vectorizable.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
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

inline float widen(Half x) {  // 1 sign, 5 exponent (bias 15), 10 mantissa bits
  const uint32_t mag = x.bits & 0x7fffu;
  const float normal = from_bits(mag << 13) * 0x1p112f;
  const float subnormal = static_cast<float>(mag & 0x3ffu) * 0x1p-24f;
  const float value = (mag >> 10) == 0 ? subnormal : normal;
  return (x.bits & 0x8000u) ? -value : value;
}

inline float widen(Fp8 x) {  // 1 sign, 4 exponent (bias 7), 3 mantissa bits
  const uint32_t mag = x.bits & 0x7fu;
  const float normal = from_bits(mag << 20) * 0x1p120f;
  const float subnormal = static_cast<float>(mag & 0x7u) * 0x1p-9f;
  const float value = (mag >> 3) == 0 ? subnormal : normal;
  return (x.bits & 0x80u) ? -value : value;
}

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

// Calls row_fn(row, t) for the L cached rows (tokens t = 0..L-1) of KV head h in `cache`, block by block
// through the sequence's block table (no division per token).
template <typename KV, typename RowFn>
inline void for_each_row(const KV* cache, const int64_t* table, int64_t L, int64_t h, const Shape& s, int64_t D,
                         RowFn row_fn) {
  for (int64_t start = 0, blk = 0; start < L; start += s.BS, ++blk) {
    const int64_t n = std::min(s.BS, L - start);
    const KV* rows = cache + (h * s.NB + table[blk]) * s.BS * D;
    for (int64_t t = 0; t < n; ++t) row_fn(rows + t * D, start + t);
  }
}

// Per-thread buffers, reused across the tasks of one thread (no allocation per task once grown).
struct Scratch {
  std::vector<float> scores, acc, inv;
};

// One (sequence, KV head) task: the G query heads that share KV head h attend over L cached tokens.
// kD > 0: head dim known at compile time (loops unroll and vectorize); kD == 0: runtime `dim`.
template <int kD, typename KV>
void attend_one(float* out, const float* q, const KV* kc, const KV* vc, const int64_t* table, int64_t L,
                int64_t h, const Shape& s, int64_t dim, float scale, Scratch& scratch) {
  const int64_t D = kD > 0 ? kD : dim;
  const int64_t G = s.G;
  scratch.scores.resize(static_cast<size_t>(G * L));
  scratch.acc.assign(static_cast<size_t>(G * D), 0.f);
  scratch.inv.resize(static_cast<size_t>(G));
  float* sc = scratch.scores.data();
  float* ac = scratch.acc.data();
  float* inv = scratch.inv.data();
  // pass 1: scores
  for_each_row(kc, table, L, h, s, D, [&](const KV* kr, int64_t t) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * widen(kr[d]);
      sc[g * L + t] = dot * scale;
    }
  });
  // pass 2: softmax numerators and their sums
  for (int64_t g = 0; g < G; ++g) {
    float* row = sc + g * L;
    float m = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < L; ++t) m = std::max(m, row[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      const float e = exp_nonpos(row[t] - m);
      row[t] = e;
      sum += e;
    }
    inv[g] = 1.f / sum;
  }
  // pass 3: probability-weighted values
  for_each_row(vc, table, L, h, s, D, [&](const KV* vr, int64_t t) {
    for (int64_t g = 0; g < G; ++g) {
      const float p = sc[g * L + t];
      float* ag = ac + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * widen(vr[d]);
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* og = out + g * D;
    const float* ag = ac + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) og[d] = ag[d] * inv[g];
  }
}

template <int kD, typename KV>
void run_all(float* op, const float* qp, const KV* kp, const KV* vp, const int64_t* bt, const int64_t* cl,
             int64_t B, const Shape& s, int64_t D, float scale) {
  at::parallel_for(0, B * s.kvH, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / s.kvH, h = i % s.kvH;
      const int64_t head = h * s.G * D;
      attend_one<kD, KV>(op + b * s.out_row + head, qp + b * s.q_row + head, kp, vp, bt + b * s.MB, cl[b], h, s,
                         D, scale, scratch);
    }
  });
}

template <typename KV>
void dispatch_dim(float* op, const float* qp, const void* kp, const void* vp, const int64_t* bt, const int64_t* cl,
                  int64_t B, const Shape& s, int64_t D, float scale) {
  const KV* k = static_cast<const KV*>(kp);
  const KV* v = static_cast<const KV*>(vp);
  if (D == 64) run_all<64, KV>(op, qp, k, v, bt, cl, B, s, D, scale);
  else if (D == 128) run_all<128, KV>(op, qp, k, v, bt, cl, B, s, D, scale);
  else run_all<0, KV>(op, qp, k, v, bt, cl, B, s, D, scale);
}

}  // namespace

// out, q: [B, H, D] float32, each sequence's [H, D] contiguous (rows may be strided); k_cache, v_cache: [kvH, num_blocks, block_size, D] contiguous, float32,
// bfloat16, float16 or float8_e4m3fn; block_tables: [B, max_blocks] int64; context_lens: [B] int64 (>= 1).
// Query heads h*G..h*G+G-1 use KV head h.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32, "q/out must be float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  const int64_t B = q.size(0), D = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D,
              "paged_decode: each sequence's [H, D] of q and out must be contiguous");
  Shape s{q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0), k_cache.size(1), k_cache.size(2),
          block_tables.size(1), q.stride(0), out.stride(0)};
  float* op = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const void* kp = k_cache.data_ptr();
  const void* vp = v_cache.data_ptr();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const float fs = static_cast<float>(scale);
  switch (k_cache.scalar_type()) {
    case torch::kFloat32: dispatch_dim<float>(op, qp, kp, vp, bt, cl, B, s, D, fs); break;
    case torch::kBFloat16: dispatch_dim<Bf16>(op, qp, kp, vp, bt, cl, B, s, D, fs); break;
    case torch::kFloat16: dispatch_dim<Half>(op, qp, kp, vp, bt, cl, B, s, D, fs); break;
    case torch::kFloat8_e4m3fn: dispatch_dim<Fp8>(op, qp, kp, vp, bt, cl, B, s, D, fs); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

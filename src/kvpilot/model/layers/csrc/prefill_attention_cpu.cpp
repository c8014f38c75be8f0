// Causal prefill attention on CPU for bfloat16 queries and K/V (AVX512_BF16): one prompt chunk's queries attend
// over the sequence's cached keys, read through its block table, flash-style (online softmax, nothing of size
// queries x keys is stored). Built at run time by kvpilot/model/layers/cpu_prefill_kernel.py after simd_exp.h,
// with -march=native; without AVX512_BF16 the module builds but `prefill_kernel_available()` is false.
//
// Why: torch's scaled_dot_product_attention reached ~70 GFLOP/s on a 512-token bf16 prompt on a 2-vCPU Zen 4
// (about a third of a prefill once the GEMMs ran on int8). Here products are vdpbf16ps (2 bf16 products per
// lane, float32 sums) on K and V repacked once per (sequence, KV head) into pair-interleaved tiles, 4 query rows
// share every K / V register, and a 32-key block's softmax costs a few vector ops per row.
// Numerics: scores and the softmax in float32; the probabilities are rounded to bfloat16 for the P.V products
// (as a bf16 GEMM would take them); the output is rounded to bfloat16 (nearest even).
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRows = 4;   // query rows per task: each K / V register serves all 4
constexpr int64_t kKeys = 32;  // keys per softmax step (two 16-lane score vectors per row)

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

inline __m512bh pair_bcast(const uint16_t* pair) {  // two bf16 values, as one 32-bit lane, in all 16 lanes
  uint32_t bits;
  std::memcpy(&bits, pair, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// One KV head's keys and values, repacked for vdpbf16ps (padded with zeros to a multiple of kKeys keys):
// kp[((b * D / 2 + p) * 16 + j) * 2 + e] = K[16 b + j][2 p + e];  vp[(t * D + d) * 2 + e] = V[2 t + e][d]
struct PackedKV {
  std::vector<uint16_t> k, v;
};

void pack_head(PackedKV& out, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t L,
               int64_t block_size, int64_t block_stride, int64_t D) {
  const int64_t padded = (L + kKeys - 1) / kKeys * kKeys;
  out.k.assign(padded * D, 0);
  out.v.assign(padded * D, 0);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t row = table[t / block_size] * block_stride + (t % block_size) * D;
    const uint16_t* kr = kc + row;
    const uint16_t* vr = vc + row;
    const int64_t b = t / 16, j = t % 16;
    for (int64_t p = 0; p < D / 2; ++p) {
      uint16_t* dst = out.k.data() + ((b * (D / 2) + p) * 16 + j) * 2;
      dst[0] = kr[2 * p];
      dst[1] = kr[2 * p + 1];
    }
    uint16_t* vdst = out.v.data() + (t / 2) * D * 2 + (t % 2);
    for (int64_t d = 0; d < D; ++d) vdst[d * 2] = vr[d];
  }
}

// One row's online-softmax step over the scores s0 / s1 of keys [k0, k0 + 32), `visible` = pos - k0: updates
// m and l, rescales acc, and gives the probabilities (zero past pos). False when the row sees none of the keys.
template <int64_t NC>
inline bool softmax_step(__m512 s0, __m512 s1, int64_t visible, float scale, float& m, float& l,
                         __m512 (&acc)[NC], __m512& p0, __m512& p1) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i last = _mm512_set1_epi32(static_cast<int>(visible));  // keys k0 + lane <= pos
  const __mmask16 v0 = _mm512_cmple_epi32_mask(lane, last);
  const __mmask16 v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), last);
  const __m512 none = _mm512_set1_ps(neg_inf), sc = _mm512_set1_ps(scale);
  const __m512 x0 = _mm512_mask_blend_ps(v0, none, _mm512_mul_ps(s0, sc));
  const __m512 x1 = _mm512_mask_blend_ps(v1, none, _mm512_mul_ps(s1, sc));
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
  if (block_max == neg_inf) return false;
  const float m_new = std::max(m, block_max);
  const float alpha = m == neg_inf ? 0.f : m == m_new ? 1.f : std::exp(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  p0 = _mm512_maskz_mov_ps(v0, exp_nonpos16(_mm512_sub_ps(x0, mv)));
  p1 = _mm512_maskz_mov_ps(v1, exp_nonpos16(_mm512_sub_ps(x1, mv)));
  l = l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  m = m_new;
  if (alpha != 1.f)
    for (int64_t c = 0; c < NC; ++c) acc[c] = _mm512_mul_ps(acc[c], _mm512_set1_ps(alpha));
  return true;
}

// Rows r of one task: query row pointer, position (its last visible key), and the output row.
template <int64_t D>
struct Task {
  const uint16_t* q[kRows];
  uint16_t* out[kRows];
  int64_t pos[kRows];
  int64_t n;  // rows used (<= kRows)
};

// out rows = acc / l, rounded to bf16 (nearest even).
template <int64_t D>
inline void store_rows(const Task<D>& task, const __m512 (&acc)[kRows][D / 16], const float* l) {
  for (int64_t r = 0; r < task.n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t c = 0; c < D / 16; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(task.out[r] + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
  }
}

template <int64_t D>
void attend_rows(const Task<D>& task, const PackedKV& kv, float scale) {
  constexpr int64_t NC = D / 16;  // 16-lane chunks of a head
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 acc[kRows][NC];
  float m[kRows], l[kRows];
  alignas(64) uint16_t qb[kRows][D];  // the task's query rows, zeros past n: every loop runs all kRows rows
  for (int64_t r = 0; r < kRows; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
    for (int64_t c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    if (r < task.n) std::memcpy(qb[r], task.q[r], D * 2);
    else std::memset(qb[r], 0, D * 2);
  }
  int64_t last = 0;
  for (int64_t r = 0; r < task.n; ++r) last = std::max(last, task.pos[r]);
  for (int64_t k0 = 0; k0 <= last; k0 += kKeys) {
    // scores of the 32 keys [k0, k0 + 32) for each row
    __m512 s[kRows][2];
    for (int64_t r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const uint16_t* kb0 = kv.k.data() + (k0 / 16) * (D / 2) * 32;
    const uint16_t* kb1 = kb0 + (D / 2) * 32;
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh ka = (__m512bh)_mm512_loadu_si512(kb0 + p * 32);
      const __m512bh kbv = (__m512bh)_mm512_loadu_si512(kb1 + p * 32);
      for (int64_t r = 0; r < kRows; ++r) {  // a constant count: the scores stay in registers
        const __m512bh qp = pair_bcast(qb[r] + 2 * p);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], ka, qp);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], kbv, qp);
      }
    }
    // online softmax per row; probabilities rounded to bf16 pairs for the P.V products
    alignas(64) uint32_t probs[kRows][16] = {};
    for (int64_t r = 0; r < task.n; ++r) {
      __m512 p0, p1;
      if (!softmax_step<NC>(s[r][0], s[r][1], task.pos[r] - k0, scale, m[r], l[r], acc[r], p0, p1))
        continue;  // no visible key here for this row: its probabilities stay zero
      _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // lane t: keys k0 + 2t, k0 + 2t + 1
    }
    // acc += P . V over the 16 key pairs
    const uint16_t* vb = kv.v.data() + (k0 / 2) * D * 2;
    for (int64_t t = 0; t < kKeys / 2; ++t) {
      __m512bh v[NC];
      for (int64_t c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vb + (t * D + c * 16) * 2);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r][t]));
        for (int64_t c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pp);
      }
    }
  }
  store_rows<D>(task, acc, l);
}

template <int64_t D>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const int64_t* table, int64_t start, int64_t L, float scale) {
  const int64_t T = q.size(0), H = q.size(1), kvH = k_cache.size(0), G = H / kvH;
  const int64_t block_size = k_cache.size(2), block_stride = k_cache.stride(1);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  std::vector<PackedKV> packed(kvH);
  at::parallel_for(0, kvH, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      pack_head(packed[h], kc + h * k_cache.stride(0), vc + h * v_cache.stride(0), table, L, block_size,
                block_stride, D);
  });
  // rows of KV head h: (query i, head h * G + g) in query-major order; tasks of kRows rows. A later task sees
  // more keys (causal), so tasks go in zig-zag order (first, last, second, ...): each thread's contiguous share
  // of them costs about the same.
  const int64_t rows_per_head = T * G, tasks_per_head = (rows_per_head + kRows - 1) / kRows;
  at::parallel_for(0, kvH * tasks_per_head, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t % kvH, j = t / kvH;
      const int64_t first = (j % 2 == 0 ? j / 2 : tasks_per_head - 1 - j / 2) * kRows;
      Task<D> task;
      task.n = std::min(kRows, rows_per_head - first);
      for (int64_t r = 0; r < task.n; ++r) {
        const int64_t i = (first + r) / G, head = h * G + (first + r) % G;
        task.q[r] = qp + i * q.stride(0) + head * q.stride(1);
        task.out[r] = op + i * out.stride(0) + head * out.stride(1);
        task.pos[r] = start + i;
      }
      attend_rows<D>(task, packed[h], scale);
    }
  });
}
#else
constexpr bool kAvailable = false;
#endif

}  // namespace

// Whether this build runs prefill_attention_bf16 (the CPU has AVX512_BF16).
bool prefill_kernel_available() { return kAvailable; }

// out [T, H, D] bf16 = causal attention of q [T, H, D] bf16 (queries at positions start .. start + T - 1) over the
// first L = start + T keys of one sequence in k_cache / v_cache [kvH, num_blocks, block_size, D] bf16, read
// through block_ids (int64, covering L); D 64 or 128, H a multiple of kvH; q / out rows with unit stride inside.
void prefill_attention_bf16(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_ids, int64_t start, double scale) {
  TORCH_CHECK(kAvailable, "the prefill attention kernel needs AVX512_BF16");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
              k_cache.scalar_type() == torch::kBFloat16 && v_cache.scalar_type() == torch::kBFloat16,
              "bf16 queries, output and K/V only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1 &&
              k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
              k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3), "layouts");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), kvH = k_cache.size(0), L = start + T;
  TORCH_CHECK(H % kvH == 0 && k_cache.size(3) == D && block_ids.scalar_type() == torch::kInt64 &&
              block_ids.is_contiguous() && block_ids.numel() * k_cache.size(2) >= L, "shapes");
#if defined(__AVX512BF16__)
  const int64_t* table = block_ids.data_ptr<int64_t>();
  if (D == 64) run<64>(out, q, k_cache, v_cache, table, start, L, static_cast<float>(scale));
  else if (D == 128) run<128>(out, q, k_cache, v_cache, table, start, L, static_cast<float>(scale));
  else TORCH_CHECK(false, "head dim ", D, ": the prefill attention kernel takes 64 or 128");
#endif
}

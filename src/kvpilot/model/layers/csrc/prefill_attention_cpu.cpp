// Causal prefill attention on CPU for bfloat16 queries and K/V (AVX512_BF16): one prompt chunk's queries attend
// over the sequence's cached keys, read through its block table, flash-style (online softmax, nothing of size
// queries x keys is stored). Layer variants (LayerAttention): a sliding window (only the keys some query of the
// chunk sees are read, from the first one's window on; blocks wholly before it are never touched), logit
// soft-capping, attention sinks. Built at run time by kvpilot/model/layers/cpu_prefill_kernel.py after simd_exp.h,
// with -march=native; without AVX512_BF16 the module builds but `prefill_kernel_available()` is false.
//
// Why: torch's scaled_dot_product_attention reached ~70 GFLOP/s on a 512-token bf16 prompt on a 2-vCPU Zen 4
// (about a third of a prefill once the GEMMs ran on int8). Here products are vdpbf16ps (2 bf16 products per
// lane, float32 sums) on K and V repacked once per (sequence, KV head) into pair-interleaved tiles, 4 query rows
// share every K / V register, and a 32-key block's softmax costs a few vector ops per row.
// Numerics: scores and the softmax in float32; the probabilities are rounded to bfloat16 for the P.V products
// (as a bf16 GEMM would take them); the output is rounded to bfloat16 (nearest even).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kRows = 4;   // query rows per task: each K / V register serves all 4
constexpr int64_t kKeys = 32;  // keys per softmax step (two 16-lane score vectors per row)

// What one call computes beyond plain causal attention (LayerAttention): window 0 = none; softcap 0 = none;
// sinks nullptr = none, else float32 [H].
struct Variant {
  int64_t window;
  float softcap;
  const float* sinks;
};

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

inline __m512bh pair_bcast(const uint16_t* pair) {  // two bf16 values, as one 32-bit lane, in all 16 lanes
  uint32_t bits;
  std::memcpy(&bits, pair, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// One KV head's keys lo..L-1 and their values, repacked for vdpbf16ps (padded with zeros to a multiple of kKeys
// keys), indexed from lo: kp[((b * D / 2 + p) * 16 + j) * 2 + e] = K[lo + 16 b + j][2 p + e];
// vp[(t * D + d) * 2 + e] = V[lo + 2 t + e][d]
struct PackedKV {
  std::vector<uint16_t> k, v;
};

void pack_head(PackedKV& out, const uint16_t* kc, const uint16_t* vc, const int64_t* table, int64_t lo, int64_t L,
               int64_t block_size, int64_t block_stride, int64_t D) {
  const int64_t padded = (L - lo + kKeys - 1) / kKeys * kKeys;
  out.k.assign(padded * D, 0);
  out.v.assign(padded * D, 0);
  for (int64_t t = 0; t < L - lo; ++t) {
    const int64_t key = lo + t;
    const int64_t row = table[key / block_size] * block_stride + (key % block_size) * D;
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

// The keys a row sees within a 32-key step, relative to its first key k0: lanes first..last (first may be
// negative, last past 31).
struct Visible {
  int64_t first, last;
};

// Scaled (and soft-capped when softcap > 0) scores, -inf outside `mask`.
inline __m512 scaled_scores(__m512 s, __mmask16 mask, float scale, float softcap) {
  __m512 x = _mm512_mul_ps(s, _mm512_set1_ps(scale));
  if (softcap > 0.f) x = softcap16(x, softcap);
  return _mm512_mask_blend_ps(mask, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), x);
}

// One row's online-softmax step over the scores s0 / s1 of keys [k0, k0 + 32): updates m and l, rescales acc,
// and gives the probabilities (zero outside `seen`). False when the row sees none of the keys.
template <int64_t NC>
inline bool softmax_step(__m512 s0, __m512 s1, Visible seen, float scale, float softcap, float& m, float& l,
                         __m512 (&acc)[NC], __m512& p0, __m512& p1) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i lane1 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
  // clamped to [-1, 32] so they fit 32-bit lanes however long the context
  const __m512i first = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(seen.first, -1, 32)));
  const __m512i last = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(seen.last, -1, 32)));
  const __mmask16 v0 = _mm512_cmple_epi32_mask(lane, last) & _mm512_cmpge_epi32_mask(lane, first);
  const __mmask16 v1 = _mm512_cmple_epi32_mask(lane1, last) & _mm512_cmpge_epi32_mask(lane1, first);
  const __m512 x0 = scaled_scores(s0, v0, scale, softcap);
  const __m512 x1 = scaled_scores(s1, v1, scale, softcap);
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

// Rows r of one task: query row pointer, the keys it sees (first[r]..pos[r], indexes into the packed keys), its
// sink logit (-inf when none) and the output row.
template <int64_t D>
struct Task {
  const uint16_t* q[kRows];
  uint16_t* out[kRows];
  int64_t first[kRows];
  int64_t pos[kRows];
  float sink[kRows];
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
void attend_rows(const Task<D>& task, const PackedKV& kv, float scale, float softcap) {
  constexpr int64_t NC = D / 16;  // 16-lane chunks of a head
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 acc[kRows][NC];
  float m[kRows], l[kRows];
  alignas(64) uint16_t qb[kRows][D];  // the task's query rows, zeros past n: every loop runs all kRows rows
  for (int64_t r = 0; r < kRows; ++r) {
    // a sink starts the row's softmax as one term of value zero: m = sink, l = exp(sink - m) = 1
    const bool sink = r < task.n && task.sink[r] != neg_inf;
    m[r] = sink ? task.sink[r] : neg_inf;
    l[r] = sink ? 1.f : 0.f;
    for (int64_t c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    if (r < task.n) std::memcpy(qb[r], task.q[r], D * 2);
    else std::memset(qb[r], 0, D * 2);
  }
  int64_t last = 0, first = task.first[0];
  for (int64_t r = 0; r < task.n; ++r) {
    last = std::max(last, task.pos[r]);
    first = std::min(first, task.first[r]);
  }
  for (int64_t k0 = first - first % kKeys; k0 <= last; k0 += kKeys) {
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
      const Visible seen{task.first[r] - k0, task.pos[r] - k0};
      if (!softmax_step<NC>(s[r][0], s[r][1], seen, scale, softcap, m[r], l[r], acc[r], p0, p1))
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

// One sequence of a call: query rows q0 .. q0 + T - 1 at positions start .. start + T - 1, keys read through
// `table` from lo (the first key any of its queries sees) to start + T - 1.
struct SeqSpan {
  int64_t q0, T, start, lo;
  const int64_t* table;
};

// A task: kRows rows (query-major, G heads per query) of KV head h of sequence seq, from row `first` of its
// T x G rows; `cost` the keys its last row sees (tasks are split between threads by it).
struct TaskRef {
  int64_t seq, h, first, cost;
};

std::vector<TaskRef> make_tasks(const std::vector<SeqSpan>& seqs, int64_t kvH, int64_t G, int64_t window) {
  std::vector<TaskRef> tasks;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
    const int64_t rows = seqs[s].T * G;
    for (int64_t h = 0; h < kvH; ++h)
      for (int64_t first = 0; first < rows; first += kRows) {
        const int64_t pos = seqs[s].start + (std::min(first + kRows, rows) - 1) / G;
        tasks.push_back({s, h, first, window > 0 ? std::min(window, pos + 1) : pos + 1});
      }
  }
  return tasks;
}

// bounds[i] .. bounds[i + 1] - 1: the tasks of part i of n, each part about the same total cost (a later query
// sees more keys, so equal task counts would leave the thread with the early rows idle).
std::vector<int64_t> cost_parts(const std::vector<TaskRef>& tasks, int64_t n) {
  int64_t total = 0;
  for (const TaskRef& t : tasks) total += t.cost;
  std::vector<int64_t> bounds(n + 1, static_cast<int64_t>(tasks.size()));
  bounds[0] = 0;
  int64_t before = 0, part = 1;
  for (int64_t k = 0; k < static_cast<int64_t>(tasks.size()) && part < n; ++k) {
    while (part < n && before * n >= part * total) bounds[part++] = k;  // task k starts at or past part's share
    before += tasks[k].cost;
  }
  return bounds;
}

template <int64_t D>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const std::vector<SeqSpan>& seqs, float scale, const Variant& var) {
  const int64_t H = q.size(1), kvH = k_cache.size(0), G = H / kvH, S = static_cast<int64_t>(seqs.size());
  const int64_t block_size = k_cache.size(2), block_stride = k_cache.stride(1);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  std::vector<PackedKV> packed(S * kvH);  // (sequence, KV head) -> its keys and values, repacked once
  at::parallel_for(0, S * kvH, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const SeqSpan& seq = seqs[i / kvH];
      const int64_t h = i % kvH;
      pack_head(packed[i], kc + h * k_cache.stride(0), vc + h * v_cache.stride(0), seq.table, seq.lo,
                seq.start + seq.T, block_size, block_stride, D);
    }
  });
  const std::vector<TaskRef> tasks = make_tasks(seqs, kvH, G, var.window);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  const std::vector<int64_t> bounds = cost_parts(tasks, parts);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t k = bounds[p0]; k < bounds[p1]; ++k) {
      const TaskRef& ref = tasks[k];
      const SeqSpan& seq = seqs[ref.seq];
      const int64_t rows = seq.T * G;
      Task<D> task;
      task.n = std::min(kRows, rows - ref.first);
      for (int64_t r = 0; r < task.n; ++r) {
        const int64_t i = (ref.first + r) / G, head = ref.h * G + (ref.first + r) % G;
        task.q[r] = qp + (seq.q0 + i) * q.stride(0) + head * q.stride(1);
        task.out[r] = op + (seq.q0 + i) * out.stride(0) + head * out.stride(1);
        const int64_t pos = seq.start + i;
        task.pos[r] = pos - seq.lo;
        task.first[r] = var.window > 0 ? std::max<int64_t>(0, pos - var.window + 1) - seq.lo : 0;
        task.sink[r] = var.sinks != nullptr ? var.sinks[head] : -std::numeric_limits<float>::infinity();
      }
      attend_rows<D>(task, packed[ref.seq * kvH + ref.h], scale, var.softcap);
    }
  });
}
#else
constexpr bool kAvailable = false;
#endif

}  // namespace

// Whether this build runs prefill_attention_bf16 (the CPU has AVX512_BF16).
bool prefill_kernel_available() { return kAvailable; }

namespace {

// num_queries: the sequence's rows of q (all of q for a one-sequence call)
void check_prefill_args(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_ids, int64_t start,
                        int64_t num_queries) {
  TORCH_CHECK(kAvailable, "the prefill attention kernel needs AVX512_BF16");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
              k_cache.scalar_type() == torch::kBFloat16 && v_cache.scalar_type() == torch::kBFloat16,
              "bf16 queries, output and K/V only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1 &&
              k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
              k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3), "layouts");
  const int64_t H = q.size(1), D = q.size(2), kvH = k_cache.size(0), L = start + num_queries;
  TORCH_CHECK(H % kvH == 0 && k_cache.size(3) == D && block_ids.scalar_type() == torch::kInt64 &&
              block_ids.is_contiguous() && block_ids.numel() * k_cache.size(2) >= L, "shapes");
  TORCH_CHECK(D == 64 || D == 128, "head dim ", D, ": the prefill attention kernel takes 64 or 128");
}

// The first key any query of a sequence whose first query is at `start` sees: its window's start (keys and
// blocks before it are never read).
int64_t first_key(int64_t start, const Variant& var) {
  return var.window > 0 ? std::max<int64_t>(0, start - var.window + 1) : 0;
}

void run_spans(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, const std::vector<SeqSpan>& seqs, double scale, const Variant& var) {
#if defined(__AVX512BF16__)
  if (q.size(2) == 64) run<64>(out, q, k_cache, v_cache, seqs, static_cast<float>(scale), var);
  else run<128>(out, q, k_cache, v_cache, seqs, static_cast<float>(scale), var);
#endif
}

void prefill_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_ids, int64_t start, double scale,
                  const Variant& var) {
  check_prefill_args(out, q, k_cache, v_cache, block_ids, start, q.size(0));
  run_spans(out, q, k_cache, v_cache, {SeqSpan{0, q.size(0), start, first_key(start, var),
                                               block_ids.data_ptr<int64_t>()}}, scale, var);
}

Variant make_variant(const torch::Tensor& q, int64_t window, double softcap, const torch::Tensor& sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "prefill attention: window and softcap must be >= 0");
  Variant var{window, static_cast<float>(softcap), nullptr};
  if (sinks.numel() > 0) {
    TORCH_CHECK(sinks.scalar_type() == torch::kFloat32 && sinks.is_contiguous() && sinks.numel() == q.size(1),
                "prefill attention: sinks must be float32 [heads], contiguous");
    var.sinks = sinks.data_ptr<float>();
  }
  return var;
}

}  // namespace

// out [T, H, D] bf16 = causal attention of q [T, H, D] bf16 (queries at positions start .. start + T - 1) over the
// first L = start + T keys of one sequence in k_cache / v_cache [kvH, num_blocks, block_size, D] bf16, read
// through block_ids (int64, covering L); D 64 or 128, H a multiple of kvH; q / out rows with unit stride inside.
void prefill_attention_bf16(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_ids, int64_t start, double scale) {
  prefill_impl(out, q, k_cache, v_cache, block_ids, start, scale, Variant{0, 0.f, nullptr});
}

// prefill_attention_bf16 for a layer's variant: window 0 (all earlier keys) or the last `window` keys of each
// query (block_ids entries wholly before the first query's window may name any block: never read); softcap 0 or
// the soft-cap; sinks empty or float32 [H].
void prefill_attention_bf16_variant(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                                    torch::Tensor v_cache, torch::Tensor block_ids, int64_t start, double scale,
                                    int64_t window, double softcap, torch::Tensor sinks) {
  prefill_impl(out, q, k_cache, v_cache, block_ids, start, scale, make_variant(q, window, softcap, sinks));
}

// prefill_attention_bf16_variant for several sequences in one call (one step's prompt chunks): sequence s has
// query rows query_starts[s] .. + query_lens[s] - 1 of q / out (the rows of different sequences must not
// overlap), its first query at position starts[s], its blocks in row s of block_tables [S, max_blocks] int64
// (covering starts[s] + query_lens[s] keys); query_starts, query_lens, starts: [S] int64. The work of all
// sequences is split between the threads by cost, in two parallel regions in all. Each row equals the
// one-sequence call's, bit for bit.
void prefill_attention_bf16_batch(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                                  torch::Tensor starts, double scale, int64_t window, double softcap,
                                  torch::Tensor sinks) {
  const int64_t S = query_starts.numel();
  for (const torch::Tensor* t : {&query_starts, &query_lens, &starts})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == S,
                "prefill_attention_bf16_batch: query_starts, query_lens and starts: [S] int64, contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.size(0) == S &&
              block_tables.is_contiguous(), "prefill_attention_bf16_batch: block_tables [S, max_blocks] int64");
  const Variant var = make_variant(q, window, softcap, sinks);
  const int64_t* q0 = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* pos = starts.data_ptr<int64_t>();
  std::vector<SeqSpan> seqs;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(q0[s] >= 0 && lens[s] >= 1 && q0[s] + lens[s] <= q.size(0) && pos[s] >= 0,
                "prefill_attention_bf16_batch: sequence ", s, "'s rows are out of range");
    check_prefill_args(out, q, k_cache, v_cache, block_tables[s], pos[s], lens[s]);
    const int64_t* table = block_tables.data_ptr<int64_t>() + s * block_tables.size(1);
    seqs.push_back({q0[s], lens[s], pos[s], first_key(pos[s], var), table});
  }
  if (!seqs.empty()) run_spans(out, q, k_cache, v_cache, seqs, scale, var);
}

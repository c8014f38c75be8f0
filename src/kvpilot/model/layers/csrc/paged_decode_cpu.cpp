// Paged decode attention on CPU (float32 queries; K/V stored as float32, bfloat16, float16 or fp8 e4m3 and
// widened to float32 as they are read): every decoding sequence's G query heads (sharing one KV head)
// attend over its cached K/V, read in place through its block table. Built at run time by
// kvpilot/model/layers/cpu_decode_kernel.py with torch's cpp_extension, after decode_common.h, decode_avx512.h and
// decode_avx2.h.
//
// Why this shape: decode attention streams the whole KV cache from memory every step, so the kernel is
// memory-bound (a 2-byte or 1-byte KV dtype makes it faster as well as smaller); it touches each K and V
// row once (all G heads use it while it is in cache) and walks blocks rather than dividing per token.
// The common head dims (64, 128) and 32/16-bit KV dtypes take the explicit vector path of decode_avx512.h (AVX-512
// CPUs) or decode_avx2.h (AVX2); the portable loops below serve everything else.
namespace {

// One (sequence, KV head) task: the G query heads that share KV head h attend over the cached tokens the
// variant lets them see (lo..L-1; blocks before lo are never read).
// kD > 0: head dim known at compile time (loops unroll and vectorize); kD == 0: runtime `dim`.
template <int kD, typename KV>
void attend_one(float* out, const float* q, const KV* kc, const KV* vc, const int64_t* table, int64_t L,
                int64_t h, const Shape& s, int64_t dim, float scale, const Variant& var, Scratch& scratch) {
  const int64_t D = kD > 0 ? kD : dim;
  const int64_t G = s.G;
  const int64_t lo = var.first_key(L), n = L - lo;
  scratch.prepare(G, n, D);
  float* sc = scratch.scores.data();
  float* ac = scratch.acc.data();
  float* inv = scratch.inv.data();
  // pass 1: scores
  for_each_row(kc, table, lo, L, h, s, D, [&](const KV* kr, int64_t t) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * widen(kr[d]);
      sc[g * n + t] = dot * scale;
    }
  });
  // pass 2: softmax numerators and their sums (a sink counts in the max and the sum, with no value)
  for (int64_t g = 0; g < G; ++g) {
    float* row = sc + g * n;
    if (var.softcap > 0.f) softcap_scores(row, n, var.softcap);
    float m = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, row[t]);
    const float* sink = var.sinks != nullptr ? var.sinks + h * G + g : nullptr;
    if (sink != nullptr) m = std::max(m, *sink);
    float sum = sink != nullptr ? exp_nonpos(*sink - m) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float e = exp_nonpos(row[t] - m);
      row[t] = e;
      sum += e;
    }
    inv[g] = 1.f / sum;
  }
  // pass 3: probability-weighted values
  for_each_row(vc, table, lo, L, h, s, D, [&](const KV* vr, int64_t t) {
    for (int64_t g = 0; g < G; ++g) {
      const float p = sc[g * n + t];
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
             int64_t B, const Shape& s, int64_t D, float scale, const Variant& var) {
  at::parallel_for(0, B * s.kvH, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / s.kvH, h = i % s.kvH;
      const int64_t head = h * s.G * D;
      float* o = op + b * s.out_row + head;
      const float* q = qp + b * s.q_row + head;
      if constexpr (kHasVectorPath<kD, KV>) {
        attend_one_vector<kD, KV>(o, q, kp, vp, bt + b * s.MB, cl[b], h, s, scale, var, scratch);
      } else {
        attend_one<kD, KV>(o, q, kp, vp, bt + b * s.MB, cl[b], h, s, D, scale, var, scratch);
      }
    }
  });
}

template <typename KV>
void dispatch_dim(float* op, const float* qp, const void* kp, const void* vp, const int64_t* bt, const int64_t* cl,
                  int64_t B, const Shape& s, int64_t D, float scale, const Variant& var) {
  const KV* k = static_cast<const KV*>(kp);
  const KV* v = static_cast<const KV*>(vp);
  if (D == 64) run_all<64, KV>(op, qp, k, v, bt, cl, B, s, D, scale, var);
  else if (D == 128) run_all<128, KV>(op, qp, k, v, bt, cl, B, s, D, scale, var);
  else run_all<0, KV>(op, qp, k, v, bt, cl, B, s, D, scale, var);
}

void paged_decode_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& context_lens, double scale, const Variant& var) {
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
    case torch::kFloat32: dispatch_dim<float>(op, qp, kp, vp, bt, cl, B, s, D, fs, var); break;
    case torch::kBFloat16: dispatch_dim<Bf16>(op, qp, kp, vp, bt, cl, B, s, D, fs, var); break;
    case torch::kFloat16: dispatch_dim<Half>(op, qp, kp, vp, bt, cl, B, s, D, fs, var); break;
    case torch::kFloat8_e4m3fn: dispatch_dim<Fp8>(op, qp, kp, vp, bt, cl, B, s, D, fs, var); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

}  // namespace

// out, q: [B, H, D] float32, each sequence's [H, D] contiguous (rows may be strided); k_cache, v_cache:
// [kvH, num_blocks, block_size, D] contiguous, float32, bfloat16, float16 or float8_e4m3fn;
// block_tables: [B, max_blocks] int64; context_lens: [B] int64 (>= 1).
// Query heads h*G..h*G+G-1 use KV head h. Plain causal attention over keys 0..context_lens[b]-1.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  paged_decode_impl(out, q, k_cache, v_cache, block_tables, context_lens, scale, Variant{});
}

// paged_decode for a layer's variant: window 0 (all keys) or the last `window` keys, whose blocks alone are read
// (table entries before them may name any block); softcap 0 or the soft-cap; sinks empty or float32 [H].
void paged_decode_variant(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window,
                          double softcap, torch::Tensor sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode_variant: window and softcap must be >= 0");
  Variant var{window, static_cast<float>(softcap), nullptr};
  if (sinks.numel() > 0) {
    TORCH_CHECK(sinks.scalar_type() == torch::kFloat32 && sinks.is_contiguous() && sinks.numel() == q.size(1),
                "paged_decode_variant: sinks must be float32 [heads], contiguous");
    var.sinks = sinks.data_ptr<float>();
  }
  paged_decode_impl(out, q, k_cache, v_cache, block_tables, context_lens, scale, var);
}

// How many threads paged_decode's parallel_for really runs on (tests compare it with torch's thread count).
// Why: ATen's parallel_for is inlined into this module, so built without OpenMP it silently runs on one
// thread; that went unnoticed for a while and halved decode attention speed on 2 cores.
int64_t parallel_width() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 4096, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63));
  });
  return __builtin_popcountll(seen.load());
}

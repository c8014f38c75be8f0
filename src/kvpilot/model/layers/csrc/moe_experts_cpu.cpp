// Mixture-of-experts experts on CPU for bfloat16 activations and weights (AVX512_BF16), for the few tokens of a
// decode step: every (token, expert) pair grouped by expert, each chosen expert's weight rows read once and
// dotted with each of its tokens, in two parallel regions a layer (gate/up with SiLU-and-mul, then down with the
// router weights), where one oneDNN GEMM pair per expert took two regions per expert: on a busy 2-vCPU machine
// each region's wake-up cost about as much as an expert's weights. Weights stay in their plain [E, 2I, H] and
// [E, H, I] layouts. Built at run time by kvpilot/model/layers/cpu_moe_kernel.py with -march=native; without
// AVX512_BF16 the module builds but `moe_kernel_available()` is false.
// Numerics, as the torch path rounds: the gate and up sums (float32) rounded to bf16, SiLU in float32 rounded to
// bf16, the product rounded to bf16; each down sum rounded to bf16, times its router weight (float32), added in
// float32 in increasing expert order; the output rounded to bf16 once.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16); NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

inline __m512bh load_bf16(const uint16_t* p, int64_t left) {
  if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << left) - 1), p);
}

// (x . a, x . b) over n values: two weight rows against one activation row, each x chunk loaded once.
inline void dot2(const uint16_t* x, const uint16_t* a, const uint16_t* b, int64_t n, float& da, float& db) {
  __m512 sa = _mm512_setzero_ps(), sb = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh xv = load_bf16(x + i, n - i);
    sa = _mm512_dpbf16_ps(sa, load_bf16(a + i, n - i), xv);
    sb = _mm512_dpbf16_ps(sb, load_bf16(b + i, n - i), xv);
  }
  da = _mm512_reduce_add_ps(sa);
  db = _mm512_reduce_add_ps(sb);
}

inline float dot(const uint16_t* x, const uint16_t* a, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {  // two chains: the adds of one do not wait on the other's
    s0 = _mm512_dpbf16_ps(s0, load_bf16(a + i, 32), load_bf16(x + i, 32));
    s1 = _mm512_dpbf16_ps(s1, load_bf16(a + i + 32, 32), load_bf16(x + i + 32, 32));
  }
  for (; i < n; i += 32) s0 = _mm512_dpbf16_ps(s0, load_bf16(a + i, n - i), load_bf16(x + i, n - i));
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

constexpr int64_t kRowBlock = 16;  // expert rows a task computes (gate/up and down alike)

// act[i, r] (i: a pair's place in the sorted order) = bf16(silu(bf16(gate . x)) * bf16(up . x)), r < I.
void gate_up_rows(const uint16_t* x, const uint16_t* w13, uint16_t* act, const std::vector<ExpertGroup>& groups,
                  const std::vector<int64_t>& order, int64_t top_k, int64_t H, int64_t I) {
  const int64_t blocks = (I + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, static_cast<int64_t>(groups.size()) * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const ExpertGroup& g = groups[task / blocks];
      const int64_t r0 = (task % blocks) * kRowBlock, r1 = std::min(I, r0 + kRowBlock);
      const uint16_t* w = w13 + g.expert * 2 * I * H;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = g.begin; i < g.end; ++i) {  // the expert's rows stay in L1 across its tokens
          float gs, us;
          dot2(x + (order[i] / top_k) * H, w + r * H, w + (I + r) * H, H, gs, us);
          const float gate = round_bf16(gs);
          const float silu = round_bf16(gate / (1.0f + std::exp(-gate)));
          act[i * I + r] = float_to_bf16(silu * round_bf16(us));
        }
      }
    }
  });
}

// out[t, h] = bf16(sum over t's pairs, experts increasing, of weight * bf16(act[pair] . down[e, h])).
void down_rows(const uint16_t* act, const uint16_t* w2, const float* weights, uint16_t* out,
               const std::vector<ExpertGroup>& groups, const std::vector<int64_t>& order, int64_t T, int64_t top_k,
               int64_t H, int64_t I) {
  at::parallel_for(0, (H + kRowBlock - 1) / kRowBlock, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(T * kRowBlock);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t h0 = b * kRowBlock, h1 = std::min(H, h0 + kRowBlock);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (const ExpertGroup& g : groups) {
        for (int64_t h = h0; h < h1; ++h) {
          const uint16_t* w = w2 + (g.expert * H + h) * I;
          for (int64_t i = g.begin; i < g.end; ++i) {
            const int64_t pair = order[i];
            acc[(pair / top_k) * kRowBlock + (h - h0)] += round_bf16(dot(act + i * I, w, I)) * weights[pair];
          }
        }
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = h0; h < h1; ++h) out[t * H + h] = float_to_bf16(acc[t * kRowBlock + (h - h0)]);
    }
  });
}
#else
constexpr bool kAvailable = false;
#endif

}  // namespace

// Whether this build runs moe_experts_bf16 (the CPU has AVX512_BF16).
bool moe_kernel_available() { return kAvailable; }

// [T, H] bf16: sum over j of weights[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t], for x [T, H] bf16, gate_up
// [E, 2I, H] bf16 (gate rows, then up rows), down [E, H, I] bf16 (all contiguous), weights float32 [T, k] and
// ids int64 [T, k] (contiguous).
torch::Tensor moe_experts_bf16(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down, torch::Tensor weights,
                               torch::Tensor ids) {
  TORCH_CHECK(kAvailable, "the MoE experts kernel needs AVX512_BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && gate_up.scalar_type() == torch::kBFloat16 &&
              down.scalar_type() == torch::kBFloat16, "bf16 activations and weights only");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && ids.scalar_type() == torch::kInt64, "weights, ids");
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && x.is_contiguous() &&
              gate_up.is_contiguous() && down.is_contiguous() && weights.is_contiguous() && ids.is_contiguous(),
              "contiguous x [T, H], gate_up [E, 2I, H], down [E, H, I]");
  const int64_t T = x.size(0), H = x.size(1), E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == H && down.size(0) == E && down.size(1) == H && down.size(2) == I &&
              ids.dim() == 2 && ids.size(0) == T && weights.sizes() == ids.sizes(), "shapes");
  auto out = torch::empty({T, H}, x.options());
#if defined(__AVX512BF16__)
  const int64_t top_k = ids.size(1);
  std::vector<int64_t> order;
  const std::vector<ExpertGroup> groups = group_by_expert(ids.data_ptr<int64_t>(), T * top_k, E, order);
  std::vector<uint16_t> act(T * top_k * I);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  gate_up_rows(xp, reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), act.data(), groups, order, top_k, H, I);
  down_rows(act.data(), reinterpret_cast<const uint16_t*>(down.data_ptr()), weights.data_ptr<float>(),
           reinterpret_cast<uint16_t*>(out.data_ptr()), groups, order, T, top_k, H, I);
#endif
  return out;
}

// Mixture-of-experts experts on packed GGUF blocks: a step's (token, expert) pairs grouped by expert, each chosen
// expert's gate, up and down projections computed from the column-tiled int8 copies of its blocks (quant_vnni_gemm.h
// for Q8_0 / Q4_0 / Q4_1, quant_tiled_kq.h for Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K; their AVX2 twins without VNNI) times
// int8-quantized activations, in two parallel regions a layer: gate and up of every group, then down with the router
// weights. A batch-1 decode reads only its top-k experts' tiles. Built after quant_tiled_set_cpu.cpp (TiledPart, tiled_part, Q8Rows, Q8View,
// part_rows, quantize_rows_q8, sums_of_16); kvpilot/model/quant/packed_experts.py holds the copies and calls it.
//
// The copies: one column-tiled copy per stacked GGUF tensor (ffn_gate_exps [E * I, H], ffn_up_exps [E * I, H],
// ffn_down_exps [E * H, I], rows expert after expert), so expert e's tiles are [e * I / 16, (e + 1) * I / 16) of gate
// and up and [e * H / 16, (e + 1) * H / 16) of down.
//
// Numerics: x rows quantized once (quantize_row_q8, as PackedLinear's int8 path); gate and up sums in float32,
// silu(gate) * up in float32 (no bf16 rounding between the projections), those rows quantized to int8 for down;
// each down sum (float32) times its router weight, added in float32 into its token's row in increasing expert
// order; the output rounded to x's dtype once.
#include <cmath>

namespace {

constexpr int64_t kMoeTileChunk = 8;  // weight tiles (128 output columns) a task computes

// silu(g) * u in float32; silu(g) = g / (1 + exp(-g)), written so that exp never overflows
inline float moe_silu_mul(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  return (g >= 0.0f ? g : g * e) / (1.0f + e) * u;
}

}  // namespace

// out [T, H] (x's dtype) = sum over j of weights[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t], for x [T, H] float32 or
// bfloat16 (contiguous), weights float32 [T, k] and ids int64 [T, k] (contiguous), and the experts' column-tiled
// copies `w`: 3 parts of 3 tensors each (as quant_matmul_tiled_set takes them) -- gate [E * I, H], up [E * I, H], down
// [E * H, I] -- in the formats `formats` (3 kernel codes).
torch::Tensor quant_moe_tiled(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> formats,
                              torch::Tensor weights, torch::Tensor ids, int64_t num_experts) {
  TORCH_CHECK(has_int8_tiles(), "needs AVX-512 VNNI or AVX2");
  TORCH_CHECK(w.size() == 9 && formats.size() == 3, "experts: gate, up and down, 3 tensors and a format each");
  int64_t KBh = 0, KBh_up = 0, KBi = 0;
  const TiledPart gate = tiled_part(w.data(), formats[0], KBh);
  const TiledPart up = tiled_part(w.data() + 3, formats[1], KBh_up);
  const TiledPart down = tiled_part(w.data() + 6, formats[2], KBi);
  const int64_t E = num_experts, H = KBh * kBlock, I = KBi * kBlock;
  TORCH_CHECK(E > 0 && KBh == KBh_up && gate.T == up.T && gate.T * 16 == E * I && down.T * 16 == E * H,
              "experts: gate and up [E * I, H], down [E * H, I] with I = down's width");
  TORCH_CHECK(float_or_bf16(x) && x.is_contiguous() && x.dim() == 2 && x.size(1) == H, "x: contiguous [T, ", H, "]");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && ids.scalar_type() == torch::kInt64 && ids.dim() == 2 &&
              ids.size(0) == x.size(0) && weights.sizes() == ids.sizes() && weights.is_contiguous() &&
              ids.is_contiguous(), "weights float32 and ids int64, contiguous [T, k]");
  const int64_t T = x.size(0), top_k = ids.size(1), P = T * top_k;
  const int64_t TI = I / 16, TH = H / 16;
  torch::Tensor out = torch::empty({T, H}, x.options());
  if (P == 0) return out;

  std::vector<int64_t> order;
  const std::vector<ExpertGroup> groups = group_by_expert(ids.data_ptr<int64_t>(), P, E, order);
  // x's int8 rows, one per pair in the sorted order (a group's rows contiguous)
  const Q8Rows xq = quantize_rows_q8(x, KBh);
  const bool q6_in = gate.fmt == kQ6_K || up.fmt == kQ6_K;
  const std::vector<int32_t> x32 = q6_in ? sums_of_16(xq, T, H) : std::vector<int32_t>();
  std::vector<int8_t> pq(P * H);
  std::vector<float> pd(P * KBh), ps(P * KBh);
  std::vector<int32_t> p32(q6_in ? P * (H / 16) : 0);
  for (int64_t i = 0; i < P; ++i) {
    const int64_t t = order[i] / top_k;
    std::memcpy(pq.data() + i * H, xq.q.data() + t * H, H);
    std::memcpy(pd.data() + i * KBh, xq.d.data() + t * KBh, KBh * sizeof(float));
    std::memcpy(ps.data() + i * KBh, xq.s.data() + t * KBh, KBh * sizeof(float));
    if (q6_in) std::memcpy(p32.data() + i * (H / 16), x32.data() + t * (H / 16), (H / 16) * sizeof(int32_t));
  }

  // gate and up: per group, chunks of each part's tiles into float32 [P, I] rows; then silu(gate) * up
  std::vector<float> g(P * I), u(P * I);
  const int64_t chunks = (TI + kMoeTileChunk - 1) / kMoeTileChunk;
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  at::parallel_for(0, num_groups * 2 * chunks, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t task = a0; task < a1; ++task) {
      const ExpertGroup& grp = groups[task / (2 * chunks)];
      const bool is_up = (task / chunks) % 2 == 1;
      const int64_t c = task % chunks, c0 = c * kMoeTileChunk, c1 = std::min(TI, c0 + kMoeTileChunk);
      const Q8View rows{pq.data() + grp.begin * H, pd.data() + grp.begin * KBh, ps.data() + grp.begin * KBh,
                        q6_in ? p32.data() + grp.begin * (H / 16) : nullptr};
      float* dst = (is_up ? u.data() : g.data()) + grp.begin * I + c0 * 16;
      part_rows(is_up ? up : gate, KBh, grp.expert * TI + c0, grp.expert * TI + c1, rows, grp.end - grp.begin, dst,
                nullptr, I);
    }
  });
  // the activations' int8 rows for down
  const bool q6_down = down.fmt == kQ6_K;
  Q8Rows aq{std::vector<int8_t>(P * I), std::vector<float>(P * KBi), std::vector<float>(P * KBi)};
  std::vector<int32_t> a32(q6_down ? P * (I / 16) : 0);
  at::parallel_for(0, P, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> act(I);
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t r = 0; r < I; ++r) act[r] = moe_silu_mul(g[i * I + r], u[i * I + r]);
      quantize_row_q8_here()(act.data(), KBi, aq.q.data() + i * I, aq.d.data() + i * KBi, aq.s.data() + i * KBi);
      for (int64_t c = 0; q6_down && c < I / 16; ++c) {
        int32_t sum = 0;
        for (int v = 0; v < 16; ++v) sum += aq.q[i * I + c * 16 + v];
        a32[i * (I / 16) + c] = 32 * sum;
      }
    }
  });

  // down: per chunk of H's tiles, every group in increasing expert order, each result row times its router weight
  // added into its token's float32 row
  int64_t most = 0;
  for (const ExpertGroup& grp : groups) most = std::max(most, grp.end - grp.begin);
  const float* wp = weights.data_ptr<float>();
  const bool bf16_out = out.scalar_type() == torch::kBFloat16;
  // chunks of 2 to 8 tiles: at least ~4 a thread where H allows (many threads, one region), pairs of tiles kept
  const int64_t chunk = std::max<int64_t>(2, std::min<int64_t>(kMoeTileChunk, TH / (4 * at::get_num_threads())));
  const int64_t down_chunks = (TH + chunk - 1) / chunk;
  at::parallel_for(0, down_chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(T * chunk * 16), part(most * chunk * 16);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t h0 = c * chunk, h1 = std::min(TH, h0 + chunk), width = (h1 - h0) * 16;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (const ExpertGroup& grp : groups) {
        const int64_t n = grp.end - grp.begin;
        const Q8View rows{aq.q.data() + grp.begin * I, aq.d.data() + grp.begin * KBi, aq.s.data() + grp.begin * KBi,
                          q6_down ? a32.data() + grp.begin * (I / 16) : nullptr};
        part_rows(down, KBi, grp.expert * TH + h0, grp.expert * TH + h1, rows, n, part.data(), nullptr, width);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pair = order[grp.begin + i];
          const float weight = wp[pair];
          float* dst = acc.data() + (pair / top_k) * width;
          const float* src = part.data() + i * width;
          for (int64_t col = 0; col < width; ++col) dst[col] += weight * src[col];
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        if (bf16_out)
          (has_vnni() ? to_bf16_512 : to_bf16_scalar)(
              acc.data() + t * width, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * H + h0 * 16, width);
        else
          std::memcpy(out.data_ptr<float>() + t * H + h0 * 16, acc.data() + t * width, width * sizeof(float));
      }
    }
  });
  return out;
}

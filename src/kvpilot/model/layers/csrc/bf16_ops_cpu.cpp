// The decoder's small per-token ops on bfloat16 activations on CPU (RMSNorm, rotary embedding), built at run
// time by kvpilot/model/layers/cpu_bf16_ops.py. Each replaces several torch ops, each a dispatch that costs
// more than the row's arithmetic: a decode step of a bf16 model ran ~550 dtype conversions and ~500 small ops.
//
// rms_norm_bf16: the same arithmetic as the torch ops of kvpilot.model.layers.norm.RMSNorm (HF's order): x widened
// to float32, x * 1/sqrt(sum(x^2) / K + eps), rounded to bfloat16, times the bfloat16 weight with the product
// rounded to bfloat16. One call instead of eight torch ops (two of them dtype conversions), each a dispatch
// that costs more than the row's arithmetic: a decode step of a bf16 model runs 61 norms. Built without
// -ffast-math: the sum is divided by K as torch's mean does, not multiplied by 1/K. The sum's order differs
// from torch's vectorised reduction, so a value can land one float32 ulp apart before the bf16 rounding.
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The fused decode kernel (decode_layers_cpu.cpp) compiles this file inside a -ffast-math translation unit:
// keep the sum in order and the division a division there too (a no-op in this module's own build).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// round to nearest even, as torch's float -> bfloat16 (NaN stays a quiet NaN)
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t K, float eps, float* widened) {
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    widened[k] = bf16_to_float(x[k]);
    sum += widened[k] * widened[k];
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
  for (int64_t k = 0; k < K; ++k) {
    const float normed = bf16_to_float(float_to_bf16(widened[k] * inv));
    out[k] = float_to_bf16(bf16_to_float(w[k]) * normed);
  }
}

void add_row(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t K) {
  for (int64_t k = 0; k < K; ++k) out[k] = float_to_bf16(bf16_to_float(a[k]) + bf16_to_float(b[k]));
}

// out = bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) as torch writes it
void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t I) {
  for (int64_t i = 0; i < I; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float act = bf16_to_float(float_to_bf16(g / (1.0f + std::exp(-g))));
    out[i] = float_to_bf16(act * bf16_to_float(up[i]));
  }
}

// Which vector rows this CPU runs (bf16_ops_avx512.h's, bf16_ops_avx2.h's), or none: the scalar rows above
enum class VectorRows { kNone, kAvx2, kAvx512 };

VectorRows vector_rows() {
  return bf16_avx512() ? VectorRows::kAvx512 : bf16_avx2() ? VectorRows::kAvx2 : VectorRows::kNone;
}

}  // namespace

// out [..., K] bfloat16 = RMSNorm(x [..., K] bfloat16, contiguous) with weight [K] bfloat16.
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16,
              "rms_norm_bf16: x and weight must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.numel(),
              "rms_norm_bf16: contiguous x [..., K] and weight [K]");
  torch::Tensor out = torch::empty_like(x);
  const int64_t K = weight.numel();
  const int64_t rows = K == 0 ? 0 : x.numel() / K;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float e = static_cast<float>(eps);
  // a few hundred ns a row: threads only for prefill-sized batches
  const VectorRows rows_isa = K % 16 == 0 ? vector_rows() : VectorRows::kNone;
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    if (rows_isa != VectorRows::kNone) {
      const auto row = rows_isa == VectorRows::kAvx512 ? norm_row512 : norm_row256;
      for (int64_t r = r0; r < r1; ++r) row(xp + r * K, wp, op + r * K, K, e);
      return;
    }
    std::vector<float> widened(K);
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * K, wp, op + r * K, K, e, widened.data());
  });
  return out;
}

// (total, out) [..., K] bfloat16, new: total = x + residual (each float32 sum rounded to bfloat16, as torch adds
// bf16 tensors), out = rms_norm_bf16(total). A decoder layer's residual add and the norm after it in one pass,
// bit for bit the two calls (the row's sum is normed while in cache).
std::vector<torch::Tensor> add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                             double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && residual.scalar_type() == torch::kBFloat16 &&
              weight.scalar_type() == torch::kBFloat16, "add_rms_norm_bf16: x, residual and weight must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() && x.dim() >= 1 &&
              x.sizes() == residual.sizes() && x.size(-1) == weight.numel(),
              "add_rms_norm_bf16: contiguous x and residual [..., K] of one shape, weight [K]");
  torch::Tensor total = torch::empty_like(x);
  torch::Tensor out = torch::empty_like(x);
  const int64_t K = weight.numel();
  const int64_t rows = K == 0 ? 0 : x.numel() / K;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* rp = reinterpret_cast<const uint16_t*>(residual.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* tp = reinterpret_cast<uint16_t*>(total.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float e = static_cast<float>(eps);
  const VectorRows rows_isa = K % 16 == 0 ? vector_rows() : VectorRows::kNone;
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> widened(rows_isa == VectorRows::kNone ? K : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t at = r * K;
      if (rows_isa == VectorRows::kAvx512) {
        add_row512(xp + at, rp + at, tp + at, K);
        norm_row512(tp + at, wp, op + at, K, e);
      } else if (rows_isa == VectorRows::kAvx2) {
        add_row256(xp + at, rp + at, tp + at, K);
        norm_row256(tp + at, wp, op + at, K, e);
      } else {
        add_row(xp + at, rp + at, tp + at, K);
        norm_row(tp + at, wp, op + at, K, e, widened.data());
      }
    }
  });
  return {total, out};
}

// out [T, H, D] bfloat16 (new, contiguous) = x * cos + rotate_half(x) * sin for x [T, H, D] bfloat16 with unit
// stride in D (rows may be strided: q and k are a slice of the fused qkv projection) and cos / sin [T, 1, D]
// bfloat16 contiguous. Bit for bit the torch ops of rope.apply_rotary: rotate_half(x) = cat(-x[D/2:], x[:D/2]),
// and each product and the sum rounded to bfloat16 as torch rounds them.
torch::Tensor rope_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && cos.scalar_type() == torch::kBFloat16 &&
              sin.scalar_type() == torch::kBFloat16, "rope_bf16: bfloat16 x, cos and sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope_bf16: x [T, H, D], unit stride in D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rope_bf16: contiguous cos and sin [T, 1, D]");
  torch::Tensor out = torch::empty({T, H, D}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const VectorRows rows_isa = D % 32 == 0 ? vector_rows() : VectorRows::kNone;
  const auto vector_row = rows_isa == VectorRows::kAvx512 ? rope_row512 : rope_row256;
  at::parallel_for(0, T * H, std::max<int64_t>(1, 65536 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / H, h = r % H;
      const uint16_t* xr = xp + t * s0 + h * s1;
      const uint16_t* c = cp + t * D;
      const uint16_t* s = sp + t * D;
      uint16_t* o = op + r * D;
      if (rows_isa != VectorRows::kNone) {
        vector_row(xr, c, s, o, D);
        continue;
      }
      for (int64_t j = 0; j < D; ++j) {
        const float xj = bf16_to_float(xr[j]);
        const float rot = j < half ? -bf16_to_float(xr[j + half]) : bf16_to_float(xr[j - half]);
        const float a = bf16_to_float(float_to_bf16(xj * bf16_to_float(c[j])));
        const float b = bf16_to_float(float_to_bf16(rot * bf16_to_float(s[j])));
        o[j] = float_to_bf16(a + b);
      }
    }
  });
  return out;
}

// out [T, I] bfloat16 = silu(gate) * up for gate_up [T, 2I] bfloat16 (the fused gate/up projection, rows may be
// strided, unit stride within a row): MLP's `F.silu(gate).mul_(up)` in one pass. silu is computed in float32 and
// rounded to bfloat16, then the product rounded, as torch rounds; the AVX-512 rows' exp is simd_exp.h's polynomial
// (torch's differs in the last float32 bits, so a value can land one bf16 step apart from torch's).
torch::Tensor silu_mul_bf16(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
              gate_up.size(1) % 2 == 0, "silu_mul_bf16: gate_up [T, 2I] bfloat16, unit stride in a row");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  torch::Tensor out = torch::empty({T, I}, gate_up.options().memory_format(torch::MemoryFormat::Contiguous));
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const VectorRows rows_isa = I % 16 == 0 ? vector_rows() : VectorRows::kNone;
  const auto vector_row = rows_isa == VectorRows::kAvx512 ? silu_mul_row512 : silu_mul_row256;
  at::parallel_for(0, T, std::max<int64_t>(1, 32768 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* g = gp + r * ld;
      if (rows_isa != VectorRows::kNone) {
        vector_row(g, g + I, op + r * I, I);
      } else {
        silu_mul_row(g, g + I, op + r * I, I);
      }
    }
  });
  return out;
}

// Whether bf16_linear runs on this CPU (AVX512_BF16).
bool has_bf16_gemm() { return bf16_gemm_avx512(); }

// The checks both GEMM entry points make of out [M, N] (contiguous, float32 or bfloat16) and bias ([N] bfloat16,
// optional); returns bias's values, or nullptr without one. `name` prefixes the messages.
const uint16_t* checked_out_and_bias(const char* name, const torch::Tensor& out, int64_t M, int64_t N,
                                     const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
              (out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16),
              name, ": out [M, N] contiguous, float32 or bfloat16");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
              name, ": bias [N] bfloat16");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
}

// out [M, N] (float32 or bfloat16, contiguous) = x [M, K] . w [N, K]^T (+ bias [N]), x, w and bias bfloat16, x's rows
// and w contiguous: bf16_gemm_avx512.h's kernel, float32 sums rounded once to out's dtype. Threads split the 4-row
// blocks of w; each output's sum is the same whatever M and the threads (the header's invariant).
void bf16_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& w,
                 const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(bf16_gemm_avx512(), "bf16_linear: this CPU has no AVX512_BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
              w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: bfloat16 x [M, K] and w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const uint16_t* bias_p = checked_out_and_bias("bf16_linear", out, M, N, bias);
  if (M == 0 || N == 0) return;
  const GemmOut o{out.data_ptr(), out.scalar_type() == torch::kBFloat16, bias_p, N};
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t num_blocks = (N + kGemmRows - 1) / kGemmRows;
  // ~64 KiB of weights a task at least: below that a thread's start costs more than its share
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kGemmRows * K * 2));
  at::parallel_for(0, num_blocks, grain, [&](int64_t b0, int64_t b1) { bf16_gemm_blocks(xp, M, wp, K, o, b0, b1); });
}

#pragma GCC pop_options

// Whether amx_linear_f32 runs here (AMX-BF16, and Linux granted the tile state).
bool has_amx_bf16() { return amx_bf16_usable(); }

// out [M, N] (float32 or bfloat16, contiguous) = x [M, K] . W [N, K]^T (+ bias [N] bfloat16), x bfloat16 with
// contiguous rows, W packed for tiles by layers/amx_tiles.py: `packed` [N / 16, Kp / 32, 16, 32] bfloat16, Kp >= K a
// multiple of 32, N a multiple of 32. bf16_gemm_amx.h's kernel: exact products, float32 sums rounded once to out's
// dtype, the same for a row whatever M and the threads.
void amx_linear(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& packed,
                const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_bf16_usable(), "amx_linear: this CPU (or process) cannot use AMX-BF16 tiles");
#if defined(__x86_64__)
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "amx_linear: contiguous bfloat16 x [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
              packed.size(2) == 16 && packed.size(3) == 32 && packed.size(0) % 2 == 0,
              "amx_linear: packed [N / 16, Kp / 32, 16, 32] bfloat16 from layers/amx_tiles.py, N a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16, Kp = packed.size(1) * 32;
  TORCH_CHECK(K <= Kp, "amx_linear: x has ", K, " columns, the packed weight ", Kp);
  const uint16_t* bias_p = checked_out_and_bias("amx_linear", out, M, N, bias);
  if (M == 0) return;
  torch::Tensor rows = x;
  if (Kp != K) {  // the tiles read whole 32-value steps: zeros beyond K
    rows = x.new_zeros({M, Kp});
    rows.narrow(1, 0, K).copy_(x);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t element = out.scalar_type() == torch::kBFloat16 ? 2 : 4;
  // ~64 KiB of weights a task at least, as bf16_linear
  const int64_t grain = std::max<int64_t>(1, 65536 / (kAmxBlockCols * Kp * 2));
  // rows in chunks of kAmxChunkRows, each over all columns: more rows a pass ran slower than two passes
  for (int64_t r0 = 0; r0 < M; r0 += kAmxChunkRows) {
    const int64_t rows_here = std::min(kAmxChunkRows, M - r0);
    const GemmOut o{static_cast<char*>(out.data_ptr()) + r0 * N * element, element == 2, bias_p, N};
    at::parallel_for(0, N / kAmxBlockCols, grain, [&](int64_t b0, int64_t b1) {
      amx_gemm_blocks(xp + r0 * Kp, rows_here, Kp, wp, o, b0, b1);
    });
  }
#endif
}


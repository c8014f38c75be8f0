// Every decoder layer of a few-token, decode-only step in one call (CPU, bfloat16 or float32 activations with K/V
// of the same dtype, packed GGUF weights or a dense bf16 model's oneDNN-prepacked ones): built at run time by kvpilot/model/fused_decode.py after the
// quantized-linear, decode attention and bf16-ops sources, whose functions it calls.
//
// Why: at batch 1 the embedded model's step took ~10 ms, of which ~4 ms was Python and torch dispatch between
// the kernels (some 15 ops and 8 module calls per layer, 30 layers). Here the same kernels run back to back.
// Invariant: each piece is the function or torch op the module path (kvpilot.model.models.llama with PackedLinear,
// the cpu attention backend, RMSNorm and the rotary embedding) runs, on the same values in the same order, so the
// hidden states are bit for bit the module path's (tests/model/test_fused_decode.py). In float32 the module path's
// norms, rotations and SiLU are torch ops: the same ATen ops run here (what this saves is the Python around them).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/silu.h>

namespace {

// A projection part held as a oneDNN-prepacked bf16 weight (a dense bf16 model's OneDnnLinear): one tensor, run by
// the op OneDnnWeight.linear calls, so the product is the module path's bit for bit
constexpr int64_t kOneDnnBf16 = 100;
// A part held as a plain bf16 weight [N, K] (a dense bf16 model's Bf16Linear, AVX512_BF16): bf16_linear's kernel, as
// Bf16Linear runs it up to its KERNEL_MAX_ROWS (fused steps stay within it)
constexpr int64_t kPlainBf16 = 101;
// A part held as a copy packed for AMX tiles (a dense bf16 model's Bf16Linear on an AMX CPU): amx_linear, as
// Bf16Linear runs it from its TILES_MIN_ROWS
constexpr int64_t kTilesBf16 = 102;

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x.contiguous(), packed, c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Per layer: in_norm, qkv, o, post_norm, gate_up, down. A projection is one or more parts (a fused projection's parts
// of different formats stay apart), each 3 tensors: (qs, d, m) of the packed blocks for the float32 kernel, or the
// int8 path's copy: (tq, td, to | ts) column-tiled or (vq, vd, vo) interleaved (one part); or, for a dense bf16
// model, one part (the oneDNN-prepacked weight or the plain one, then two unused tensors) of code kOneDnnBf16 or
// kPlainBf16.
constexpr int64_t kProjections = 4;  // qkv, o, gate_up, down

struct Projection {
  const torch::Tensor* w;  // 3 * parts tensors
  const int64_t* formats;  // parts codes
  int64_t parts;
};

struct LayerWeights {
  const torch::Tensor* in_norm;
  const torch::Tensor* post_norm;
  Projection proj[kProjections];
};

// The layers' weights from the flat lists: per layer, `formats` holds for each projection its part count, then the
// parts' codes; `weights` the input norm, qkv's and o's parts, the post-attention norm, gate_up's and down's parts.
std::vector<LayerWeights> layer_weights(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& formats,
                                        int64_t L) {
  std::vector<LayerWeights> layers(L);
  size_t w = 0, f = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t p = 0; p < kProjections; ++p) {
      if (p == 0 || p == 2) {
        TORCH_CHECK(w < weights.size(), "decode_layers: weights end early");
        (p == 0 ? layers[l].in_norm : layers[l].post_norm) = &weights[w++];
      }
      TORCH_CHECK(f < formats.size() && formats[f] >= 1, "decode_layers: formats end early or a part count < 1");
      const int64_t parts = formats[f++];
      TORCH_CHECK(f + parts <= formats.size() && w + 3 * parts <= weights.size(),
                  "decode_layers: lists end early");
      layers[l].proj[p] = {&weights[w], &formats[f], parts};
      w += 3 * parts;
      f += parts;
    }
  }
  TORCH_CHECK(w == weights.size() && f == formats.size(), "decode_layers: ", L, " layers do not use every weight");
  return layers;
}

// Output columns of a projection: the tiled parts' 16 rows a tile, interleaved vd's rows, the float32 kernel's
// parts' rows (kept GGUF blocks: qs's rows; split formats: d's)
int64_t projection_rows(const Projection& p, bool tiled) {
  int64_t rows = 0;
  for (int64_t i = 0; i < p.parts; ++i) {
    const torch::Tensor* w = p.w + 3 * i;
    rows += tiled ? w[1].size(0) * 16 : kept_as_blocks(p.formats[i]) ? w[0].size(0) : w[1].size(0);
  }
  return rows;
}

// PackedLinear._kernel_rows for bf16 or float32 rows (out in x's dtype): int8 activations (VNNI: the column-tiled copies, one split-format part's
// by quant_matmul_tiled, others as a set; or one interleaved part) or the float32 kernel, part by part.
torch::Tensor linear_rows(const torch::Tensor& x, const Projection& p, bool int8, int64_t isa) {
  const torch::Tensor* w = p.w;
  if (p.formats[0] == kOneDnnBf16) {
    TORCH_CHECK(p.parts == 1, "a oneDNN bf16 projection is one part");
    return onednn_linear(x, w[0]);
  }
  if (p.formats[0] == kTilesBf16) {
    TORCH_CHECK(p.parts == 1, "a tile-packed bf16 projection is one part");
    torch::Tensor out = torch::empty({x.size(0), w[0].size(0) * 16}, x.options());
    amx_linear(out, x.contiguous(), w[0], std::nullopt);
    return out;
  }
  if (p.formats[0] == kPlainBf16) {
    TORCH_CHECK(p.parts == 1, "a plain bf16 projection is one part");
    torch::Tensor out = torch::empty({x.size(0), w[0].size(0)}, x.options());
    bf16_linear(out, x.contiguous(), w[0], std::nullopt);
    return out;
  }
  const bool tiled = int8 && w[1].dim() == 3;  // the column-tiled copies: td [N / 16, groups, width]
  torch::Tensor out = torch::empty({x.size(0), projection_rows(p, tiled)}, x.options());
  if (tiled && p.parts == 1 && !kept_as_blocks(p.formats[0])) {
    quant_matmul_tiled(out, x, w[0], w[1], w[2]);
  } else if (tiled) {
    quant_matmul_tiled_set(out, x, std::vector<torch::Tensor>(w, w + 3 * p.parts),
                           std::vector<int64_t>(p.formats, p.formats + p.parts));
  } else if (int8) {
    TORCH_CHECK(p.parts == 1, "the interleaved int8 copy takes one part");
    quant_matmul_interleaved(out, x, w[0], w[1], w[2], p.formats[0] == kQ8_0);
  } else {
    int64_t column = 0;
    for (int64_t i = 0; i < p.parts; ++i) {
      const torch::Tensor* part = w + 3 * i;
      const int64_t rows = kept_as_blocks(p.formats[i]) ? part[0].size(0) : part[1].size(0);
      quant_matmul(out.narrow(1, column, rows), x, part[0], part[1], part[2], p.formats[i], isa);
      column += rows;
    }
  }
  return out;
}

// write_kv: row t of k (rotated) and v into cache slot slots[t], for every KV head (same dtype: a plain copy).
void write_kv(torch::Tensor& cache, const torch::Tensor& k, const torch::Tensor& v, const int64_t* slots) {
  const int64_t T = k.size(0), kvH = k.size(1), D = k.size(2), bytes = cache.element_size();
  const int64_t slots_per_head = cache.size(2) * cache.size(3);
  auto* base = static_cast<char*>(cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < kvH; ++h) {
      const int64_t row = h * slots_per_head + slots[t];
      std::memcpy(base + row * D * bytes, kp + (t * k.stride(0) + h * k.stride(1)) * bytes, D * bytes);
      std::memcpy(base + (kvH * slots_per_head + row) * D * bytes, vp + (t * v.stride(0) + h * v.stride(1)) * bytes,
                  D * bytes);
    }
}

// The first values of n that the vector rows take: whole 16-lane (AVX-512) or 8-lane (AVX2) groups
int64_t vector_prefix(VectorRows rows_isa, int64_t n) {
  return rows_isa == VectorRows::kAvx512 ? n - n % 16 : rows_isa == VectorRows::kAvx2 ? n - n % 8 : 0;
}

// n values widened to float32 / rounded to bfloat16 (nearest even, as Tensor.copy_ rounds): 16 lanes at a time where
// the CPU has AVX-512, 8 with AVX2 (the scalar loops, with a tensor's stride read per value, took ~48 us a layer at
// batch 64)
void widen_row(const uint16_t* in, float* out, int64_t n) {
  const VectorRows rows_isa = vector_rows();
  const int64_t done = vector_prefix(rows_isa, n);
  if (rows_isa == VectorRows::kAvx512) widen_row512(in, out, done);
  if (rows_isa == VectorRows::kAvx2) widen_row256(in, out, done);
  for (int64_t i = done; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void narrow_row(const float* in, uint16_t* out, int64_t n) {
  const VectorRows rows_isa = vector_rows();
  const int64_t done = vector_prefix(rows_isa, n);
  if (rows_isa == VectorRows::kAvx512) narrow_row512(in, out, done);
  if (rows_isa == VectorRows::kAvx2) narrow_row256(in, out, done);
  for (int64_t i = done; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

// decode_kernel: queries widened to float32, the kernel, the output rounded to bf16 (as Tensor.copy_ rounds).
torch::Tensor attention_bf16(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                             const torch::Tensor& context_lens, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), ldq = q.stride(0);
  torch::Tensor qf = torch::empty({T, H, D}, q.options().dtype(torch::kFloat32));
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  float* qfp = qf.data_ptr<float>();
  // both conversions split by rows over the threads
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) widen_row(qp + t * ldq, qfp + t * H * D, H * D);
  });
  torch::Tensor target = torch::empty_like(qf);
  paged_decode(target, qf, cache.select(0, 0), cache.select(0, 1), block_tables, context_lens, scale);
  torch::Tensor out = torch::empty({T, H * D}, q.options());
  const float* tp = target.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    narrow_row(tp + t0 * H * D, op + t0 * H * D, (t1 - t0) * H * D);
  });
  return out;
}

// RMSNorm.reference in float32: its torch ops in its order (x.float() and .to(dtype) are no-ops there).
torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor weight, double eps) {
  return weight.mul(x.mul(x.pow(2).mean(-1, true).add(eps).rsqrt()));
}

// rope.rotary_reference: x * cos + cat(-x[D/2:], x[:D/2]) * sin
torch::Tensor rope_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor rotated = at::cat({x.slice(-1, half).neg(), x.slice(-1, 0, half)}, -1);
  return x.mul(cos).add(rotated.mul(sin));
}

// The cpu backend's decode for float32 queries: the kernel writes straight into the output (no widening).
torch::Tensor attention_f32(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  torch::Tensor out = torch::empty({T, H, D}, q.options());
  paged_decode(out, q, cache.select(0, 0), cache.select(0, 1), block_tables, context_lens, scale);
  return out.view({T, H * D});
}

// MLP's F.silu(gate).mul_(up) on the fused gate/up rows
torch::Tensor silu_mul_f32(torch::Tensor gate_up) {
  const int64_t I = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, I)).mul_(gate_up.narrow(1, I, I));
}

// The small ops between the matmuls, as the modules run them in one activation dtype.
struct SmallOps {
  torch::Tensor (*norm)(torch::Tensor, torch::Tensor, double);
  torch::Tensor (*rope)(torch::Tensor, torch::Tensor, torch::Tensor);
  torch::Tensor (*attention)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                             double);
  torch::Tensor (*silu_mul)(torch::Tensor);
};

const SmallOps kBf16Ops{rms_norm_bf16, rope_bf16, attention_bf16, silu_mul_bf16};
const SmallOps kFloat32Ops{rms_norm_f32, rope_f32, attention_f32, silu_mul_f32};

// DecoderLayer.forward for one layer.
torch::Tensor layer(const SmallOps& ops, const torch::Tensor& x, const LayerWeights& lw, const torch::Tensor& cos,
                    const torch::Tensor& sin, torch::Tensor& cache, const int64_t* slots,
                    const torch::Tensor& block_tables, const torch::Tensor& context_lens, int64_t H, int64_t kvH,
                    double eps, double scale, bool int8, int64_t isa) {
  const int64_t D = cos.size(-1), T = x.size(0);
  // attention
  const torch::Tensor qkv = linear_rows(ops.norm(x, *lw.in_norm, eps), lw.proj[0], int8, isa);
  const torch::Tensor rotated = ops.rope(qkv.narrow(1, 0, (H + kvH) * D).view({T, H + kvH, D}), cos, sin);
  const torch::Tensor v = qkv.narrow(1, (H + kvH) * D, kvH * D).view({T, kvH, D});
  write_kv(cache, rotated.narrow(1, H, kvH), v, slots);
  const torch::Tensor attended = ops.attention(rotated.narrow(1, 0, H), cache, block_tables, context_lens, scale);
  const torch::Tensor h = at::add(x, linear_rows(attended, lw.proj[1], int8, isa));
  // MLP
  const torch::Tensor gate_up = linear_rows(ops.norm(h, *lw.post_norm, eps), lw.proj[2], int8, isa);
  return at::add(h, linear_rows(ops.silu_mul(gate_up), lw.proj[3], int8, isa));
}

}  // namespace

// x [T, hidden] bfloat16 or float32 contiguous: the embedded tokens of T decoding sequences, row t = sequence t;
// cos/sin [T, 1, D] contiguous, norm weights and K/V caches all in x's dtype; weights and formats: per layer as
// layer_weights() reads them (packed parts as PackedWeight holds them, m empty unless Q4_1, or the int8 path's
// copies); kv_caches: one [2, kvH, blocks, block_size, D] tensor per layer; slot_mapping [T], block_tables
// [T, max_blocks] and context_lens [T] int64. Returns the hidden states after the last layer (before the final norm).
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> weights,
                            std::vector<int64_t> formats, std::vector<torch::Tensor> kv_caches,
                            torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                            int64_t num_heads, int64_t num_kv_heads, double eps, double scale, bool int8,
                            int64_t isa) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  const std::vector<LayerWeights> layers = layer_weights(weights, formats, L);
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kBFloat16 || dtype == torch::kFloat32) && x.is_contiguous() && x.dim() == 2,
              "x: [T, hidden] bf16 or float32");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "cos, sin: x's dtype");
  for (const LayerWeights& lw : layers)
    TORCH_CHECK(lw.in_norm->scalar_type() == dtype && lw.post_norm->scalar_type() == dtype, "norm weights: x's dtype");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == torch::kInt64 &&
              slot_mapping.numel() == x.size(0), "slot_mapping: [T] int64");
  for (const torch::Tensor& cache : kv_caches)
    TORCH_CHECK(cache.scalar_type() == dtype && cache.is_contiguous() && cache.dim() == 5,
                "kv caches: [2, kvH, blocks, block_size, D] in x's dtype, contiguous");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const SmallOps& ops = dtype == torch::kFloat32 ? kFloat32Ops : kBf16Ops;
  for (int64_t l = 0; l < L; ++l)
    x = layer(ops, x, layers[l], cos, sin, kv_caches[l], slots, block_tables, context_lens, num_heads, num_kv_heads,
              eps, scale, int8, isa);
  return x;
}

// Linear layers on packed GGUF-style weights (Q8_0, Q4_0, Q4_1 split; Q5_0, Q5_1, Q4_K, Q5_K, Q6_K as GGUF blocks)
// on CPU, built at run time by kvpilot/model/quant/kernel.py after quant_common.h, quant_blocks.h, quant_avx512.h,
// quant_avx2.h and quant_blocks_avx2.h.
//
// quant_matmul: out[M, N] = x[M, K] @ W^T. Each task dequantizes 4 weight rows into an L1-resident float32
// buffer once, then multiplies them with tiles of up to 4 x rows (64 x rows at a time, so the x block stays
// in L2): each packed byte is read from memory once per 64 x rows, and for decode (a few rows) exactly once.
// quant_dequantize: the whole matrix as float32 or bfloat16 (for a large-batch GEMM in torch).
namespace {

int64_t detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kScalar;
}

Kernels kernels_for(int64_t isa) {
  const int64_t best = detect_isa();
  TORCH_CHECK(isa <= best, "quant kernel: ISA level ", isa, " asked for, this CPU supports up to ", best);
  if (isa == kAvx512) return {dequant_row512, to_bf16_512, tile512, fused512, 4};
  if (isa == kAvx2) return {dequant_row256, to_bf16_scalar, tile256, nullptr, 2};
  return {dequant_row_scalar, to_bf16_scalar, tile_scalar, nullptr, 4};
}

// The kernels for format fmt: formats kept as blocks dequantize rows with quant_blocks.h or its AVX2 copy (no fused
// few-row path)
Kernels kernels_for(int64_t isa, int64_t fmt) {
  Kernels kern = kernels_for(isa);
  if (kept_as_blocks(fmt)) {
    kern.dequant_row = isa >= kAvx2 ? dequant_row_blocks256 : dequant_row_blocks;
    kern.fused = nullptr;
  }
  return kern;
}

// A format kept as GGUF blocks (quant_blocks.h): qs uint8 [N, row bytes], its shape given by the caller's x / out
Packed packed_blocks(const torch::Tensor& qs, int64_t fmt, int64_t N, int64_t K) {
  TORCH_CHECK(K % gguf_block_values(fmt) == 0, "quant kernel: K = ", K, " is not a whole number of blocks");
  TORCH_CHECK(qs.is_contiguous() && qs.scalar_type() == torch::kUInt8, "quant kernel: qs uint8, contiguous");
  Packed w{qs.data_ptr<uint8_t>(), nullptr, nullptr, N, K, K / kBlock, fmt};
  TORCH_CHECK(qs.numel() == N * w.qs_row(), "quant kernel: qs holds ", qs.numel(), " bytes, expected ",
              N * w.qs_row());
  return w;
}

// Split formats take their shape from d; the others (kept as blocks) from N and K
Packed packed_of(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m, int64_t fmt, int64_t N_in,
                 int64_t K_in) {
  if (kept_as_blocks(fmt)) return packed_blocks(qs, fmt, N_in, K_in);
  TORCH_CHECK(fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1, "quant kernel: unknown format ", fmt);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && qs.scalar_type() == torch::kUInt8 &&
              d.scalar_type() == torch::kFloat16 && d.dim() == 2, "quant kernel: qs uint8 / d float16, contiguous");
  const int64_t N = d.size(0), KB = d.size(1);
  Packed w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), nullptr,
           N, KB * kBlock, KB, fmt};
  TORCH_CHECK(qs.numel() == N * w.qs_row(), "quant kernel: qs holds ", qs.numel(), " bytes, expected ",
              N * w.qs_row());
  if (fmt == kQ4_1) {
    TORCH_CHECK(m.is_contiguous() && m.scalar_type() == torch::kFloat16 && m.sizes() == d.sizes(),
                "quant kernel: Q4_1 needs m float16 shaped like d");
    w.m = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  }
  return w;
}

constexpr int64_t kRowsPerPass = 64;
constexpr int64_t kFusedMaxRows = 4;

void matmul(const Kernels& kern, const float* x, int64_t M, int64_t ldx, const Packed& w, float* out, int64_t ldo) {
  const int64_t groups = (w.N + kNR - 1) / kNR;
  if (kern.fused != nullptr && M <= kFusedMaxRows) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> scales(2 * kNR * w.KB);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * kNR;
        const int nr = static_cast<int>(std::min(kNR, w.N - n0));
        kern.fused(w, n0, nr, x, ldx, static_cast<int>(M), out + n0, ldo, scales.data());
      }
    });
    return;
  }
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(kNR * w.K), scales(2 * w.KB);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t m1 = std::min(M, m0 + kRowsPerPass);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * kNR;
        const int nr = static_cast<int>(std::min(kNR, w.N - n0));
        for (int j = 0; j < nr; ++j) kern.dequant_row(w, n0 + j, buf.data() + j * w.K, scales.data());
        for (int64_t m = m0; m < m1; m += kern.max_mr) {
          const int mr = static_cast<int>(std::min<int64_t>(kern.max_mr, m1 - m));
          kern.tile(x + m * ldx, ldx, buf.data(), w.K, out + m * ldo + n0, ldo, mr, nr);
        }
      }
    }
  });
}

// bfloat16 activations: widened into a float32 copy on the way in and rounded (to nearest even, as
// torch's .to(bfloat16)) on the way out, here rather than as two torch ops around each call: a decode step
// of a bf16 model made ~250 such conversions, each a dispatch costing more than the copy.
struct Float32Rows {
  std::vector<float> buf;
  const float* ptr;
  int64_t ld;
};

// bfloat16 is float32's upper half: n values widened exactly
void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
    std::memcpy(&dst[k], &bits, 4);
  }
}

Float32Rows float32_rows(const torch::Tensor& x) {
  if (x.scalar_type() == torch::kFloat32) return {{}, x.data_ptr<float>(), x.stride(0)};
  const int64_t M = x.size(0), K = x.size(1);
  Float32Rows rows{std::vector<float>(M * K), nullptr, K};
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < M; ++i) widen_bf16(src + i * x.stride(0), rows.buf.data() + i * K, K);
  rows.ptr = rows.buf.data();
  return rows;
}

void store_bf16_rows(const Kernels& kern, const float* in, int64_t M, int64_t N, torch::Tensor& out) {
  uint16_t* base = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t vec = N & ~int64_t{15};
  for (int64_t i = 0; i < M; ++i) {
    uint16_t* row = base + i * out.stride(0);
    kern.to_bf16(in + i * N, row, vec);
    to_bf16_scalar(in + i * N + vec, row + vec, N - vec);
  }
}

bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
}

}  // namespace

// out[:, :N] (row stride out.stride(0)) = x [M, K] @ dequantized(W [N, K])^T, computed in float32; x and out
// each float32 or bfloat16. `out` may be a column slice of a wider tensor (fused projections write their
// parts side by side).
void quant_matmul(torch::Tensor out, torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                  int64_t fmt, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be matrices");
  const Packed w = packed_of(qs, d, m, fmt, out.size(1), x.size(1));
  TORCH_CHECK(float_or_bf16(x) && float_or_bf16(out), "x/out must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) == w.K && x.stride(1) == 1, "x must be [M, ", w.K, "] with unit stride");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.N && out.stride(1) == 1,
              "out must be [M, ", w.N, "] with unit column stride");
  const Kernels kern = kernels_for(isa, fmt);
  const Float32Rows xf = float32_rows(x);
  const int64_t M = x.size(0);
  if (out.scalar_type() == torch::kFloat32) {
    matmul(kern, xf.ptr, M, xf.ld, w, out.data_ptr<float>(), out.stride(0));
    return;
  }
  std::vector<float> acc(M * w.N);
  matmul(kern, xf.ptr, M, xf.ld, w, acc.data(), w.N);
  store_bf16_rows(kern, acc.data(), M, w.N, out);
}

// out [N, K] float32 or bfloat16, contiguous = dequantized W.
void quant_dequantize(torch::Tensor out, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t fmt,
                      int64_t isa) {
  TORCH_CHECK(out.dim() == 2, "out must be [N, K]");
  const Packed w = packed_of(qs, d, m, fmt, out.size(0), out.size(1));
  TORCH_CHECK(out.is_contiguous() && out.size(0) == w.N && out.size(1) == w.K, "out must be [N, K] contiguous");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || out.scalar_type() == torch::kFloat32, "quant_dequantize: out must be float32 or bfloat16");
  const Kernels kern = kernels_for(isa, fmt);
  void* base = out.data_ptr();
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(w.K), scales(2 * w.KB);
    for (int64_t n = n0; n < n1; ++n) {
      if (!bf16) {
        kern.dequant_row(w, n, static_cast<float*>(base) + n * w.K, scales.data());
        continue;
      }
      kern.dequant_row(w, n, row.data(), scales.data());
      kern.to_bf16(row.data(), static_cast<uint16_t*>(base) + n * w.K, w.K);
    }
  });
}

// The best ISA level this CPU runs: 0 portable, 1 AVX2 + FMA, 2 AVX-512 (F, BW, VL).
int64_t cpu_isa() { return detect_isa(); }

// Whether quant_matmul_interleaved runs here, and the tiled copies take the 512-bit kernels (AVX-512 with VNNI).
bool has_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return detect_isa() == kAvx512 && __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
}

// Whether the column-tiled copies' entry points (quant_matmul_tiled, the tiled sets, the packed experts; their
// dequantize and argmax) run here: with VNNI, or on AVX2 (quant_tiled_avx2.h, quant_tiled_kq_avx2.h)
bool has_int8_tiles() { return has_vnni() || detect_isa() >= kAvx2; }

// How many threads this module's parallel_for really runs on (0 would mean a broken build).
int64_t quant_parallel_width() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 4096, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63));
  });
  return __builtin_popcountll(seen.load());
}

// The interleaved layout (quant_vnni.h): out [M, N] = int8-quantized x [M, K] @ W^T; vq uint8 [N, KB * 16]
// (Q4_0, Q4_1) or [N, KB * 32] (Q8_0), vd / vo float16 [N, KB]; x and out contiguous, float32 or bfloat16.
void quant_matmul_interleaved(torch::Tensor out, torch::Tensor x, torch::Tensor vq, torch::Tensor vd,
                              torch::Tensor vo, bool q8) {
  TORCH_CHECK(has_vnni(), "needs AVX-512 VNNI");
  TORCH_CHECK(float_or_bf16(x) && float_or_bf16(out), "x/out must be float32 or bfloat16");
  TORCH_CHECK(vq.is_contiguous() && vd.is_contiguous() && vo.is_contiguous() && vq.scalar_type() == torch::kUInt8 &&
              vd.scalar_type() == torch::kFloat16 && vo.scalar_type() == torch::kFloat16 && vd.sizes() == vo.sizes(),
              "interleaved weights: vq uint8, vd / vo float16 of one shape, contiguous");
  const int64_t N = vd.size(0), KB = vd.size(1), M = x.size(0), K = x.size(1);
  TORCH_CHECK(vq.size(0) == N && vq.size(1) == KB * (q8 ? kBlock : kBlock / 2) && K == KB * kBlock,
              "interleaved weights do not match x [M, ", K, "]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.size(0) == M && out.size(1) == N, "shapes");
  const Float32Rows xf = float32_rows(x);
  std::vector<int8_t> xi(M * K), scratch(K);
  std::vector<float> xd(M * KB), xs(M * KB);
  for (int64_t i = 0; i < M; ++i)
    quantize_row_interleaved(xf.ptr + i * xf.ld, KB, xi.data() + i * K, xd.data() + i * KB, xs.data() + i * KB,
                             scratch.data());
  const bool bf16_out = out.scalar_type() == torch::kBFloat16;
  std::vector<float> acc(bf16_out ? M * N : 0);
  float* op = bf16_out ? acc.data() : out.data_ptr<float>();
  const auto* d = reinterpret_cast<const uint16_t*>(vd.data_ptr<at::Half>());
  const auto* o = reinterpret_cast<const uint16_t*>(vo.data_ptr<at::Half>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    interleaved_rows(vq.data_ptr<uint8_t>(), d, o, q8, KB, n0, n1, xi.data(), xd.data(), xs.data(), M, op, N);
  });
  if (bf16_out) store_bf16_rows(kernels_for(detect_isa()), acc.data(), M, N, out);
}

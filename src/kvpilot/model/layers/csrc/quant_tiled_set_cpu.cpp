// Entry points for a tiled set: the column-tiled int8 copies of one projection's parts, each in its own format
// (Q8_0 / Q4_0 / Q4_1: quant_vnni_gemm.h; the formats kept as GGUF blocks: quant_tiled_kq.h; on AVX2 CPUs their
// 256-bit twins), side by side in the output (a fused q/k/v whose v is Q6_K and q/k Q4_K, as llama.cpp's Q4_K_M
// mixes write). x is quantized once for all parts. Built after quant_tiled_cpu.cpp (Q8Rows, tiled_shape,
// argmax_over_tiles).
//
// A part is 3 tensors and a format code: (tq, td, to) for the split formats (quant_vnni_gemm.h), (tq, td, ts) for
// the others (ts empty but for the K-quants and IQ4_XS), every part with the same KB.
namespace {

struct TiledPart {
  int64_t fmt, T;
  const uint8_t* tq;
  const uint16_t* td;
  const uint16_t* to;  // split formats: Q4_1's offsets (nullptr: derived from the scales)
  const uint8_t* ts;   // K-quants, IQ4_XS
};

TiledPart tiled_part(const torch::Tensor* w, int64_t fmt, int64_t& KB) {
  const torch::Tensor &tq = w[0], &td = w[1], &third = w[2];
  if (!kept_as_blocks(fmt)) {
    const TiledShape shape = tiled_shape(tq, td, third);
    TORCH_CHECK(shape.q8 == (fmt == kQ8_0) && fmt >= kQ8_0 && fmt <= kQ4_1 && (fmt != kQ4_1 || third.numel() > 0),
                "tiled part: format ", fmt, " does not match its weights");
    KB = shape.KB;
    return {fmt, shape.T, tq.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(td.data_ptr<at::Half>()),
            tiled_offsets(third), nullptr};
  }
  TORCH_CHECK(tq.is_contiguous() && td.is_contiguous() && third.is_contiguous() && tq.dim() == 3 && td.dim() == 3 &&
              tq.scalar_type() == torch::kUInt8 && td.scalar_type() == torch::kFloat16, "tiled part: tq uint8 [T, KB, "
              "bytes], td float16 [T, groups, width], contiguous");
  const int64_t T = tq.size(0);
  KB = tq.size(1);
  TORCH_CHECK(fmt <= kIQ4_XS, "tiled part: unknown format ", fmt);
  TORCH_CHECK(!has_super_blocks(fmt) || KB % 8 == 0, "tiled part: super-block rows hold whole super-blocks");
  TORCH_CHECK(tq.size(2) == ktile_qbytes(fmt) && td.size(0) == T && td.size(1) == ktile_groups(fmt, KB) &&
              td.size(2) == ktile_td_width(fmt), "tiled part: shapes do not match format ", fmt);
  const bool has_ts = has_super_blocks(fmt);
  TORCH_CHECK(!has_ts || (third.scalar_type() == torch::kUInt8 && third.numel() == T * KB * ktile_ts_width(fmt)),
              "tiled part: ts uint8 [T, KB, ", ktile_ts_width(fmt), "]");
  return {fmt, T, tq.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(td.data_ptr<at::Half>()), nullptr,
          has_ts ? third.data_ptr<uint8_t>() : nullptr};
}

struct TiledSet {
  std::vector<TiledPart> parts;
  std::vector<int64_t> first_tile;  // part i's tiles are the set's [first_tile[i], first_tile[i + 1])
  int64_t KB = 0;
  bool q6 = false;
  int64_t tiles() const { return first_tile.back(); }
};

TiledSet tiled_set(const std::vector<torch::Tensor>& w, const std::vector<int64_t>& formats) {
  TORCH_CHECK(has_int8_tiles(), "needs AVX-512 VNNI or AVX2");
  TORCH_CHECK(!formats.empty() && w.size() == 3 * formats.size(), "a tiled set: 3 tensors per part");
  TiledSet set;
  set.first_tile.push_back(0);
  for (size_t i = 0; i < formats.size(); ++i) {
    int64_t KB = 0;
    set.parts.push_back(tiled_part(w.data() + 3 * i, formats[i], KB));
    TORCH_CHECK(i == 0 || KB == set.KB, "tiled set: parts of different widths");
    set.KB = KB;
    set.q6 = set.q6 || formats[i] == kQ6_K;
    set.first_tile.push_back(set.first_tile.back() + set.parts.back().T);
  }
  return set;
}

// 32 times the sum of each 16 int8 values of every x row (Q6_K's -32 offset, taken off its integer dot products)
std::vector<int32_t> sums_of_16(const Q8Rows& x, int64_t M, int64_t K) {
  std::vector<int32_t> sums(M * (K / 16));
  for (int64_t c = 0; c < M * (K / 16); ++c) {
    int32_t sum = 0;
    for (int v = 0; v < 16; ++v) sum += x.q[c * 16 + v];
    sums[c] = 32 * sum;
  }
  return sums;
}

// int8 rows (values, block scales, scaled sums, and for Q6_K the 16-value sums) as raw arrays: a Q8Rows, or a run of
// rows inside one (quant_moe_cpu.cpp: an expert group's rows of the step's gathered rows)
struct Q8View {
  const int8_t* q;
  const float *d, *s;
  const int32_t* x32;
};

using KTiledRowsFn = void (*)(const uint8_t*, const uint16_t*, const uint8_t*, int64_t, int64_t, int64_t,
                              const int8_t*, const float*, const float*, const int32_t*, int64_t, float*, uint16_t*,
                              int64_t);
using KTiledDequantFn = void (*)(const uint8_t*, const uint16_t*, const uint8_t*, int64_t, int64_t, int64_t, float*,
                                 uint16_t*);

// Format F's tiled GEMM and dense rows on this CPU: AVX-512 VNNI (quant_tiled_kq.h), else AVX2 (quant_tiled_kq_avx2.h)
template <int F>
std::pair<KTiledRowsFn, KTiledDequantFn> ktiled_isa() {
  if (has_vnni()) return {ktiled_rows<F>, ktiled_dequant_rows<F>};
  return {ktiled_rows256<F>, ktiled_dequant_rows256<F>};
}

// The one switch over the formats kept as blocks, for every caller (the tiled set here, the experts of
// quant_moe_cpu.cpp)
std::pair<KTiledRowsFn, KTiledDequantFn> ktiled_for(int64_t fmt) {
  switch (fmt) {
    case kQ5_0: return ktiled_isa<kQ5_0>();
    case kQ5_1: return ktiled_isa<kQ5_1>();
    case kQ4_K: return ktiled_isa<kQ4_K>();
    case kQ5_K: return ktiled_isa<kQ5_K>();
    case kIQ4_NL: return ktiled_isa<kIQ4_NL>();
    case kMXFP4: return ktiled_isa<kMXFP4>();
    case kIQ4_XS: return ktiled_isa<kIQ4_XS>();
    default: return ktiled_isa<kQ6_K>();
  }
}

// Part p's tiles [t0, t1) times the M rows of x: as tiled_rows / ktiled_rows, from tile t0's column of out (or
// out_bf16)
void part_rows(const TiledPart& p, int64_t KB, int64_t t0, int64_t t1, const Q8View& x, int64_t M, float* out,
               uint16_t* out_bf16, int64_t ldo) {
  if (!kept_as_blocks(p.fmt))
    return tiled_rows_for(p.fmt == kQ8_0)(p.tq, p.td, p.to, KB, t0, t1, x.q, x.d, x.s, M, out, out_bf16, ldo);
  ktiled_for(p.fmt).first(p.tq, p.td, p.ts, KB, t0, t1, x.q, x.d, x.s, x.x32, M, out, out_bf16, ldo);
}

// Part p's tiles [t0, t1) as dense rows (row 16 t0 of the part first): as tiled_dequant_rows / ktiled_dequant_rows
void part_dequant_rows(const TiledPart& p, int64_t KB, int64_t t0, int64_t t1, float* out, uint16_t* out_bf16) {
  if (!kept_as_blocks(p.fmt)) return tiled_dequant_rows_for(p.fmt == kQ8_0)(p.tq, p.td, p.to, KB, t0, t1, out, out_bf16);
  ktiled_for(p.fmt).second(p.tq, p.td, p.ts, KB, t0, t1, out, out_bf16);
}

// Calls fn(part, local t0, local t1, first set tile) for each part's share of the set's tiles [g0, g1)
template <typename Fn>
void for_parts_in(const TiledSet& set, int64_t g0, int64_t g1, const Fn& fn) {
  for (size_t i = 0; i < set.parts.size(); ++i) {
    const int64_t lo = std::max(g0, set.first_tile[i]), hi = std::min(g1, set.first_tile[i + 1]);
    if (lo < hi) fn(set.parts[i], lo - set.first_tile[i], hi - set.first_tile[i], lo);
  }
}

}  // namespace

// out [M, N] contiguous (N: the parts' rows, side by side) = int8-quantized x [M, K] @ W^T; x and out float32 or
// bfloat16. A part's outputs are exactly what quant_matmul_tiled (or the same loop for the other formats) writes.
void quant_matmul_tiled_set(torch::Tensor out, torch::Tensor x, std::vector<torch::Tensor> w,
                            std::vector<int64_t> formats) {
  const TiledSet set = tiled_set(w, formats);
  const int64_t N = set.tiles() * 16, M = x.size(0), K = set.KB * kBlock;
  TORCH_CHECK(float_or_bf16(x) && x.is_contiguous() && x.dim() == 2 && x.size(1) == K, "x: contiguous [M, ", K, "]");
  TORCH_CHECK(float_or_bf16(out) && out.is_contiguous() && out.size(0) == M && out.size(1) == N, "out: [M, ", N, "]");
  const Q8Rows xq = quantize_rows_q8(x, set.KB);
  const std::vector<int32_t> x32 = set.q6 ? sums_of_16(xq, M, K) : std::vector<int32_t>();
  const Q8View xv{xq.q.data(), xq.d.data(), xq.s.data(), x32.data()};
  const bool bf16_out = out.scalar_type() == torch::kBFloat16;
  float* op = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, set.tiles(), 1, [&](int64_t g0, int64_t g1) {
    for_parts_in(set, g0, g1, [&](const TiledPart& p, int64_t t0, int64_t t1, int64_t g) {
      part_rows(p, set.KB, t0, t1, xv, M, op == nullptr ? nullptr : op + g * 16, ob == nullptr ? nullptr : ob + g * 16,
                N);
    });
  });
}

// out [N, K] contiguous, float32 or bfloat16 = the set's values, part after part (the gguf package's float32 values;
// bfloat16: those rounded to nearest even)
void quant_dequantize_tiled_set(torch::Tensor out, std::vector<torch::Tensor> w, std::vector<int64_t> formats) {
  const TiledSet set = tiled_set(w, formats);
  const int64_t K = set.KB * kBlock;
  TORCH_CHECK(float_or_bf16(out) && out.is_contiguous() && out.dim() == 2 && out.size(0) == set.tiles() * 16 &&
              out.size(1) == K, "out: contiguous [", set.tiles() * 16, ", ", K, "] float32 / bf16");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, set.tiles(), 1, [&](int64_t g0, int64_t g1) {
    for_parts_in(set, g0, g1, [&](const TiledPart& p, int64_t t0, int64_t t1, int64_t g) {
      float* of = bf16 ? nullptr : out.data_ptr<float>() + g * 16 * K;
      uint16_t* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + g * 16 * K : nullptr;
      part_dequant_rows(p, set.KB, t0, t1, of, ob);
    });
  });
}

// ids [M] int64: each x row's argmax over the columns quant_matmul_tiled_set computes (float32), as
// quant_argmax_tiled; -1 for a row with a NaN among them
torch::Tensor quant_argmax_tiled_set(torch::Tensor x, std::vector<torch::Tensor> w, std::vector<int64_t> formats) {
  const TiledSet set = tiled_set(w, formats);
  const int64_t M = x.size(0), K = set.KB * kBlock;
  TORCH_CHECK(float_or_bf16(x) && x.is_contiguous() && x.dim() == 2 && x.size(1) == K, "x: contiguous [M, ", K, "]");
  const Q8Rows xq = quantize_rows_q8(x, set.KB);
  const std::vector<int32_t> x32 = set.q6 ? sums_of_16(xq, M, K) : std::vector<int32_t>();
  const Q8View xv{xq.q.data(), xq.d.data(), xq.s.data(), x32.data()};
  return argmax_over_tiles(set.tiles(), M, [&](int64_t t, int64_t te, float* block, int64_t width) {
    for_parts_in(set, t, te, [&](const TiledPart& p, int64_t t0, int64_t t1, int64_t g) {
      part_rows(p, set.KB, t0, t1, xv, M, block + (g - t) * 16, nullptr, width);
    });
  });
}

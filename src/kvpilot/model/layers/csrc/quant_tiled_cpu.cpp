// The column-tiled layout's entry points (layout and inner loops: quant_vnni_gemm.h): the int8 GEMM, the dense
// values, and greedy decoding's argmax over an output layer's logits without writing the logits. Built in the same
// translation unit as quant_linear_cpu.cpp (after it: widen_bf16, float_or_bf16, has_vnni).
#include <limits>
#include <memory>
#include <tuple>
#include <utility>

namespace {

// x [M, K] (float32 or bfloat16, contiguous) as int8 blocks (quantize_row_q8): values q [M, K], scales d and sums s
// [M, KB]. Rows in parallel, bf16 ones widened row by row on the way (no float32 copy of x).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

using QuantizeRowFn = void (*)(const float*, int64_t, int8_t*, float*, float*);

// quantize_row_q8 on this CPU (both ISAs write the same blocks)
QuantizeRowFn quantize_row_q8_here() { return has_vnni() ? quantize_row_q8 : quantize_row_q8_256; }

Q8Rows quantize_rows_q8(const torch::Tensor& x, int64_t KB) {
  const int64_t M = x.size(0), K = x.size(1);
  Q8Rows rows{std::vector<int8_t>(M * K), std::vector<float>(M * KB), std::vector<float>(M * KB)};
  const bool bf16_in = x.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(bf16_in ? K : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const float* xi = bf16_in ? row.data() : x.data_ptr<float>() + i * K;
      if (bf16_in) widen_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + i * K, row.data(), K);
      quantize_row_q8_here()(xi, KB, rows.q.data() + i * K, rows.d.data() + i * KB, rows.s.data() + i * KB);
    }
  });
  return rows;
}

// The tiled weights' tile count T, blocks per row KB and format (Q8_0: 512 quant bytes a tile and block, Q4: 256),
// checked (on a CPU with VNNI, or AVX2: has_int8_tiles); `to` is empty for tiles whose offsets derive from their
// scales (Q4_0, Q8_0: quant_vnni_gemm.h)
struct TiledShape {
  int64_t T, KB;
  bool q8;
};

TiledShape tiled_shape(const torch::Tensor& tq, const torch::Tensor& td, const torch::Tensor& to) {
  TORCH_CHECK(has_int8_tiles(), "needs AVX-512 VNNI or AVX2");
  TORCH_CHECK(tq.is_contiguous() && td.is_contiguous() && to.is_contiguous() && tq.scalar_type() == torch::kUInt8 &&
              td.scalar_type() == torch::kFloat16 && to.scalar_type() == torch::kFloat16 &&
              (to.numel() == 0 || td.sizes() == to.sizes()) && td.dim() == 3 && td.size(2) == 16 && tq.dim() == 3,
              "tiled weights: tq uint8, td / to float16 [N / 16, KB, 16] (to empty: offsets from the scales), "
              "contiguous");
  const int64_t T = td.size(0), KB = td.size(1);
  const bool q8 = tq.size(2) == 512;
  TORCH_CHECK((q8 || tq.size(2) == 256) && tq.size(0) == T && tq.size(1) == KB,
              "tiled weights: tq [N / 16, KB, 256] (Q4) or [N / 16, KB, 512] (Q8_0)");
  return {T, KB, q8};
}

// The tiles' stored offsets, or nullptr where they derive from the scales
const uint16_t* tiled_offsets(const torch::Tensor& to) {
  return to.numel() == 0 ? nullptr : reinterpret_cast<const uint16_t*>(to.data_ptr<at::Half>());
}

// tiled_shape, with x [M, K] checked against it (float32 or bfloat16, contiguous)
TiledShape tiled_shape(const torch::Tensor& x, const torch::Tensor& tq, const torch::Tensor& td,
                       const torch::Tensor& to) {
  const TiledShape shape = tiled_shape(tq, td, to);
  TORCH_CHECK(float_or_bf16(x) && x.is_contiguous() && x.dim() == 2, "x must be contiguous [M, K] float32 or bfloat16");
  TORCH_CHECK(x.size(1) == shape.KB * kBlock, "tiled weights do not match x [M, ", x.size(1), "]");
  return shape;
}

// Tiles an argmax chunk multiplies at a time: their float32 outputs for every x row ([M, 16 * kArgmaxTiles], 32 KiB
// at 64 rows) are scanned while still in cache, where a vocabulary's logits would stream to memory and back.
constexpr int64_t kArgmaxTiles = 8;

// Folds block [M, width] (columns col0 .. col0 + width - 1) into each row's running best. Lane l of a row has seen
// the columns = l (mod 16) in increasing order and keeps the first of the largest: only a strictly greater value
// replaces it. NaN compares greater than nothing; it is flagged per row instead (bit tests: -ffast-math may assume
// no NaN in float compares).
KVP_VNNI void fold_block512(const float* block, int64_t M, int64_t width, int64_t col0, float* best, int32_t* index,
                            bool* nan) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
  for (int64_t i = 0; i < M; ++i) {
    __m512 value = _mm512_loadu_ps(best + i * 16);
    __m512i column = _mm512_loadu_si512(index + i * 16);
    __mmask16 bad = 0;
    for (int64_t c = 0; c < width; c += 16) {
      const __m512 v = _mm512_loadu_ps(block + i * width + c);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, value, _CMP_GT_OQ);
      value = _mm512_mask_mov_ps(value, greater, v);
      column = _mm512_mask_mov_epi32(column, greater, _mm512_add_epi32(lanes, _mm512_set1_epi32(int32_t(col0 + c))));
      bad |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
    }
    _mm512_storeu_ps(best + i * 16, value);
    _mm512_storeu_si512(index + i * 16, column);
    nan[i] = nan[i] || bad != 0;
  }
}

// fold_block512 without AVX-512 (same lanes, same rule, same NaN test on the bits)
void fold_block_portable(const float* block, int64_t M, int64_t width, int64_t col0, float* best, int32_t* index,
                         bool* nan) {
  for (int64_t i = 0; i < M; ++i) {
    bool bad = false;
    for (int64_t c = 0; c < width; ++c) {
      const float v = block[i * width + c];
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      bad = bad || (bits & 0x7FFFFFFFu) > 0x7F800000u;
      const int64_t lane = i * 16 + c % 16;
      if (v > best[lane]) best[lane] = v, index[lane] = int32_t(col0 + c);
    }
    nan[i] = nan[i] || bad;
  }
}

using FoldFn = void (*)(const float*, int64_t, int64_t, int64_t, float*, int32_t*, bool*);

// A row's 16 lanes -> (largest value, lowest column holding it)
std::pair<float, int32_t> lane_best(const float* best, const int32_t* index) {
  float value = best[0];
  int32_t column = index[0];
  for (int l = 1; l < 16; ++l)
    if (best[l] > value || (best[l] == value && index[l] < column)) value = best[l], column = index[l];
  return {value, column};
}

// Tiles [t0, t1) of the argmax: per x row, the best (value, column) of their columns and whether one was NaN.
// rows(t, te, block, width) writes the float32 outputs of tiles [t, te) for every x row into block [M, width].
template <typename RowsFn>
void argmax_chunk(const RowsFn& rows, int64_t t0, int64_t t1, int64_t M, float* value, int32_t* column, bool* nan) {
  const FoldFn fold_block = has_vnni() ? fold_block512 : fold_block_portable;
  std::vector<float> block(M * 16 * kArgmaxTiles), best(M * 16, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> index(M * 16);
  for (int64_t i = 0; i < M; ++i)
    for (int l = 0; l < 16; ++l) index[i * 16 + l] = int32_t(t0 * 16 + l);  // a row of -inf: its first column
  std::fill(nan, nan + M, false);
  for (int64_t t = t0; t < t1; t += kArgmaxTiles) {
    const int64_t te = std::min(t + kArgmaxTiles, t1), width = (te - t) * 16;
    rows(t, te, block.data(), width);
    fold_block(block.data(), M, width, t * 16, best.data(), index.data(), nan);
  }
  for (int64_t i = 0; i < M; ++i) std::tie(value[i], column[i]) = lane_best(best.data() + i * 16, index.data() + i * 16);
}

}  // namespace

namespace {

using TiledRowsFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, const int8_t*,
                             const float*, const float*, int64_t, float*, uint16_t*, int64_t);
using TiledDequantFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*,
                                uint16_t*);

// tiled_rows for Q8_0 (q8) or Q4 tiles on this CPU: AVX-512 VNNI (quant_vnni_gemm.h), else AVX2 (quant_tiled_avx2.h)
TiledRowsFn tiled_rows_for(bool q8) {
  if (has_vnni()) return q8 ? tiled_rows<true> : tiled_rows<false>;
  return q8 ? tiled_rows256<true> : tiled_rows256<false>;
}

TiledDequantFn tiled_dequant_rows_for(bool q8) {
  if (has_vnni()) return q8 ? tiled_dequant_rows<true> : tiled_dequant_rows<false>;
  return q8 ? tiled_dequant_rows256<true> : tiled_dequant_rows256<false>;
}

}  // namespace

// The column-tiled layout (quant_vnni_gemm.h), for many rows: out [M, N] = int8-quantized x [M, K] @ W^T; tq uint8
// [N / 16, KB, 256] (Q4_0, Q4_1) or [N / 16, KB, 512] (Q8_0), td / to float16 [N / 16, KB, 16]; x and out
// contiguous, float32 or bfloat16.
void quant_matmul_tiled(torch::Tensor out, torch::Tensor x, torch::Tensor tq, torch::Tensor td, torch::Tensor to) {
  TORCH_CHECK(float_or_bf16(out), "out must be float32 or bfloat16");
  const TiledShape shape = tiled_shape(x, tq, td, to);
  const int64_t T = shape.T, KB = shape.KB, N = T * 16, M = x.size(0);
  const bool q8 = shape.q8;
  TORCH_CHECK(out.is_contiguous() && out.size(0) == M && out.size(1) == N, "out must be contiguous [M, N]");
  const Q8Rows xq = quantize_rows_q8(x, KB);
  const bool bf16_out = out.scalar_type() == torch::kBFloat16;
  float* op = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* ob = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const auto* d = reinterpret_cast<const uint16_t*>(td.data_ptr<at::Half>());
  const uint16_t* o = tiled_offsets(to);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    tiled_rows_for(q8)(tq.data_ptr<uint8_t>(), d, o, KB, t0, t1, xq.q.data(), xq.d.data(), xq.s.data(), M,
                       op == nullptr ? nullptr : op + t0 * 16, ob == nullptr ? nullptr : ob + t0 * 16, N);
  });
}

// The values of a column-tiled copy (quant_vnni_gemm.h) as a dense matrix: out [N, K] contiguous, float32 (d * q + o
// by one fused multiply-add, as quant_dequantize computes the packed blocks) or bfloat16 (those rounded to nearest
// even). For the rows the int8 path does not take (steps with prompt tokens) in a layer whose tiled copy is its
// only copy of the blocks (no resident dense copy).
void quant_dequantize_tiled(torch::Tensor out, torch::Tensor tq, torch::Tensor td, torch::Tensor to) {
  const TiledShape shape = tiled_shape(tq, td, to);
  const int64_t T = shape.T, KB = shape.KB, K = KB * kBlock;
  const bool q8 = shape.q8;
  TORCH_CHECK(float_or_bf16(out) && out.is_contiguous() && out.dim() == 2, "out: contiguous [N, K] float32 / bf16");
  TORCH_CHECK(out.size(0) == T * 16 && out.size(1) == K, "tiled weights do not match out [", out.size(0), ", ",
              out.size(1), "]");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  const auto* d = reinterpret_cast<const uint16_t*>(td.data_ptr<at::Half>());
  const uint16_t* o = tiled_offsets(to);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    float* of = bf16 ? nullptr : out.data_ptr<float>() + t0 * 16 * K;
    uint16_t* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t0 * 16 * K : nullptr;
    tiled_dequant_rows_for(q8)(tq.data_ptr<uint8_t>(), d, o, KB, t0, t1, of, ob);
  });
}

namespace {

// The argmax over the columns of T tiles for M x rows, rows(t, te, block, width) computing tiles [t, te) (argmax_chunk)
template <typename RowsFn>
torch::Tensor argmax_over_tiles(int64_t T, int64_t M, const RowsFn& rows) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), T));
  std::vector<float> value(chunks * M);
  std::vector<int32_t> column(chunks * M);
  std::unique_ptr<bool[]> nan(new bool[chunks * M]);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      argmax_chunk(rows, c * T / chunks, (c + 1) * T / chunks, M, value.data() + c * M, column.data() + c * M,
                   nan.get() + c * M);
  });
  torch::Tensor ids = at::empty({M}, at::kLong);
  int64_t* out = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    float best = value[i];
    int64_t id = column[i];
    bool bad = nan[i];
    for (int64_t c = 1; c < chunks; ++c) {
      bad = bad || nan[c * M + i];
      if (value[c * M + i] > best) best = value[c * M + i], id = column[c * M + i];
    }
    out[i] = bad ? -1 : id;
  }
  return ids;
}

}  // namespace

// Greedy decoding's token ids: ids [M] int64 = argmax over n of (int8-quantized x [M, K] @ W^T)[m, n] for tiled
// weights (as quant_matmul_tiled), the first of equal maxima (numpy's and torch's rule), the same float32 values
// quant_matmul_tiled writes; -1 for a row with a NaN among them (the caller decides). Tiles split into one
// contiguous run per thread; the runs merge in column order, so ties still go to the lowest id.
torch::Tensor quant_argmax_tiled(torch::Tensor x, torch::Tensor tq, torch::Tensor td, torch::Tensor to) {
  const TiledShape shape = tiled_shape(x, tq, td, to);
  const int64_t KB = shape.KB, M = x.size(0);
  const Q8Rows xq = quantize_rows_q8(x, KB);
  const auto* d = reinterpret_cast<const uint16_t*>(td.data_ptr<at::Half>());
  const uint16_t* o = tiled_offsets(to);
  const uint8_t* q = tq.data_ptr<uint8_t>();
  return argmax_over_tiles(shape.T, M, [&](int64_t t, int64_t te, float* block, int64_t width) {
    tiled_rows_for(shape.q8)(q, d, o, KB, t, te, xq.q.data(), xq.d.data(), xq.s.data(), M,
                                                       block, nullptr, width);
  });
}

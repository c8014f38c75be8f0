// The vector path's task of the CPU decode kernel, the same for both ISAs: decode_avx512.h or decode_avx2.h (whichever
// the build's -march gives) supplies its steps (scale_rows, block_scores, softcap_row, softmax_numerators,
// block_values, kHasVectorPath); paged_decode_cpu.cpp calls attend_one_vector where kHasVectorPath holds.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
namespace {

// The scores (`values` false) or the value sums of one block for all G query heads: in one pass over its rows where
// the ISA header fuses G heads (AVX-512: *_heads), else head by head. Either way bit for bit the same numbers.
template <int kD, typename KV>
inline void block_step(bool values, float* acc, float* sc, int64_t ld, const float* qs, const KV* rows,
                       int64_t n, int64_t G) {
#if defined(__AVX512F__)
  if (G >= 2 && G <= kMaxFusedHeads<kD>) {
    auto run = [&](auto heads) {
      constexpr int kG = decltype(heads)::value;
      if (values) block_values_heads<kD, KV, kG>(acc, sc, ld, rows, n);
      else block_scores_heads<kD, KV, kG>(sc, ld, qs, rows, n);
    };
    if (G == 2) run(std::integral_constant<int, 2>{});
    else if (G == 3) run(std::integral_constant<int, 3>{});
    else run(std::integral_constant<int, 4>{});
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    if (values) block_values<kD, KV>(acc + g * kD, sc + g * ld, rows, n);
    else block_scores<kD, KV>(sc + g * ld, qs + g * kD, rows, n);
  }
}

// The same task as paged_decode_cpu.cpp's attend_one: the G query heads of KV head h over the keys lo..L-1 the
// variant lets them see (blocks before lo are never read, nor prefetched). Blocks are the outer loop so each K/V
// block (<= a few KiB) is read from memory once and reused from L1 by all G heads.
template <int kD, typename KV>
void attend_one_vector(float* out, const float* q, const KV* kc, const KV* vc, const int64_t* table, int64_t L,
                       int64_t h, const Shape& s, float scale, const Variant& var, Scratch& scratch) {
  const int64_t G = s.G;
  const int64_t lo = var.first_key(L), n = L - lo;
  scratch.prepare(G, n, kD);
  float* sc = scratch.scores.data();
  float* ac = scratch.acc.data();
  scratch.q.resize(static_cast<size_t>(G * kD));  // the queries pre-scaled, so scores need no multiply
  float* qs = scratch.q.data();
  scale_rows(qs, q, G * kD, scale);
  // the task's blocks i = 0..nb-1 are table[b0 + i]; block i holds keys first(i)..first(i) + rows(i) - 1
  const int64_t b0 = lo / s.BS, nb = (L - 1) / s.BS + 1 - b0;
  auto first = [&](int64_t i) { return std::max(lo, (b0 + i) * s.BS); };
  auto rows = [&](int64_t i) { return std::min(L, (b0 + i + 1) * s.BS) - first(i); };
  auto block = [&](const KV* cache, int64_t i) {
    return cache + ((h * s.NB + table[b0 + i]) * s.BS + first(i) - (b0 + i) * s.BS) * kD;
  };
  constexpr int64_t A = kBlocksAhead;
  for (int64_t i = 0; i < nb; ++i) {
    // reads in order: K blocks 0..nb-1, then V blocks 0..nb-1; each asks for the read A after it
    if (i == 0)
      for (int64_t j = 1; j < A && j < 2 * nb; ++j)
        prefetch_block(j < nb ? block(kc, j) : block(vc, j - nb), rows(j < nb ? j : j - nb), kD);
    if (i + A < nb) prefetch_block(block(kc, i + A), rows(i + A), kD);
    else if (i + A - nb < nb) prefetch_block(block(vc, i + A - nb), rows(i + A - nb), kD);
    block_step<kD, KV>(false, nullptr, sc + first(i) - lo, n, qs, block(kc, i), rows(i), G);
  }
  for (int64_t g = 0; g < G; ++g) {
    if (var.softcap > 0.f) softcap_row(sc + g * n, n, var.softcap);
    scratch.inv[g] = softmax_numerators(sc + g * n, n, var.sinks != nullptr ? var.sinks + h * G + g : nullptr);
  }
  for (int64_t i = 0; i < nb; ++i) {
    if (i + A < nb) prefetch_block(block(vc, i + A), rows(i + A), kD);
    block_step<kD, KV>(true, ac, sc + first(i) - lo, n, nullptr, block(vc, i), rows(i), G);
  }
  for (int64_t g = 0; g < G; ++g) scale_rows(out + g * kD, ac + g * kD, kD, scratch.inv[g]);
}

}  // namespace
#else
namespace {
template <int kD, typename KV>
constexpr bool kHasVectorPath = false;
}  // namespace
#endif

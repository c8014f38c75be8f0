// Packed weights times int8-quantized activations with AVX-512 VNNI dot products (llama.cpp's q8 scheme: each
// 32-value block of x gets its own scale). Quantizing activations changes results by up to ~1/254 of a
// block's largest value, where the float32 path matches dequantize-then-matmul to rounding: the model uses
// it only where results are already rounded to bf16 (PackedLinear.int8_activations, the hybrid layout).
// quant_matmul_interleaved() runs it on the interleaved copy of the weights described below.
#define KVP_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace {

// x [K] -> int8 blocks xq, per-block scales xd and xd * sum(xq) (for Q4_1's minimum term)
KVP_VNNI void quantize_row_q8(const float* x, int64_t KB, int8_t* xq, float* xd, float* xs) {
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    xd[b] = d;
    xs[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

KVP_VNNI inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

// ---- the interleaved layout (kvpilot/model/quant/vnni_layout.py builds it at load) ------------------------------
// Blocks go in groups of 8. In a group, 32-byte chunk g holds values 4g..4g+3 of each of the 8 blocks, block
// after block, so one vpdpbusd advances 8 blocks' dot products by 4 values each and 8 of them finish the group
// in one int32 register: the per-block scaling is then one vector FMA per group (8 blocks) instead of a
// broadcast, a convert and an FMA per block. Q4_0/Q4_1 store 4 chunks of 32 bytes per group (low nibbles:
// chunk c = values 4c.., high nibbles: values 16 + 4c..); Q8_0 stores 8 chunks of q + 128 (unsigned). The last
// KB % 8 blocks of a row (the tail) keep their own order (Q4: GGUF's 16 nibble bytes, Q8_0: 32 bytes of q + 128)
// and are scaled block by block. A row takes as many bytes as before; vd: the block scales, vo: the block offsets
// (Q4_1 m, Q4_0 -8 d, Q8_0 -128 d), both float16 [N, KB]. Activations are quantized into the same arrangement.
namespace {

constexpr int kInterleavedMR = 4;  // x rows per tile: each group's 8 unpacked weight registers serve all 4

// x [K] quantized (quantize_row_q8) into the interleaved arrangement: xi [K] int8 (full groups interleaved, the
// tail in order), xd / xs [KB] (scale, scale * sum(q) per block, in block order)
KVP_VNNI void quantize_row_interleaved(const float* x, int64_t KB, int8_t* xi, float* xd, float* xs, int8_t* q) {
  quantize_row_q8(x, KB, q, xd, xs);
  const int64_t full = KB / 8 * 8;
  for (int64_t b = 0; b < full; ++b) {
    const int64_t group = b / 8, k = b % 8;
    for (int g = 0; g < 8; ++g) std::memcpy(xi + group * 256 + g * 32 + k * 4, q + b * kBlock + g * 4, 4);
  }
  std::memcpy(xi + full * kBlock, q + full * kBlock, (KB - full) * kBlock);
}

template <int MR, bool kQ8>
KVP_VNNI void interleaved_tile(const uint8_t* wq, const uint16_t* wd, const uint16_t* wo, int64_t KB,
                               const int8_t* xi, const float* xd, const float* xs, float* out, int64_t ldo) {
  const int64_t G = KB / 8, K = KB * kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR], off[MR];
  for (int i = 0; i < MR; ++i) acc[i] = off[i] = _mm256_setzero_ps();
  for (int64_t grp = 0; grp < G; ++grp) {
    __m256i w[8];
    if constexpr (kQ8) {
      for (int g = 0; g < 8; ++g) w[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + grp * 256 + g * 32));
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + grp * 128 + c * 32));
        w[c] = _mm256_and_si256(raw, low4);
        w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + grp * 8)));
    const __m256 ov = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wo + grp * 8)));
    for (int i = 0; i < MR; ++i) {
      const int8_t* x = xi + i * K + grp * 256;
      __m256i dot = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g)
        dot = _mm256_dpbusd_epi32(dot, w[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * 32)));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, _mm256_loadu_ps(xd + i * KB + grp * 8)), acc[i]);
      off[i] = _mm256_fmadd_ps(ov, _mm256_loadu_ps(xs + i * KB + grp * 8), off[i]);
    }
  }
  float tail_offset[MR] = {};
  for (int64_t b = G * 8; b < KB; ++b) {  // the tail, block by block
    __m256i w;
    if constexpr (kQ8) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * kBlock));
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq + b * 16));
      const __m128i low = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
    }
    const float d = _cvtsh_ss(wd[b]), o = _cvtsh_ss(wo[b]);
    for (int i = 0; i < MR; ++i) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + i * K + b * kBlock));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[i * KB + b]), acc[i]);
      tail_offset[i] += o * xs[i * KB + b];
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum8(_mm256_add_ps(acc[i], off[i])) + tail_offset[i];
}

// out[i * ldo + n] for rows i < M, weight rows [n0, n1) of the interleaved layout (KB blocks per row)
KVP_VNNI void interleaved_rows(const uint8_t* vq, const uint16_t* vd, const uint16_t* vo, bool q8, int64_t KB,
                               int64_t n0, int64_t n1, const int8_t* xi, const float* xd, const float* xs, int64_t M,
                               float* out, int64_t ldo) {
  const int64_t row_bytes = KB * (q8 ? kBlock : kBlock / 2), K = KB * kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = vq + n * row_bytes;
    const uint16_t* d = vd + n * KB;
    const uint16_t* o = vo + n * KB;
    for (int64_t i = 0; i < M; i += kInterleavedMR) {
      const int64_t mr = std::min<int64_t>(kInterleavedMR, M - i);
      const int8_t* x = xi + i * K;
      const float* xdi = xd + i * KB;
      const float* xsi = xs + i * KB;
      float* dst = out + i * ldo + n;
#define KVP_TILE(R)                                                                       \
  (q8 ? interleaved_tile<R, true>(q, d, o, KB, x, xdi, xsi, dst, ldo)                     \
      : interleaved_tile<R, false>(q, d, o, KB, x, xdi, xsi, dst, ldo))
      if (mr == 4) KVP_TILE(4);
      else if (mr == 3) KVP_TILE(3);
      else if (mr == 2) KVP_TILE(2);
      else KVP_TILE(1);
#undef KVP_TILE
    }
  }
}

}  // namespace

// out[M, N] = x[M, K] . W[N, K]^T (+ bias) on bfloat16 x and W with AMX tiles (TDPBF16PS: exact bf16 products,
// float32 sums), W prepacked in the tile layout (layers/amx_tiles.py), out float32 or bfloat16 (the sum + bias
// rounded once, to nearest even, by bf16_ops_avx512.h's round_bf16x16). Concatenated after bf16_gemm_avx512.h
// (GemmOut) and before bf16_ops_cpu.cpp.
//
// Why: an output head's float32 logits of many rows. oneDNN has no bf16 GEMM with float32 results; its float32
// GEMM in bf16 math mode runs on tiles but reads a float32 copy of the weight, twice the bytes, and a decode
// step's head is bound by those bytes.
//
// Layout: W [N, K] -> tiles of 16 columns x 32 k-values (1 KiB each), [N / 16][Kp / 32][16 k-pairs][16 columns][2]
// (the VNNI pairs TDPBF16PS takes as its B operand), K zero-padded to Kp. x is read in place when K = Kp, else
// copied into zero-padded rows of Kp values.
//
// Invariant (batch-invariance): each output is the same sum in the same order whatever M, the blocking or the
// threads: k in 32-value steps, in order, each step one TDPBF16PS into the output's float32 lane.
// Built with target attributes; amx_bf16_usable() says at run time whether the CPU has the instructions and
// Linux granted the process the tile state.
#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>

#define KVP_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,fma")))

namespace {

constexpr int64_t kAmxTileCols = 16;     // output columns of a B tile
constexpr int64_t kAmxTileK = 32;        // bf16 k-values of an A row / a B tile (64 bytes a row)
constexpr int64_t kAmxTileElems = 512;   // bf16 values in one packed B tile
constexpr int64_t kAmxBlockRows = 32;    // x rows per pass: two A tiles
constexpr int64_t kAmxBlockCols = 32;    // output columns per pass: two B tiles
constexpr int64_t kAmxChunkRows = 64;    // x rows per sweep over the weight (more ran slower than two sweeps)

inline bool amx_bf16_usable() {
  static const bool usable = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) {
      return false;
    }
    // Linux hands a process the tiles' state only when asked: ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA (18)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3 accumulate up to a 32 x 32 block of outputs (two row halves x two column halves), 4-5 hold x's two
// row halves, 6-7 the weight's two 16-column tiles (16 rows of 64 bytes). `rows` (1-32): x rows in the pass; a
// half with no rows is not configured (its tiles unused).
KVP_AMX inline void amx_configure(int64_t rows) {
  AmxTileConfig config{};
  config.palette_id = 1;
  const auto first = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
  const auto second = static_cast<uint8_t>(rows > 16 ? rows - 16 : 0);
  const uint8_t tile_rows[8] = {first, first, second, second, first, second, 16, 16};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = tile_rows[t];
    config.colsb[t] = tile_rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&config);
}

// One pass (the configured rows, two halves when more than 16): outputs of x rows from m0 and columns
// [32 nb, 32 nb + 32) into `dst` (row stride dst_stride floats).
KVP_AMX inline void amx_block(const uint16_t* xp, int64_t Kp, const uint16_t* wp, int64_t ksteps, int64_t m0,
                              int64_t nb, bool two_halves, float* dst, int64_t dst_stride) {
  const uint16_t* b0 = wp + (2 * nb) * ksteps * kAmxTileElems;
  const uint16_t* b1 = b0 + ksteps * kAmxTileElems;
  const uint16_t* a0 = xp + m0 * Kp;
  const uint16_t* a1 = a0 + 16 * Kp;
  const int64_t bytes = dst_stride * 4;
  _tile_zero(0);
  _tile_zero(1);
  if (two_halves) {
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ksteps; ++s) {
      _tile_loadd(4, a0 + s * kAmxTileK, Kp * 2);
      _tile_loadd(5, a1 + s * kAmxTileK, Kp * 2);
      _tile_loadd(6, b0 + s * kAmxTileElems, 64);
      _tile_loadd(7, b1 + s * kAmxTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(2, dst + 16 * dst_stride, bytes);
    _tile_stored(3, dst + 16 * dst_stride + 16, bytes);
  } else {
    for (int64_t s = 0; s < ksteps; ++s) {
      _tile_loadd(4, a0 + s * kAmxTileK, Kp * 2);
      _tile_loadd(6, b0 + s * kAmxTileElems, 64);
      _tile_loadd(7, b1 + s * kAmxTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
  _tile_stored(0, dst, bytes);
  _tile_stored(1, dst + 16, bytes);
}

// Rows [0, rows) of a 32 x 32 float32 block into out's rows m0.. and columns n0..: + bias, rounded for bf16.
KVP_AMX inline void amx_store_rows(const float* block, int64_t rows, const GemmOut& o, int64_t m0, int64_t n0) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t half = 0; half < kAmxBlockCols; half += 16) {
      __m512 sums = _mm512_load_ps(block + r * kAmxBlockCols + half);
      if (o.bias != nullptr) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o.bias + n0 + half));
        sums = _mm512_add_ps(sums, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
      }
      const int64_t at = (m0 + r) * o.N + n0 + half;
      if (o.bf16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o.out) + at),
                            _mm512_cvtepi32_epi16(round_bf16x16(sums)));
      } else {
        _mm512_storeu_ps(static_cast<float*>(o.out) + at, sums);
      }
    }
  }
}

// One pass of `rows` (1-32) x rows from m0 over column block nb: float32 sums with no bias straight into `out`,
// anything else through a scratch block.
KVP_AMX inline void amx_pass(const uint16_t* xp, int64_t Kp, const uint16_t* wp, int64_t ksteps, int64_t m0,
                             int64_t rows, int64_t nb, const GemmOut& o, float* scratch) {
  const int64_t n0 = nb * kAmxBlockCols;
  if (!o.bf16 && o.bias == nullptr) {
    amx_block(xp, Kp, wp, ksteps, m0, nb, rows > 16, static_cast<float*>(o.out) + m0 * o.N + n0, o.N);
    return;
  }
  amx_block(xp, Kp, wp, ksteps, m0, nb, rows > 16, scratch, kAmxBlockCols);
  amx_store_rows(scratch, rows, o, m0, n0);
}

// Column blocks [nb0, nb1) of out [M, N] (N a multiple of 32, M <= kAmxChunkRows) from x [M, Kp] and the packed
// weight: whole 32-row passes, then the rest of the rows under a tile configuration of their own (the x rows
// beyond M are never read, nor computed).
KVP_AMX void amx_gemm_blocks(const uint16_t* xp, int64_t M, int64_t Kp, const uint16_t* wp, const GemmOut& o,
                             int64_t nb0, int64_t nb1) {
  alignas(64) float scratch[kAmxBlockRows * kAmxBlockCols];
  const int64_t ksteps = Kp / kAmxTileK;
  const int64_t whole = M / kAmxBlockRows * kAmxBlockRows, rest = M - whole;
  if (whole == 0) amx_configure(rest);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    if (whole > 0) {
      if (rest > 0 || nb == nb0) amx_configure(kAmxBlockRows);
      for (int64_t m0 = 0; m0 < whole; m0 += kAmxBlockRows) amx_pass(xp, Kp, wp, ksteps, m0, kAmxBlockRows, nb, o, scratch);
      if (rest > 0) amx_configure(rest);
    }
    if (rest > 0) amx_pass(xp, Kp, wp, ksteps, whole, rest, nb, o, scratch);
  }
  _tile_release();
}

}  // namespace

#else
namespace {
inline bool amx_bf16_usable() { return false; }
}  // namespace
#endif

// out[M, N] float32 = x[M, K] . W[N, K]^T on bfloat16 x and W with AMX tiles (TDPBF16PS: exact bf16 products,
// float32 sums), W prepacked in the tile layout (layers/amx_head.py). Concatenated after bf16_gemm_avx512.h and
// before bf16_ops_cpu.cpp.
//
// Why: an output head's float32 logits of many rows. oneDNN has no bf16 GEMM with float32 results; its float32
// GEMM in bf16 math mode runs on tiles but reads a float32 copy of the weight, twice the bytes, and a decode
// step's head is bound by those bytes.
//
// Layout: W [N, K] -> tiles of 16 columns x 32 k-values (1 KiB each), [N / 16][Kp / 32][16 k-pairs][16 columns][2]
// (the VNNI pairs TDPBF16PS takes as its B operand), K zero-padded to Kp. x is copied into rows of Kp values
// (zero-padded), M padded to a multiple of 32.
//
// Invariant (batch-invariance): each output is the same sum in the same order whatever M, the blocking or the
// threads: k in 32-value steps, in order, each step one TDPBF16PS into the output's float32 lane.
// Built with target attributes; amx_bf16_usable() says at run time whether the CPU has the instructions and
// Linux granted the process the tile state.
#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>

#define KVP_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

namespace {

constexpr int64_t kAmxTileCols = 16;     // output columns of a B tile
constexpr int64_t kAmxTileK = 32;        // bf16 k-values of an A row / a B tile (64 bytes a row)
constexpr int64_t kAmxTileElems = 512;   // bf16 values in one packed B tile
constexpr int64_t kAmxBlockRows = 32;    // x rows per pass: two A tiles
constexpr int64_t kAmxBlockCols = 32;    // output columns per pass: two B tiles
constexpr int64_t kAmxChunkRows = 64;    // x rows per sweep over the weight (more ran slower than two sweeps)

inline bool amx_bf16_usable() {
  static const bool usable = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
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

// Tiles 0-3 accumulate a 32 x 32 block of outputs (two row halves x two column halves), 4-5 hold x's two 16-row
// halves, 6-7 the weight's two 16-column tiles: each 16 rows of 64 bytes.
KVP_AMX inline void amx_configure() {
  AmxTileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// One pass: outputs of x rows [m0, m0 + 32) and columns [32 nb, 32 nb + 32) into `dst` (row stride dst_stride floats).
KVP_AMX inline void amx_block(const uint16_t* xp, int64_t Kp, const uint16_t* wp, int64_t ksteps, int64_t m0,
                              int64_t nb, float* dst, int64_t dst_stride) {
  const uint16_t* b0 = wp + (2 * nb) * ksteps * kAmxTileElems;
  const uint16_t* b1 = b0 + ksteps * kAmxTileElems;
  const uint16_t* a0 = xp + m0 * Kp;
  const uint16_t* a1 = a0 + 16 * Kp;
  _tile_zero(0);
  _tile_zero(1);
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
  const int64_t bytes = dst_stride * 4;
  _tile_stored(0, dst, bytes);
  _tile_stored(1, dst + 16, bytes);
  _tile_stored(2, dst + 16 * dst_stride, bytes);
  _tile_stored(3, dst + 16 * dst_stride + 16, bytes);
}

// Column blocks [nb0, nb1) of out [M, N] (N a multiple of 32) from padded x [Mp, Kp] and the packed weight. Rows of
// a full 32-row pass are stored into `out` directly, the last partial pass through a scratch block.
KVP_AMX void amx_gemm_blocks(const uint16_t* xp, int64_t M, int64_t Mp, int64_t Kp, const uint16_t* wp, float* out,
                             int64_t N, int64_t nb0, int64_t nb1) {
  amx_configure();
  alignas(64) float scratch[kAmxBlockRows * kAmxBlockCols];
  const int64_t ksteps = Kp / kAmxTileK;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t m0 = 0; m0 < Mp; m0 += kAmxBlockRows) {
      if (m0 + kAmxBlockRows <= M) {
        amx_block(xp, Kp, wp, ksteps, m0, nb, out + m0 * N + nb * kAmxBlockCols, N);
        continue;
      }
      amx_block(xp, Kp, wp, ksteps, m0, nb, scratch, kAmxBlockCols);
      for (int64_t r = 0; r < M - m0; ++r) {
        std::copy(scratch + r * kAmxBlockCols, scratch + (r + 1) * kAmxBlockCols,
                  out + (m0 + r) * N + nb * kAmxBlockCols);
      }
    }
  }
  _tile_release();
}

}  // namespace

#else
namespace {
inline bool amx_bf16_usable() { return false; }
}  // namespace
#endif

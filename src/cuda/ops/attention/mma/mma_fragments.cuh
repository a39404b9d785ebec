// Warp-level bf16 tensor-core primitives of the attention kernels (mma_bf16, decode_mma; sm_80+):
// the shared-memory layout of 512-channel bf16 rows, ldmatrix loads of the m16n8k16 fragments from
// it and the MMA (the copies themselves: common/async_copy.cuh). PTX fragment layouts (lane l, g = l / 4, c = l % 4; pairs are packed low index first):
//   A 16x16 (row major)  a[0]: (g, 2c..2c+1)   a[1]: (g+8, 2c..)   a[2]: (g, 2c+8..)   a[3]: (g+8, 2c+8..)
//   B 16x8  (k x n)      b[0]: (k 2c..2c+1, n g)                   b[1]: (k 2c+8.., n g)
//   C 16x8  (f32)        c[0..1]: (g, 2c..2c+1)                    c[2..3]: (g+8, 2c..2c+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/async_copy.cuh"

namespace dsv4::cuda::mma {

inline constexpr int kRowChannels = 512;
inline constexpr int kRowBytes = kRowChannels * 2;

// Byte offset of channel `col` (a multiple of 8) of row `row` in a tile of 512-channel bf16 rows:
// the 16-byte chunk c of row r sits at chunk c ^ (r % 8), so that the 8 row addresses of an
// ldmatrix (8 consecutive rows, one chunk) and the chunk stores of a row fall on 8 different
// groups of 4 banks.
__device__ __forceinline__ uint32_t tile_offset(int row, int col) {
  return static_cast<uint32_t>(row * kRowBytes + ((((col >> 3) ^ (row & 7))) << 4));
}

// d += a·b, bf16 inputs, f32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of rows row0 … row0+15, channels col0 … col0+15 of a tile (row major: heads x
// channels). Lane l addresses row (l % 8) + 8·((l / 8) % 2), channel 8·(l / 16): matrices 0-3 are
// a[0]-a[3].
__device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t tile, int row0, int col0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldmatrix_x4(a, tile + tile_offset(row0 + r + (i & 1) * 8, col0 + (i >> 1) * 8));
}

// B fragments of S = A·Kᵀ for the keys row0 … row0+15 (two n tiles of 8) over channels
// col0 … col0+15, from a tile of key rows (n x k). Lane l addresses key row (l % 8) + 8·(l / 16),
// channel 8·((l / 8) % 2): b[0], b[1] are the first n tile's, b[2], b[3] the second's.
__device__ __forceinline__ void load_b_keys(uint32_t (&b)[4], uint32_t tile, int row0, int col0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldmatrix_x4(b, tile + tile_offset(row0 + r + (i >> 1) * 8, col0 + (i & 1) * 8));
}

// B fragments of O = P·V for the value rows row0 … row0+15 (k) and channels col0 … col0+15 (two
// n tiles of 8), from the same tile of rows (k x n, transposed on load). Lane l addresses row
// (l % 8) + 8·((l / 8) % 2), channel 8·(l / 16): b[0], b[1] are the first n tile's, b[2], b[3] the
// second's.
__device__ __forceinline__ void load_b_values(uint32_t (&b)[4], uint32_t tile, int row0, int col0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldmatrix_x4_trans(b, tile + tile_offset(row0 + r + (i & 1) * 8, col0 + (i >> 1) * 8));
}

// Two floats as a bf16 pair (rounded to nearest even, as float_to_bf16_bits rounds; a NaN may
// come out with another payload), the first in the low half: one cvt.rn.bf16x2.f32, which the
// exp-scores of every tile go through.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The A fragment of the k step kk (columns 16·kk … 16·kk+15) of a 16-row matrix held as C
// fragments s[n tile][4] (n tiles 2·kk and 2·kk+1), rounded to bf16: how P feeds P·V.
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

// Every A fragment of such a matrix (s[n tile][4], 16 rows x 8·kTiles columns), element by element:
// emit(kk, e, pair) for element e of k step kk, where a kernel stores P rather than feeding it.
template <int kTiles, class Emit>
__device__ __forceinline__ void for_each_a_fragment(const float (&s)[kTiles][4], Emit&& emit) {
#pragma unroll
  for (int kk = 0; kk < kTiles / 2; ++kk) {
    uint32_t a[4];
    a_from_c(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
    for (int e = 0; e < 4; ++e) emit(kk, e, a[e]);
  }
}

// S = Q·Kᵀ of a warp (s overwritten): its 16 query rows from q_row0 of q_tile against the
// 8·kScoreTiles key rows of `tile`, over the channels col0 … col0 + kChannels − 1.
template <int kScoreTiles, int kChannels>
__device__ __forceinline__ void warp_scores(float (&s)[kScoreTiles][4], uint32_t q_tile, int q_row0, uint32_t tile,
                                            int col0, int lane) {
#pragma unroll
  for (int j = 0; j < kScoreTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll 4
  for (int k = 0; k < kChannels / 16; ++k) {
    const int col = col0 + k * 16;
    uint32_t qa[4];
    load_a(qa, q_tile, q_row0, col, lane);
#pragma unroll
    for (int n = 0; n < kScoreTiles / 2; ++n) {
      uint32_t kb[4];
      load_b_keys(kb, tile, n * 16, col, lane);
      mma_bf16(s[2 * n], qa, kb[0], kb[1]);
      mma_bf16(s[2 * n + 1], qa, kb[2], kb[3]);
    }
  }
}

// O += P·V of a warp: P its exp-scores s over the 8·kScoreTiles value rows of `tile` (rounded to
// bf16 here), V their channels col0 … col0 + 8·kOutTiles − 1.
template <int kScoreTiles, int kOutTiles>
__device__ __forceinline__ void warp_accumulate_values(float (&acc)[kOutTiles][4], const float (&s)[kScoreTiles][4],
                                                       uint32_t tile, int col0, int lane) {
#pragma unroll
  for (int k = 0; k < kScoreTiles / 2; ++k) {
    uint32_t pa[4];
    a_from_c(pa, s[2 * k], s[2 * k + 1]);
#pragma unroll
    for (int n = 0; n < kOutTiles / 2; ++n) {
      uint32_t vb[4];
      load_b_values(vb, tile, k * 16, col0 + n * 16, lane);
      mma_bf16(acc[2 * n], pa, vb[0], vb[1]);
      mma_bf16(acc[2 * n + 1], pa, vb[2], vb[3]);
    }
  }
}

}  // namespace dsv4::cuda::mma

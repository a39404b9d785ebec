// The tensor-core sparse MQA attention kernel (see include/dsv4/cuda/attention.h), warp-level
// mma.sync m16n8k16 bf16 -> f32 (sm_80+), for reference precision: the exp-scores P are bf16 on
// the tensor cores, which is bf16_rounding.
//
// One block per (token, 64 heads, split of rows); 8 warps = 4 groups of 16 heads x 2 halves of the
// 512 channels. Shared memory: Q [64 heads][512] bf16, two stages of 64 rows [64][512] bf16 (K = V:
// the same rows serve Q·Kᵀ and P·V, the latter through ldmatrix.trans), all with 16-byte chunks
// XOR-swizzled (mma_fragments.h). Per tile of 64 rows (window rows, then picks, as the SIMT kernel
// orders them), while the next tile is gathered into the other stage (cp.async for bf16 rows,
// 8-byte loads and an exact decode to bf16 for quantized rows):
//   * each warp computes its 16 heads' scores over its 256 channels, the two warps of a head group
//     exchange them through shared memory and both add lower + upper half (the same bits in both);
//   * both run the same online softmax in fp32 (exp2 with scale·log2(e) folded; invalid rows -inf),
//     the row sum of the unrounded exp-scores, the exp-scores rounded to bf16 for P·V;
//   * each warp accumulates P·V for its 256 channels in f32 registers (16 x 256 per warp).
// The sink enters only the final denominator; split blocks write their unnormalized P·V and
// (max, sum) for run_split_kv_combine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/attention/mma/attention_tile_math.cuh"
#include "cuda/ops/attention/mma/mma_fragments.cuh"
#include "cuda/ops/attention/sparse_attention_launch.cuh"

namespace dsv4::cuda {

inline constexpr int kMmaWarps = 8;
inline constexpr int kMmaThreads = kMmaWarps * kWarpSize;
inline constexpr int kMmaHeadsPerBlock = 64;
inline constexpr int kMmaHeadsPerWarp = 16;
inline constexpr int kMmaTileRows = 64;
inline constexpr int kMmaStages = 2;
inline constexpr int kMmaHeadDim = mma::kRowChannels;
inline constexpr int kMmaWarpChannels = kMmaHeadDim / 2;  // the channels of a warp's half
inline constexpr int kMmaScoreTiles = kMmaTileRows / 8;    // n tiles of a 16 x 64 score block
inline constexpr int kMmaOutTiles = kMmaWarpChannels / 8;  // n tiles of a warp's 16 x 256 output

// Shared memory: Q, the stages, each warp's score partial (C fragments: 32 floats per lane), the
// stages' row refs and valid-row masks.
constexpr size_t kMmaTileBytes = size_t{kMmaTileRows} * mma::kRowBytes;
constexpr size_t kMmaQBytes = size_t{kMmaHeadsPerBlock} * mma::kRowBytes;
constexpr size_t kMmaExchangeFloats = size_t{kMmaScoreTiles} * 4 * kWarpSize;  // per warp
constexpr size_t kMmaSharedBytes = kMmaQBytes + kMmaStages * kMmaTileBytes +
                                   kMmaWarps * kMmaExchangeFloats * sizeof(float) +
                                   kMmaStages * kMmaTileRows * sizeof(RowRef) + kMmaStages * 2 * sizeof(uint32_t);

namespace mma_attention {

// Rows [first, last) of a tile from `cache` into the tile as bf16 (zeros for invalid refs).
template <KvRowFormat F>
__device__ __forceinline__ void gather_rows(const DeviceRows& cache, const RowRef* refs, int first, int last,
                                            uint8_t* tile) {
  if constexpr (F == KvRowFormat::bf16) {
    constexpr int kChunks = kMmaHeadDim / 8;  // 16-byte chunks per row
    for (int item = first * kChunks + threadIdx.x; item < last * kChunks; item += kMmaThreads) {
      const int r = item / kChunks, chunk = item % kChunks;
      const RowRef ref = refs[r];
      uint8_t* dst = tile + mma::tile_offset(r, chunk * 8);
      if (ref.valid()) cp_async<16>(shared_address(dst), ref.data + chunk * 16);
      else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  } else {
    // Work items of 16 channels; the decoded values are exact in bf16 (supports() admits only
    // such formats), so the conversion below does not round.
    constexpr int kItems = kMmaHeadDim / 16;
#pragma unroll 2
    for (int item = first * kItems + threadIdx.x; item < last * kItems; item += kMmaThreads) {
      const int r = item / kItems, c0 = (item % kItems) * 16;
      float v[16];
      decode_chunk16_or_zeros<F>(cache, refs[r], c0, v);
      *reinterpret_cast<uint4*>(tile + mma::tile_offset(r, c0)) =
          make_uint4(mma::pack_bf16(v[0], v[1]), mma::pack_bf16(v[2], v[3]), mma::pack_bf16(v[4], v[5]),
                     mma::pack_bf16(v[6], v[7]));
      *reinterpret_cast<uint4*>(tile + mma::tile_offset(r, c0 + 8)) =
          make_uint4(mma::pack_bf16(v[8], v[9]), mma::pack_bf16(v[10], v[11]), mma::pack_bf16(v[12], v[13]),
                     mma::pack_bf16(v[14], v[15]));
    }
  }
}

// Waits for the other warp of the head group (named barrier 1 + group; 0 is __syncthreads').
__device__ __forceinline__ void pair_barrier(int head_group) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + head_group), "r"(2 * kWarpSize) : "memory");
}

}  // namespace mma_attention

template <class Out>
__global__ void __launch_bounds__(kMmaThreads, 1) sparse_attention_mma_kernel(SparseAttentionLaunch a) {
  extern __shared__ __align__(128) uint8_t shared[];
  uint8_t* const q_tile = shared;
  uint8_t* const kv_tiles = q_tile + kMmaQBytes;  // [stage][row][512] bf16
  float* const exchange = reinterpret_cast<float*>(kv_tiles + kMmaStages * kMmaTileBytes);  // [warp][32][lane]
  RowRef* const refs = reinterpret_cast<RowRef*>(exchange + kMmaWarps * kMmaExchangeFloats);  // [stage][row]
  uint32_t* const valid = reinterpret_cast<uint32_t*>(refs + kMmaStages * kMmaTileRows);      // [stage][2]

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int head_group = warp % 4, half = warp / 4;
  const int head0 = static_cast<int>(blockIdx.y) * kMmaHeadsPerBlock;
  const bool computes = head0 + head_group * kMmaHeadsPerWarp < a.heads;  // the same for both warps of a group
  const TokenRows rows(a, t);

  // Q of the block's heads (zeros beyond a.heads), completed with the first tile.
  const uint32_t q_address = shared_address(q_tile);
  for (int item = threadIdx.x; item < kMmaHeadsPerBlock * (kMmaHeadDim / 8); item += kMmaThreads) {
    const int h = item / (kMmaHeadDim / 8), chunk = item % (kMmaHeadDim / 8);
    uint8_t* dst = q_tile + mma::tile_offset(h, chunk * 8);
    if (head0 + h < a.heads) cp_async<16>(shared_address(dst), a.q + ((t * a.heads + head0 + h) * kMmaHeadDim + chunk * 8));
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }

  const int64_t first_row = int64_t{blockIdx.z} * a.tiles_per_split * kMmaTileRows;
  const int64_t end_row = min(rows.n_rows, first_row + a.tiles_per_split * kMmaTileRows);
  // Refs and valid masks of the tile at `base`, then its rows into the stage.
  auto load_tile = [&](int64_t base, int stage) {
    RowRef* tile_refs = refs + stage * kMmaTileRows;
    if (threadIdx.x < kMmaTileRows) {  // warps 0 and 1
      const RowRef ref = rows.row(a, t, base + threadIdx.x, end_row);
      tile_refs[threadIdx.x] = ref;
      const uint32_t ballot = __ballot_sync(kFullMask, ref.valid());
      if (lane == 0) valid[stage * 2 + warp] = ballot;
    }
    __syncthreads();
    uint8_t* tile = kv_tiles + stage * kMmaTileBytes;
    const int split = rows.window_rows_in_tile(base, kMmaTileRows);  // window rows [0, split), then picks
    if (split > 0)
      visit_format(a.window.format, [&](auto format) {
        mma_attention::gather_rows<decltype(format)::value>(a.window, tile_refs, 0, split, tile);
      });
    if (split < kMmaTileRows && a.picks)
      visit_format(a.compressed.format, [&](auto format) {
        mma_attention::gather_rows<decltype(format)::value>(a.compressed, tile_refs, split, kMmaTileRows, tile);
      });
    else if (split < kMmaTileRows)  // window only: the rest of the tile is zeros
      for (int item = split * (kMmaHeadDim / 8) + threadIdx.x; item < kMmaTileRows * (kMmaHeadDim / 8); item += kMmaThreads)
        *reinterpret_cast<uint4*>(tile + mma::tile_offset(item / (kMmaHeadDim / 8), (item % (kMmaHeadDim / 8)) * 8)) =
            make_uint4(0, 0, 0, 0);
  };

  mma::SoftmaxState softmax(a, head0 + head_group * kMmaHeadsPerWarp, a.heads, lane);
  float acc[kMmaOutTiles][4];
#pragma unroll
  for (int j = 0; j < kMmaOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const float scale_log2 = a.scale * kLog2e;

  if (first_row < end_row) load_tile(first_row, 0);
  cp_async_wait_all();
  __syncthreads();
  int stage = 0;
  for (int64_t base = first_row; base < end_row; base += kMmaTileRows, stage ^= 1) {
    if (base + kMmaTileRows < end_row) load_tile(base + kMmaTileRows, stage ^ 1);
    if (computes) {
      const uint32_t tile = shared_address(kv_tiles + stage * kMmaTileBytes);
      // Scores of the warp's 16 heads x 64 rows over its 256 channels, then both halves'.
      float s[kMmaScoreTiles][4];
      mma::warp_scores<kMmaScoreTiles, kMmaWarpChannels>(s, q_address, head_group * kMmaHeadsPerWarp, tile,
                                                         half * kMmaWarpChannels, lane);
      mma::add_partner_scores(s, exchange + warp * kMmaExchangeFloats, exchange + (warp ^ 4) * kMmaExchangeFloats, lane,
                              [&] { mma_attention::pair_barrier(head_group); });

      // Online softmax (the lane holds heads g and g + 8), then the accumulators rescaled.
      float correction[2];
      const uint64_t valid_rows = uint64_t{valid[stage * 2]} | (uint64_t{valid[stage * 2 + 1]} << 32);
      mma::online_softmax(s, valid_rows, scale_log2, lane, softmax, correction);
      mma::rescale(acc, correction);
      // P·V over the tile's rows, P rounded to bf16 (the sums above keep it unrounded).
      mma::warp_accumulate_values(acc, s, tile, half * kMmaWarpChannels, lane);
    }
    cp_async_wait_all();
    __syncthreads();  // the next tile is in, this one consumed
  }
  if (!computes) return;

  mma::write_output<Out, kMmaOutTiles, kMmaHeadDim>(a, t, head0 + head_group * kMmaHeadsPerWarp,
                                                    half * kMmaWarpChannels, half == 0, lane, acc, softmax);
}

// Out: uint16_t (bf16 bits) or float. With splits > 1 the caller runs the combine afterwards.
template <class Out>
void launch_sparse_attention_mma(const SparseAttentionLaunch& a, cudaStream_t stream) {
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_mma_kernel<Out>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kMmaSharedBytes)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.heads + kMmaHeadsPerBlock - 1) / kMmaHeadsPerBlock),
                  static_cast<unsigned>(a.splits));
  sparse_attention_mma_kernel<Out><<<grid, kMmaThreads, kMmaSharedBytes, stream>>>(a);
}

}  // namespace dsv4::cuda

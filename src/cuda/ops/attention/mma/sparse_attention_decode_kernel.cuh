// The warp-specialized tensor-core sparse MQA attention kernel ("decode_mma", see
// include/dsv4/cuda/attention.h): mma.sync m16n8k16 bf16 -> f32 like mma_bf16, for reference
// precision (bf16_rounding: the exp-scores P are bf16 on the tensor cores), with the gather and
// decode of the rows taken off the tensor-core warps so that they overlap the MMAs.
//
// One block per (token, 64 heads, split of rows), 12 warps in two roles:
//   * 4 loader warps gather the raw bytes of each tile of 32 rows (window rows, then picks, as
//     TokenRows orders them) with 8-byte cp.async into a ring of two raw stages (any format: the
//     row's data bytes, then its scale bytes), one tile ahead of the decode (the picks three tiles
//     ahead, the block-table lookups two, so that no load waits for another); then decode a landed
//     tile exactly to bf16 (e4m3 codes times ue8m0 scales, e2m1 codes times e4m3 scales, bf16
//     copied) into one of two bf16 stages, zeros for invalid rows.
//   * 8 MMA warps = 4 groups of 16 heads x 2 halves of the 512 channels, as in mma_bf16: scores of
//     their 16 heads over their 256 channels, the two halves summed through shared memory (both
//     get the same bits), the online softmax in fp32 in both, P·V for their 256 channels with P
//     rounded to bf16, the row sums unrounded.
// The roles hand the bf16 stages over with named barriers (bar.arrive by the producer, bar.sync by
// the consumer): kFull (a decoded stage is ready) and kEmpty (the MMA warps are done with it).
// Nothing depends on the other tokens of the step; split blocks write their unnormalized P·V and
// (max, sum) for run_split_kv_combine, which merges them in a fixed order.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cache/row_codec.h"
#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/common/warp_roles.cuh"
#include "cuda/ops/attention/mma/attention_tile_math.cuh"
#include "cuda/ops/attention/mma/mma_fragments.cuh"
#include "cuda/ops/attention/row_decode.cuh"
#include "cuda/ops/attention/sparse_attention_launch.cuh"
#include "dsv4/error.h"

namespace dsv4::cuda {

namespace decode_mma {

inline constexpr int kMmaWarps = 8;
inline constexpr int kLoaderWarps = 4;  // one warpgroup
inline constexpr int kMmaThreads = kMmaWarps * kWarpSize;
inline constexpr int kLoaderThreads = kLoaderWarps * kWarpSize;
inline constexpr int kThreads = kMmaThreads + kLoaderThreads;
inline constexpr int kHeadsPerBlock = 64;
inline constexpr int kHeadsPerWarp = 16;
inline constexpr int kTileRows = 32;  // one ballot of valid rows
inline constexpr int kHeadDim = mma::kRowChannels;
inline constexpr int kWarpChannels = kHeadDim / 2;
inline constexpr int kScoreTiles = kTileRows / 8;      // n tiles of a 16 x 32 score block
inline constexpr int kOutTiles = kWarpChannels / 8;    // n tiles of a warp's 16 x 256 output
inline constexpr int kRawRowBytes = mma::kRowBytes;    // the largest row (bf16) fits a raw slot
inline constexpr int kExchangeFloats = kScoreTiles * 4 * kWarpSize;  // a warp's score partial

constexpr size_t kQBytes = size_t{kHeadsPerBlock} * mma::kRowBytes;
constexpr size_t kTileBytes = size_t{kTileRows} * mma::kRowBytes;
constexpr size_t kRawStageBytes = size_t{kTileRows} * kRawRowBytes;
// Q, two bf16 stages, two raw stages, the score exchange (double-buffered: a warp may write the
// next tile's partial while its partner still reads this one's), the bf16 stages' valid masks.
constexpr size_t kSharedBytes = kQBytes + 2 * kTileBytes + 2 * kRawStageBytes +
                                2 * size_t{kMmaWarps} * kExchangeFloats * sizeof(float) + 2 * sizeof(uint32_t);

// Named barriers (0 is __syncthreads', unused): the pairs of MMA warps of a head group, the
// stages' full and empty barriers, the loader warps, the MMA warps.
inline constexpr int kPairBarrier = 1;  // + head group (4)
inline constexpr int kFullBarrier = 5;  // + stage (2)
inline constexpr int kEmptyBarrier = 7;  // + stage (2)
inline constexpr int kLoaderBarrier = 9;
inline constexpr int kMmaBarrier = 10;

// Hopper moves registers between the roles (setmaxnreg, sm_90a): the loaders need few, the MMA
// warps hold 128 accumulators each. The 12 warps start with 168 (65536 / 384, what
// __launch_bounds__ gives); 4 x (168 - 56) freed = 8 x (224 - 168) taken. setmaxnreg.inc waits
// until the block's own warps have freed enough, so the launch checks the 168.
inline constexpr int kLaunchRegisters = 168;
inline constexpr int kLoaderRegisters = 56;
inline constexpr int kMmaRegisters = 224;
static_assert(kLaunchRegisters * kThreads <= 65536);
static_assert(kLoaderRegisters * kLoaderThreads + kMmaRegisters * kMmaThreads <= kLaunchRegisters * kThreads);

}  // namespace decode_mma

template <class Out>
__global__ void __launch_bounds__(decode_mma::kThreads, 1) sparse_attention_decode_kernel(SparseAttentionLaunch a) {
  using namespace decode_mma;
  using namespace row_decode;
  extern __shared__ __align__(128) uint8_t shared[];
  uint8_t* const q_tile = shared;
  uint8_t* const tiles = q_tile + kQBytes;         // [stage][row][512] bf16, swizzled
  uint8_t* const raw = tiles + 2 * kTileBytes;     // [stage][row][kRawRowBytes]
  float* const exchange = reinterpret_cast<float*>(raw + 2 * kRawStageBytes);  // [parity][warp][32][lane]
  uint32_t* const tile_valid = reinterpret_cast<uint32_t*>(exchange + 2 * kMmaWarps * kExchangeFloats);  // [stage]

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int head0 = static_cast<int>(blockIdx.y) * kHeadsPerBlock;
  const TokenRows rows(a, t);
  const TokenRows::BlockRows block = rows.block_rows(a, kTileRows);
  const int64_t first_row = block.first, end_row = block.end;
  const int n_tiles = block.n_tiles;

  if (warp >= kMmaWarps) {
    release_registers<kLoaderRegisters>();
    const int loader_thread = threadIdx.x - kMmaThreads, loader_warp = loader_thread / kWarpSize;
    const RawLayout window_layout(a.window.format), compressed_layout(a.compressed.format);
    // Lane l of every loader warp follows row l of the tiles ahead, each step's global loads used
    // only an iteration later: the row number of tile i + 3 (the pick), the bytes of tile i + 2 (the
    // block table), the copies of tile i + 1 (cp.async), the decode of tile i.
    auto row_number = [&](int i) {
      return rows.row_number(a, t, first_row + int64_t{i} * kTileRows + lane, end_row);
    };
    auto row_of_number = [&](int i, int64_t number) {
      return rows.row_of_number(a, first_row + int64_t{i} * kTileRows + lane, number);
    };
    // Requests the rows of tile i (refs: lane = row) into raw stage i % 2, one cp.async group;
    // every loader warp copies every fourth row. Returns the tile's valid rows.
    auto request = [&](int i, const RowRef& ref) {
      const uint32_t valid = __ballot_sync(kFullMask, ref.valid());
      const int window_rows = rows.window_rows_in_tile(first_row + int64_t{i} * kTileRows, kTileRows);
      const uint32_t stage_address = shared_address(raw + (i % 2) * kRawStageBytes);
      for (int r = loader_warp; r < kTileRows; r += kLoaderWarps) {
        if (!((valid >> r) & 1)) continue;
        const uint8_t* data = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.data), r));
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.scales), r));
        const int data_chunks = r < window_rows ? window_layout.data_chunks : compressed_layout.data_chunks;
        const int chunks = r < window_rows ? window_layout.chunks : compressed_layout.chunks;
        for (int c = lane; c < chunks; c += kWarpSize)
          cp_async<8>(stage_address + r * kRawRowBytes + 8 * c, c < data_chunks ? data + 8 * c : scales + 8 * (c - data_chunks));
      }
      cp_async_commit();
      return valid;
    };
    uint32_t valid = 0;
    RowRef next_ref;          // tile i + 1
    int64_t after_next = -1;  // the row number of tile i + 2
    if (n_tiles > 0) {
      valid = request(0, row_of_number(0, row_number(0)));
      next_ref = row_of_number(1, row_number(1));
      after_next = row_number(2);
    }
    for (int i = 0; i < n_tiles; ++i) {
      const int stage = i % 2;
      uint32_t next_valid = 0;
      if (i + 1 < n_tiles) next_valid = request(i + 1, next_ref);
      else cp_async_commit();  // an empty group: the wait below then always means tile i
      next_ref = row_of_number(i + 2, after_next);
      after_next = row_number(i + 3);
      cp_async_wait<1>();
      barrier_sync(kLoaderBarrier, kLoaderThreads);  // every loader's bytes of tile i have landed
      if (i >= 2) barrier_sync(kEmptyBarrier + stage, kThreads);  // the MMA warps are done with tile i - 2
      // Decode: a warp per row, a lane per 16 channels (two 16-byte chunks). Lanes 4-7 of each
      // quarter warp store their upper chunk first, so that the 8 stores of a quarter warp fall on
      // 8 different groups of banks.
      const int window_rows = rows.window_rows_in_tile(first_row + int64_t{i} * kTileRows, kTileRows);
      uint8_t* const tile = tiles + stage * kTileBytes;
      const uint8_t* const raw_stage = raw + stage * kRawStageBytes;
      const int c0 = lane * 16, upper_first = (lane >> 2) & 1;
      for (int r = loader_warp; r < kTileRows; r += kLoaderWarps) {
        uint4 first = make_uint4(0, 0, 0, 0), second = first;
        if ((valid >> r) & 1)
          decode16(r < window_rows ? a.window.format : a.compressed.format, raw_stage + r * kRawRowBytes, c0,
                   upper_first, first, second);
        *reinterpret_cast<uint4*>(tile + mma::tile_offset(r, c0 + 8 * upper_first)) = first;
        *reinterpret_cast<uint4*>(tile + mma::tile_offset(r, c0 + 8 * (upper_first ^ 1))) = second;
      }
      if (loader_thread == 0) tile_valid[stage] = valid;
      barrier_arrive(kFullBarrier + stage, kThreads);
      barrier_sync(kLoaderBarrier, kLoaderThreads);  // raw stage `stage` is free for tile i + 2
      valid = next_valid;
    }
    return;
  }

  // MMA warps.
  claim_registers<kMmaRegisters>();
  const int head_group = warp % 4, half = warp / 4;
  const bool computes = head0 + head_group * kHeadsPerWarp < a.heads;  // the same for both warps of a group
  const uint32_t q_address = shared_address(q_tile);
  for (int item = threadIdx.x; item < kHeadsPerBlock * (kHeadDim / 8); item += kMmaThreads) {
    const int h = item / (kHeadDim / 8), chunk = item % (kHeadDim / 8);
    uint8_t* dst = q_tile + mma::tile_offset(h, chunk * 8);
    if (head0 + h < a.heads) cp_async<16>(shared_address(dst), a.q + ((t * a.heads + head0 + h) * kHeadDim + chunk * 8));
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  cp_async_wait_all();
  barrier_sync(kMmaBarrier, kMmaThreads);

  mma::SoftmaxState softmax(a, head0 + head_group * kHeadsPerWarp, a.heads, lane);
  float acc[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const float scale_log2 = a.scale * kLog2e;

  for (int i = 0; i < n_tiles; ++i) {
    const int stage = i % 2;
    barrier_sync(kFullBarrier + stage, kThreads);
    if (computes) {
      const uint32_t tile = shared_address(tiles + stage * kTileBytes);
      // Scores of the warp's 16 heads x 32 rows over its 256 channels, then both halves'.
      float s[kScoreTiles][4];
      mma::warp_scores<kScoreTiles, kWarpChannels>(s, q_address, head_group * kHeadsPerWarp, tile, half * kWarpChannels, lane);
      mma::add_partner_scores(s, exchange + ((i % 2) * kMmaWarps + warp) * kExchangeFloats,
                              exchange + ((i % 2) * kMmaWarps + (warp ^ 4)) * kExchangeFloats, lane,
                              [&] { barrier_sync(kPairBarrier + head_group, 2 * kWarpSize); });

      // Online softmax (the lane holds heads g and g + 8), then the accumulators rescaled.
      float correction[2];
      const uint32_t valid_rows = tile_valid[stage];
      mma::online_softmax(s, valid_rows, scale_log2, lane, softmax, correction);
      mma::rescale(acc, correction);
      // P·V over the tile's rows, P rounded to bf16 (the sums above keep it unrounded).
      mma::warp_accumulate_values(acc, s, tile, half * kWarpChannels, lane);
    }
    if (i + 2 < n_tiles) barrier_arrive(kEmptyBarrier + stage, kThreads);  // the loaders wait for it at tile i + 2
  }
  if (!computes) return;

  mma::write_output<Out, kOutTiles, kHeadDim>(a, t, head0 + head_group * kHeadsPerWarp, half * kWarpChannels,
                                              half == 0, lane, acc, softmax);
}

// Out: uint16_t (bf16 bits) or float; tiles_per_split in tiles of decode_mma::kTileRows rows. With
// splits > 1 the caller runs the combine afterwards.
template <class Out>
void launch_sparse_attention_decode(const SparseAttentionLaunch& a, cudaStream_t stream) {
  static const int registers = [] {
    cudaFuncAttributes attributes{};
    DSV4_CUDA_CHECK(cudaFuncGetAttributes(&attributes, sparse_attention_decode_kernel<Out>));
    return attributes.numRegs;
  }();
  DSV4_CHECK(registers == decode_mma::kLaunchRegisters, "sparse_attention (decode_mma): the kernel has ", registers,
             " registers per thread, its register hand-over (setmaxnreg) expects ", decode_mma::kLaunchRegisters);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_decode_kernel<Out>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(decode_mma::kSharedBytes)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.heads + decode_mma::kHeadsPerBlock - 1) / decode_mma::kHeadsPerBlock),
                  static_cast<unsigned>(a.splits));
  sparse_attention_decode_kernel<Out><<<grid, decode_mma::kThreads, decode_mma::kSharedBytes, stream>>>(a);
}

}  // namespace dsv4::cuda

// The Hopper warpgroup-MMA sparse MQA attention kernel ("wgmma", see include/dsv4/cuda/attention.h),
// for reference precision (bf16_rounding: the exp-scores P are bf16 on the tensor cores) over the
// quantized cache rows (v41_fp8, v41_fp4, fp8_ds_mla), decode steps and prefill chunks alike.
//
// One block per (token, 64 heads, split of rows), three warpgroups:
//   * the producer warpgroup gathers the raw bytes of the rows (window rows, then picks, as
//     TokenRows orders them) with 8-byte cp.async into a ring of three 16-row slots, two slots
//     ahead of the decode (the pick and block-table loads of later slots one and two iterations
//     earlier, so that no load waits for another), and decodes each landed slot exactly to bf16
//     (row_decode.cuh) into one of two 64-row tiles in the SW128 layout the MMAs read (zeros for
//     invalid rows). Warp w of the producer copies and decodes rows 4w … 4w + 3 of every slot, so
//     a warp waits only for its own copies.
//   * two consumer warpgroups, one per half of the 512 output channels: each computes the scores
//     of all 64 heads over the tile's 64 rows (32 SS wgmma m64n64k16, Q and the tile both in shared
//     memory; the two get the same bits), the online softmax in fp32, and P·V for its 256 channels
//     (4 RS wgmma m64n256k16, P rounded to bf16 in registers, the row sums unrounded).
// The roles hand the tiles over with named barriers (bar.arrive by the producer, bar.sync by the
// consumers): kFull (a decoded tile is ready) and kEmpty (both consumers are done with it).
// Nothing depends on the other tokens of the step; split blocks write their unnormalized P·V and
// (max, sum) for run_split_kv_combine, which merges them in a fixed order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/common/warp_roles.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/ops/attention/mma/attention_tile_math.cuh"
#include "cuda/ops/attention/row_decode.cuh"
#include "cuda/ops/attention/sparse_attention_launch.cuh"
#include "dsv4/error.h"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

namespace attention_wgmma {

inline constexpr int kHeadDim = mma::kRowChannels;
inline constexpr int kHeadsPerBlock = 64;  // one wgmma M
inline constexpr int kTileRows = 64;       // one wgmma N of the scores
inline constexpr int kSlotRows = 16;       // rows of one raw-ring slot
inline constexpr int kSlotsPerTile = kTileRows / kSlotRows;
inline constexpr int kRowsPerProducerWarp = kSlotRows / 4;
inline constexpr int kConsumerThreads = 256;
inline constexpr int kProducerThreads = 128;
inline constexpr int kThreads = kConsumerThreads + kProducerThreads;
inline constexpr int kHalfChannels = kHeadDim / 2;
inline constexpr int kScoreTiles = kTileRows / 8;   // n tiles of 8 of the 64 x 64 scores
inline constexpr int kOutTiles = kHalfChannels / 8;  // n tiles of 8 of a consumer's 64 x 256 output
inline constexpr int kQkSteps = kHeadDim / 16;
inline constexpr int kPvSteps = kTileRows / 16;

constexpr size_t kQBytes = size_t{kHeadsPerBlock} * mma::kRowBytes;
constexpr size_t kTileBytes = size_t{kTileRows} * mma::kRowBytes;
constexpr size_t kValidBytes = 2 * kSlotsPerTile * 4;  // [tile stage][slot][producer warp]: 4 bits
// What the H100 / H200 give a block, less Q, the two bf16 tiles, the valid nibbles and the slack
// that aligns the dynamic shared memory to 1024 bytes: the raw ring's share.
constexpr size_t kSharedLimit = 232448;
constexpr size_t kRingLimit = kSharedLimit - kQBytes - 2 * kTileBytes - kValidBytes - 1024;

// The raw ring of a (window, compressed) format pair: a row's place is the larger row rounded up
// to 16 bytes (the decode's 16-byte loads), as many 16-row slots as fit, at most 4; all but the
// one being decoded are in flight.
template <KvRowFormat kWindow, KvRowFormat kCompressed>
struct Ring {
  static constexpr int64_t row_bytes(KvRowFormat f) {
    return row_codec::data_bytes(f, kHeadDim) + row_codec::scale_bytes(f, kHeadDim);
  }
  static constexpr int kRowBytes = static_cast<int>(
      ((row_bytes(kWindow) > row_bytes(kCompressed) ? row_bytes(kWindow) : row_bytes(kCompressed)) + 15) / 16 * 16);
  static constexpr size_t kSlotBytes = size_t{kSlotRows} * kRowBytes;
  static constexpr int kSlots = kRingLimit / kSlotBytes < 4 ? static_cast<int>(kRingLimit / kSlotBytes) : 4;
  static constexpr int kAhead = kSlots - 1;
  static constexpr size_t kSharedBytes = kQBytes + 2 * kTileBytes + kSlots * kSlotBytes + kValidBytes + 1024;
  static_assert(kSlots >= 2 && kSharedBytes <= kSharedLimit);
};

// Named barriers (0 is __syncthreads', unused).
inline constexpr int kFullBarrier = 1;   // + tile stage (2)
inline constexpr int kEmptyBarrier = 3;  // + tile stage (2)
inline constexpr int kConsumerBarrier = 5;

// The producer needs few registers, a consumer holds 128 + 32 accumulators: 384 threads start with
// 168 each (__launch_bounds__(384, 1)); 128 x (168 - 72) released = 256 x (216 - 168) claimed (with
// 56 for the producer ptxas spills its row pipeline).
inline constexpr int kLaunchRegisters = 168;
inline constexpr int kProducerRegisters = 72;
inline constexpr int kConsumerRegisters = 216;
static_assert(kLaunchRegisters * kThreads <= 65536);
static_assert(kProducerRegisters * kProducerThreads + kConsumerRegisters * kConsumerThreads <=
              kLaunchRegisters * kThreads);

}  // namespace attention_wgmma

template <class Out, KvRowFormat kWindow, KvRowFormat kCompressed>
__global__ void __launch_bounds__(attention_wgmma::kThreads, 1) sparse_attention_wgmma_kernel(SparseAttentionLaunch a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace attention_wgmma;
  using namespace row_decode;
  using R = Ring<kWindow, kCompressed>;
  extern __shared__ uint8_t shared_unaligned[];
  uint8_t* const shared = shared_unaligned + ((1024 - shared_address(shared_unaligned) % 1024) % 1024);
  uint8_t* const q_tile = shared;                              // [64 heads x 512] bf16, SW128
  uint8_t* const tiles = q_tile + kQBytes;                     // [stage][64 rows x 512] bf16, SW128
  uint8_t* const ring = tiles + 2 * kTileBytes;                // [slot][16 rows][R::kRowBytes]
  uint8_t* const valid_nibbles = ring + R::kSlots * R::kSlotBytes;  // [stage][slot][producer warp]

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int head0 = static_cast<int>(blockIdx.y) * kHeadsPerBlock;
  const TokenRows rows(a, t);
  const int64_t first_row = int64_t{blockIdx.z} * a.tiles_per_split * kTileRows;
  const int64_t end_row = min(rows.n_rows, first_row + a.tiles_per_split * kTileRows);
  const int n_tiles = end_row > first_row ? static_cast<int>((end_row - first_row + kTileRows - 1) / kTileRows) : 0;

  if (threadIdx.x >= kConsumerThreads) {
    release_registers<kProducerRegisters>();
    const int producer_warp = warp - kConsumerThreads / kWarpSize;
    const int n_slots = n_tiles * kSlotsPerTile;
    constexpr int kWindowData = static_cast<int>(row_codec::data_bytes(kWindow, kHeadDim) / 8);
    constexpr int kWindowChunks = kWindowData + static_cast<int>(row_codec::scale_bytes(kWindow, kHeadDim) / 8);
    constexpr int kCompressedData = static_cast<int>(row_codec::data_bytes(kCompressed, kHeadDim) / 8);
    constexpr int kCompressedChunks = kCompressedData + static_cast<int>(row_codec::scale_bytes(kCompressed, kHeadDim) / 8);
    // Lane l follows row l % 4 of the warp's rows of a slot (lanes 4-31 repeat lanes 0-3's loads).
    auto row_index = [&](int j) {
      return first_row + int64_t{j} * kSlotRows + producer_warp * kRowsPerProducerWarp + (lane & 3);
    };
    // A row's bytes in three steps, each load used an iteration after it was issued: the pick (the
    // row number), the block-table entry (the page), the address.
    auto first_page = [&](const DeviceRows& cache) {
      const bool tabled = cache.first_logical_page && cache.block_table && rows.sequence >= 0 &&
                          rows.sequence < cache.num_sequences;
      return tabled ? cache.first_logical_page[rows.sequence] : 0;
    };
    const int32_t window_first_page = first_page(a.window), compressed_first_page = first_page(a.compressed);
    auto row_number = [&](int j) { return rows.row_number(a, t, row_index(j), end_row); };
    struct PageRow {
      int64_t page = -1;  // the page of a flat cache may exceed int32
      int32_t row = 0;
    };
    auto page_of = [&](const DeviceRows& cache, int32_t first_page, int64_t number) {
      const RowSplit split = split_rows(number, cache.rows_per_page);
      if (cache.block_table == nullptr) return PageRow{split.block, static_cast<int32_t>(split.row)};
      const int64_t block = split.block - first_page;
      if (rows.sequence < 0 || rows.sequence >= cache.num_sequences || block < 0 || block >= cache.blocks_per_sequence)
        return PageRow{};
      return PageRow{cache.block_table[rows.sequence * cache.blocks_per_sequence + block], static_cast<int32_t>(split.row)};
    };
    auto page_row = [&](int j, int64_t number) {
      if (number < 0) return PageRow{};
      return row_index(j) < rows.n_window ? page_of(a.window, window_first_page, number)
                                          : page_of(a.compressed, compressed_first_page, number);
    };
    auto ref_of = [&](int j, const PageRow& pr) {
      if (pr.page < 0) return RowRef{};
      return row_index(j) < rows.n_window ? row_in_page(a.window, pr.page, pr.row) : row_in_page(a.compressed, pr.page, pr.row);
    };
    // Copies the warp's rows of slot j (refs in lanes 0-3) into ring slot j % kSlots, one cp.async
    // group; returns their valid bits.
    auto request = [&](int j, const RowRef& ref) {
      const uint32_t valid = __ballot_sync(kFullMask, ref.valid()) & 0xfu;
      const int window_rows = rows.window_rows_in_tile(row_index(j) - (lane & 3), kRowsPerProducerWarp);
      const uint32_t slot = shared_address(ring + (j % R::kSlots) * R::kSlotBytes);
#pragma unroll
      for (int r = 0; r < kRowsPerProducerWarp; ++r) {
        const uint8_t* data = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.data), r));
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.scales), r));
        if (!((valid >> r) & 1)) continue;
        const int data_chunks = r < window_rows ? kWindowData : kCompressedData;
        const int chunks = r < window_rows ? kWindowChunks : kCompressedChunks;
        const uint32_t row_address = slot + (producer_warp * kRowsPerProducerWarp + r) * R::kRowBytes;
        for (int c = lane; c < chunks; c += kWarpSize)
          cp_async<8>(row_address + 8 * c, c < data_chunks ? data + 8 * c : scales + 8 * (c - data_chunks));
      }
      cp_async_commit();
      return valid;
    };
    // Slots j + 1 … j + kAhead in flight while j is decoded (their valid nibbles in `valids`, slot j
    // lowest); the ref of j + kAhead + 1, the page of j + kAhead + 2 and the row number of
    // j + kAhead + 3 prepared an iteration before they are used.
    uint32_t valids = 0;
#pragma unroll
    for (int j = 0; j < R::kAhead; ++j) {
      if (j < n_slots) valids |= request(j, ref_of(j, page_row(j, row_number(j)))) << (4 * j);
      else cp_async_commit();
    }
    RowRef ref_ahead = ref_of(R::kAhead, page_row(R::kAhead, row_number(R::kAhead)));
    PageRow page_ahead = page_row(R::kAhead + 1, row_number(R::kAhead + 1));
    int64_t number_ahead = row_number(R::kAhead + 2);
    const int c0 = lane * 16, upper_first = (lane >> 2) & 1;
    for (int j = 0; j < n_slots; ++j) {
      if (j + R::kAhead < n_slots) valids |= request(j + R::kAhead, ref_ahead) << (4 * R::kAhead);
      else cp_async_commit();  // an empty group: the wait below then always means slot j
      ref_ahead = ref_of(j + R::kAhead + 1, page_ahead);
      page_ahead = page_row(j + R::kAhead + 2, number_ahead);
      number_ahead = row_number(j + R::kAhead + 3);
      cp_async_wait<R::kAhead>();
      __syncwarp();  // every lane's bytes of slot j have landed
      const int tile_index = j / kSlotsPerTile, slot_in_tile = j % kSlotsPerTile, stage = tile_index % 2;
      if (slot_in_tile == 0 && tile_index >= 2) barrier_sync(kEmptyBarrier + stage, kThreads);  // tile - 2 consumed
      // A lane per 16 channels of a row; lanes 4-7 of each quarter warp store their upper chunk
      // first, so that a quarter warp's 8 stores fall on 8 different groups of banks.
      const int window_rows = rows.window_rows_in_tile(row_index(j) - (lane & 3), kRowsPerProducerWarp);
      const uint8_t* const raw = ring + (j % R::kSlots) * R::kSlotBytes;
      uint8_t* const tile = tiles + stage * kTileBytes;
#pragma unroll
      for (int r = 0; r < kRowsPerProducerWarp; ++r) {
        const int slot_row = producer_warp * kRowsPerProducerWarp + r;
        uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
        if ((valids >> r) & 1) {
          if (r < window_rows) decode16<kWindow>(raw + slot_row * R::kRowBytes, c0, lo, hi);
          else decode16<kCompressed>(raw + slot_row * R::kRowBytes, c0, lo, hi);
        }
        const int tile_row = slot_in_tile * kSlotRows + slot_row;
        *reinterpret_cast<uint4*>(tile + wgmma::sw128_offset(kTileRows, tile_row, c0 + 8 * upper_first)) = upper_first ? hi : lo;
        *reinterpret_cast<uint4*>(tile + wgmma::sw128_offset(kTileRows, tile_row, c0 + 8 * (upper_first ^ 1))) = upper_first ? lo : hi;
      }
      if (lane == 0) valid_nibbles[(stage * kSlotsPerTile + slot_in_tile) * 4 + producer_warp] = static_cast<uint8_t>(valids & 0xfu);
      __syncwarp();  // ring slot j % kSlots is read: slot j + kSlots may overwrite it
      if (slot_in_tile == kSlotsPerTile - 1) {
        wgmma::fence_shared_for_async_proxy();
        barrier_arrive(kFullBarrier + stage, kThreads);
      }
      valids >>= 4;
    }
    return;
  }

  // Consumers: warpgroup `half` computes output channels [256·half, 256·half + 256).
  claim_registers<kConsumerRegisters>();
  const int half = threadIdx.x / 128, warp_in_group = warp % 4;
  const uint32_t q_address = shared_address(q_tile), tiles_address = shared_address(tiles);
  for (int item = threadIdx.x; item < kHeadsPerBlock * (kHeadDim / 8); item += kConsumerThreads) {
    const int h = item / (kHeadDim / 8), channel = (item % (kHeadDim / 8)) * 8;
    uint8_t* dst = q_tile + wgmma::sw128_offset(kHeadsPerBlock, h, channel);
    if (head0 + h < a.heads) cp_async<16>(shared_address(dst), a.q + ((t * a.heads + head0 + h) * kHeadDim + channel));
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  cp_async_wait_all();
  wgmma::fence_shared_for_async_proxy();
  barrier_sync(kConsumerBarrier, kConsumerThreads);

  mma::SoftmaxState softmax;
  float acc[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const float scale_log2 = a.scale * mma::kLog2e;

  for (int i = 0; i < n_tiles; ++i) {
    const int stage = i % 2;
    barrier_sync(kFullBarrier + stage, kThreads);
    const uint32_t tile = tiles_address + stage * kTileBytes;
    float s[kScoreTiles][4];
#pragma unroll
    for (int j = 0; j < kScoreTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kQkSteps; ++k) {
      const uint32_t offset = (k / 4) * kTileRows * 128 + (k % 4) * 32;  // 64-channel block, then 16 channels
      wgmma::m64n64k16_ss(s, wgmma::k_major(q_address + offset), wgmma::k_major(tile + offset), k > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(s);

    uint64_t valid_rows = 0;
#pragma unroll
    for (int b = 0; b < kSlotsPerTile * 4; ++b)
      valid_rows |= static_cast<uint64_t>(valid_nibbles[stage * kSlotsPerTile * 4 + b] & 0xfu) << (4 * b);
    float correction[2];
    mma::online_softmax(s, valid_rows, scale_log2, lane, softmax, correction);
    mma::rescale(acc, correction);
    uint32_t p[kPvSteps][4];
#pragma unroll
    for (int k = 0; k < kPvSteps; ++k) mma::a_from_c(p[k], s[2 * k], s[2 * k + 1]);
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kPvSteps; ++k)
      wgmma::m64n256k16_rs(acc, p[k], wgmma::mn_major(tile + half * 4 * kTileRows * 128 + k * 16 * 128, kTileRows));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(acc);
    wgmma::pin(p);
    if (i + 2 < n_tiles) barrier_arrive(kEmptyBarrier + stage, kThreads);  // the producer waits for it at tile i + 2
  }

  mma::write_output<Out, kOutTiles, kHeadDim>(a, t, head0 + warp_in_group * 16, half * kHalfChannels, half == 0, lane,
                                              acc, softmax);
#endif
}

// Out: uint16_t (bf16 bits) or float; the cache formats of the call (a cache without rows: either);
// tiles_per_split in tiles of attention_wgmma::kTileRows rows. With splits > 1 the caller runs the
// combine afterwards.
template <class Out, KvRowFormat kWindow, KvRowFormat kCompressed>
void launch_sparse_attention_wgmma(const SparseAttentionLaunch& a, cudaStream_t stream) {
  const auto kernel = sparse_attention_wgmma_kernel<Out, kWindow, kCompressed>;
  constexpr size_t shared_bytes = attention_wgmma::Ring<kWindow, kCompressed>::kSharedBytes;
  static const int registers = [&] {
    cudaFuncAttributes attributes{};
    DSV4_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    return attributes.numRegs;
  }();
  DSV4_CHECK(registers == attention_wgmma::kLaunchRegisters, "sparse_attention (wgmma): the kernel has ", registers,
             " registers per thread, its register hand-over (setmaxnreg) expects ", attention_wgmma::kLaunchRegisters);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.heads + attention_wgmma::kHeadsPerBlock - 1) / attention_wgmma::kHeadsPerBlock),
                  static_cast<unsigned>(a.splits));
  kernel<<<grid, attention_wgmma::kThreads, shared_bytes, stream>>>(a);
}

}  // namespace dsv4::cuda

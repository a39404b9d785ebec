// The Hopper warpgroup-MMA sparse MQA attention kernel ("wgmma", see include/dsv4/cuda/attention.h),
// for reference precision (bf16_rounding: the exp-scores P are bf16 on the tensor cores) over the
// quantized cache rows (v41_fp8, v41_fp4, fp8_ds_mla) or bf16 rows, decode steps and prefill chunks
// alike.
//
// One block per (token, group of up to 64 heads, split of rows), three warpgroups (a group narrower
// than 64 at small steps, the rest of the MMAs' rows padding: see plan_split_kv_clusters):
//   * the producer warpgroup gathers the raw bytes of the rows (window rows, then picks, as
//     TokenRows orders them) into a ring of 16-row slots (Ring): the V4.1 native rows by bulk copies
//     (the copy engine; a block's first tile's scales by cp.async), the others by cp.async; invalid
//     rows are zero-filled (so they decode to zeros). Warp w copies rows 4w … 4w + 3 of every slot;
//     its lanes look those rows up for eight slots at a time (the pick, the block-table entry and
//     the address each a batch apart, so that no load waits for another).
//   * two consumer warpgroups: each computes the scores of all 64 heads over half of the tile's
//     rows (32 wgmma m64n32k16: Q's first 64 channels from registers, the rest and the tile from
//     shared memory), the online softmax in fp32 with the two halves' maxima merged through shared
//     memory (where the consumers decode, only where a max rises: P is stored at once relative to
//     the running max and the P barrier checks it), its exp-scores P rounded to bf16 into a shared P
//     tile, and then P·V of all 64 rows for its half of the 512 output channels (4 SS wgmma
//     m64n256k16; the row sums unrounded, each warpgroup's over its rows, added at the end).
// The raw rows are decoded exactly to bf16 (row_decode.cuh) into one of two 64-row tiles in the
// SW128 layout the MMAs read, by whoever has the time:
//   * where the ring holds a whole tile (the V4.1 native pair, Ring::kConsumersDecode) the
//     consumers do: the producer's bulk copies of a tile land on the tile parity's mbarrier, every
//     consumer warp decodes 8 of its rows while its P·V MMAs of the previous tile run and frees the
//     ring (kRawFree), and a consumer barrier marks the decoded tile;
//   * else (fp8_ds_mla, three slots) the producer does, slot by slot with all but one slot in
//     flight, and hands over the tiles with kFull (bar.arrive) / kEmpty (the consumers' bar.arrive);
//   * bf16 rows need none: the producer copies them straight into the tiles, each tile's copies
//     landing on an mbarrier (cp.async.mbarrier.arrive), so that it never waits for them.
// Nothing depends on the other tokens of the step. The split blocks of a token are one thread-block
// cluster: each puts its unnormalized P·V and (max, sum) into its shared memory, and each merges a
// slice of the token's outputs from all of them (distributed shared memory) in the fixed order of
// the splits, so that no partial goes through global memory and no combine kernel runs.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <utility>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/dispatch.h"
#include "cuda/common/distributed_shared.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/common/phase_stamps.cuh"
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
inline constexpr int kConsumerThreads = 256;
inline constexpr int kProducerThreads = 128;
inline constexpr int kProducerWarps = kProducerThreads / kWarpSize;
inline constexpr int kRowsPerProducerWarp = kSlotRows / kProducerWarps;
// A producer lane looks up one row of one of the next kLookupSlots slots (its warp's rows of them).
inline constexpr int kLookupSlots = kWarpSize / kRowsPerProducerWarp;
inline constexpr int kThreads = kConsumerThreads + kProducerThreads;
inline constexpr int kHalfChannels = kHeadDim / 2;
inline constexpr int kWarpgroupRows = kTileRows / 2;  // the rows of a tile a consumer warpgroup scores
inline constexpr int kScoreTiles = kWarpgroupRows / 8;  // n tiles of 8 of its 64 x 32 scores
inline constexpr int kOutTiles = kHalfChannels / 8;  // n tiles of 8 of a consumer's 64 x 256 output
inline constexpr int kQkSteps = kHeadDim / 16;
inline constexpr int kPvSteps = kTileRows / 16;
// Q's first 64 or 128 channels (the first 4 or 8 k steps of Q·Kᵀ; Ring::kQRegisterSteps) stay in
// the consumers' registers; the rest is in shared memory after the tile's P (heads x rows, a 64 x 64
// SW128 block: the A of P·V).
constexpr size_t kPBytes = size_t{kHeadsPerBlock} * kTileRows * 2;
constexpr size_t q_bytes(int register_steps) {  // P, then Q's channels in shared memory
  return kPBytes + size_t{kHeadsPerBlock} * (kHeadDim - 16 * register_steps) * 2;
}
constexpr size_t kTileBytes = size_t{kTileRows} * mma::kRowBytes;
// Valid bits per tile: the producer may write tile u's while the consumers have yet to read those of
// tiles u - 2 and u - 1 (it copies u once u - 2 is decoded); four stages cover that.
inline constexpr int kValidStages = 4;
constexpr size_t kValidBytes = kValidStages * kSlotsPerTile * kProducerWarps;  // [stage][slot][producer warp]
constexpr size_t kExchangeBytes = 2 * kHeadsPerBlock * sizeof(float);  // [consumer warpgroup][head]
constexpr size_t kTileBarrierBytes = 2 * sizeof(uint64_t);  // bf16 rows: an mbarrier per tile stage
// What the H100 / H200 give a block, less P and Q, the two bf16 tiles, the valid bits, the
// warpgroups' exchange and the slack that aligns the dynamic shared memory to 1024 bytes: the raw
// ring's share.
constexpr size_t kSharedLimit = 232448;
constexpr size_t ring_limit(int q_register_steps) {
  return kSharedLimit - q_bytes(q_register_steps) - 2 * kTileBytes - kValidBytes - kExchangeBytes - kTileBarrierBytes -
         1024;
}

// The raw ring of a (window, compressed) format pair, and what its room leaves of Q in registers. A
// row's place is its size rounded up to 16 bytes (the decode's 16-byte loads). Rows are copied 16
// bytes at a time where every row's data and scales are multiples of 16 (the V4.1 native pair),
// else 8.
//   * Where the ring holds two tiles of compressed rows with Q's first 128 channels in the
//     consumers' registers (the V4.1 native pair), the consumers
//     decode: the producer only looks rows up and copies whole tiles, and each consumer warp
//     decodes its share of the next tile while its P·V MMAs run, work that otherwise leaves the
//     consumers waiting for a producer warpgroup that decodes alone. A tile of compressed rows only
//     ("narrow") takes one of two stages, so the next one's copies are in flight while a tile
//     waits to be decoded; a tile with window rows ("wide", the larger row's place) takes the
//     whole ring.
//   * Else (fp8_ds_mla's larger rows) the producer decodes, slot by slot of 16 rows (the larger
//     row's place), as many slots as fit beside Q's last 448 channels, at most 4, all but the one
//     being decoded in flight; its decode takes the registers the consumers would need for more of Q.
//   * bf16 rows need no decode (kDirect): there is no ring, the producer copies a tile's rows
//     straight into their places in a bf16 tile stage (two stages: tile u + 1's copies land while
//     the consumers compute tile u; tile u + 2's are issued as soon as they are done with tile u).
template <KvRowFormat kWindow, KvRowFormat kCompressed>
struct Ring {
  static constexpr int64_t row_bytes(KvRowFormat f) {
    return (row_codec::data_bytes(f, kHeadDim) + row_codec::scale_bytes(f, kHeadDim) + 15) / 16 * 16;
  }
  static constexpr bool sixteen(KvRowFormat f) {
    return row_codec::data_bytes(f, kHeadDim) % 16 == 0 && row_codec::scale_bytes(f, kHeadDim) % 16 == 0;
  }
  static constexpr int kCopyBytes = sixteen(kWindow) && sixteen(kCompressed) ? 16 : 8;
  static constexpr int kRowBytes =
      static_cast<int>(row_bytes(kWindow) > row_bytes(kCompressed) ? row_bytes(kWindow) : row_bytes(kCompressed));
  static constexpr int kNarrowRowBytes = static_cast<int>(row_bytes(kCompressed));
  static constexpr size_t kNarrowStageBytes = size_t{kTileRows} * kNarrowRowBytes;
  static constexpr size_t kWideTileBytes = size_t{kTileRows} * kRowBytes;
  static constexpr bool kDirect = kWindow == KvRowFormat::bf16 && kCompressed == KvRowFormat::bf16;
  static constexpr bool kConsumersDecode =
      !kDirect && 2 * kNarrowStageBytes <= ring_limit(8) && kWideTileBytes <= ring_limit(8);
  static constexpr bool kProducerDecodes = !kDirect && !kConsumersDecode;
  static constexpr int kQRegisterSteps = kConsumersDecode ? 8 : 4;
  static constexpr int kQSharedFirst = 16 * kQRegisterSteps;  // Q's first channel in shared memory
  static constexpr size_t kQBytes = q_bytes(kQRegisterSteps);
  static constexpr size_t kRingLimit = ring_limit(kQRegisterSteps);
  static constexpr size_t kSlotBytes = size_t{kSlotRows} * kRowBytes;
  static constexpr int kSlots = kRingLimit / kSlotBytes < 4 ? static_cast<int>(kRingLimit / kSlotBytes) : 4;
  static constexpr int kAhead = kSlots - 1;
  static constexpr size_t kRingBytes =
      kDirect            ? 0
      : kConsumersDecode ? (kWideTileBytes > 2 * kNarrowStageBytes ? kWideTileBytes : 2 * kNarrowStageBytes)
                         : kSlots * kSlotBytes;
  static constexpr size_t kSharedBytes =
      kQBytes + 2 * kTileBytes + kRingBytes + kValidBytes + kExchangeBytes + kTileBarrierBytes + 1024;
  static_assert((!kProducerDecodes || kSlots >= 2) && kSharedBytes <= kSharedLimit && kAhead < kLookupSlots);
  // Where the consumers-decode ring holds tile u's raw rows: a wide tile takes the whole ring, a
  // narrow one the stage of its parity.
  static __device__ __forceinline__ uint8_t* tile_rows(uint8_t* ring, bool wide, int u) {
    return wide ? ring : ring + (u % 2) * kNarrowStageBytes;
  }
};

// Phase stamps of a diagnostic build (phase_stamps.cuh; bench/probes/attention_phase_stamps.cu
// prints them): per warpgroup (consumers 0 and 1, the producer 2).
enum PhaseStamp {
  kStampStart = 0,       // all: after the wait for the preceding grids
  kStampQLanded = 1,     // consumers: Q in registers and shared memory
  kStampFirstDecoded = 2,  // consumers: tile 0 decoded (the consumers-decode ring)
  kStampTile = 3,        // consumers: tile_stamp(i, TileStamp) of tile i
  kStampTokenRows = 40,  // producer: the token's rows and first pages known
  kStampFirstPages = 41,  // producer: the first batches' pages known
  kStampCopiesIssued = 50,  // producer: + u, tile u's copies issued (u < 46)
  kStampMergeShared = 91,   // consumers (split blocks): every block's partial shared (the first cluster barrier)
  kStampMergeWeights = 92,  // consumers (split blocks): the merge weights whole
  kStampMergePieces = 93,   // consumers (split blocks): its pieces merged, before the last cluster barrier
  kStampEnd = 95,        // consumers: the output written (or merged)
  kStampNone = 127,      // beyond every stamp: not recorded
};
enum TileStamp { kTileReady, kScored, kPStored, kPWhole, kNextDecoded, kPvDone, kTileStamps = 8 };
inline constexpr int kStampedTiles = (kStampMergeShared - kStampTile) / kTileStamps;  // the first 11 tiles
__host__ __device__ constexpr int tile_stamp(int i, TileStamp s) {
  return i < kStampedTiles ? kStampTile + kTileStamps * i + s : kStampNone;
}

// Named barriers (0 is __syncthreads', unused). The producer decodes: kFull / kEmpty per tile stage.
// The consumers decode: kRawFree (the consumers have decoded a tile's raw rows; that they have
// landed is the tile parity's mbarrier), one per tile parity, since the producer runs a tile ahead;
// kConsumer also marks each decoded tile (every consumer passes it after its P·V of the tile
// before: P and the maxima are then free to write). kConsumer also orders the consumers'
// exchanges: the maxima, P, the final sums.
inline constexpr int kFullBarrier = 1;   // + tile stage (2)
inline constexpr int kEmptyBarrier = 3;  // + tile stage (2)
inline constexpr int kConsumerBarrier = 5;
inline constexpr int kStagedBarrier = 6;    // + consumer warpgroup (2): its results are staged
inline constexpr int kRawFreeBarrier = 8;    // + tile parity (2)

// 384 threads start with 168 registers each (__launch_bounds__(384, 1)); ptxas compiles each role
// within its setmaxnreg bound: a consumer holds 128 accumulators, Q's registers, 16 scores (where
// it decodes, kept through the P barrier: where a max rises P is made again from them) and its
// addresses (without the hand-over ptxas spills), and where it decodes a row pipeline while its
// P·V MMAs run; the producer's lookups and, where it decodes, four rows' decodes in flight (or
// where it copies bf16 rows into the tiles, a tile's 256 pieces: at 88 it spills).
// 128 x (168 - 88) released = 256 x (208 - 168) claimed where the consumers decode (and hold 32 of
// Q's registers), 128 x (168 - 120) = 256 x (192 - 168) where they do not.
inline constexpr int kLaunchRegisters = 168;
template <bool kConsumersDecode>
inline constexpr int kProducerRegisters = kConsumersDecode ? 88 : 120;
template <bool kConsumersDecode>
inline constexpr int kConsumerRegisters = kConsumersDecode ? 208 : 192;
static_assert(kLaunchRegisters * kThreads <= 65536);
static_assert(kProducerRegisters<true> * kProducerThreads + kConsumerRegisters<true> * kConsumerThreads <=
                  kLaunchRegisters * kThreads &&
              kProducerRegisters<false> * kProducerThreads + kConsumerRegisters<false> * kConsumerThreads <=
                  kLaunchRegisters * kThreads);
// Rows a consumer warp decodes per tile, in groups of a producer warp's (kRowsPerProducerWarp).
inline constexpr int kRowsPerConsumerWarp = kTileRows / (kConsumerThreads / kWarpSize);

// The bf16 tiles of the V4.1 native rows hold each group of eight channels in paired order
// (row_decode.cuh), where their v41_fp4 picks decode by moving bits instead of a table lookup (the
// decode, the consumers' bound, then takes a fraction of the ALU instructions); their window rows
// pay a byte permute a pair for it. Q is staged in the same order, and the outputs go back to
// channel order on their way out. Other formats keep channel order. Paired tiles' values are also
// times 2^-7 (kTileValueScale: one multiply less a pair of v41_fp4 codes). The scores are scaled
// back through the softmax's scale, and the outputs through their normalization (or the split
// merge's weights), by powers of two: the same reals, so the same bits, and no multiply of the
// accumulators.
template <KvRowFormat kWindow, KvRowFormat kCompressed>
inline constexpr bool kPairedTiles = kCompressed == KvRowFormat::v41_fp4;
template <KvRowFormat kWindow, KvRowFormat kCompressed>
inline constexpr float kTileValueScale = kPairedTiles<kWindow, kCompressed> ? row_decode::kPairedValueScale : 1.0f;
// The channel at position p of paired order.
__host__ __device__ constexpr int paired_channel(int p) { return (p % 8) / 2 + 4 * (p % 2) + p / 8 * 8; }

// Lane `lane`'s 16 channels of raw rows r … r + kRows - 1 (format F; raw rows kRowBytes apart)
// decoded to bf16 (kPaired: in paired order, times 2^-7: kPairedTiles) and stored
// into rows row0 + r … of the SW128 tile. Two rows' loads are in flight
// (row_decode::Raw16): each row's are issued before the stores of the row two earlier, which would
// otherwise hold them back (measured: b128 −0.9 us, the direct prefill −2.7 %; four ahead gained
// no more and spills at the consumers' 208 registers). Lanes 4-7 of each quarter warp store their
// upper chunk first, so that a quarter warp's 8 stores fall on 8 different groups of banks.
template <KvRowFormat F, int kRowBytes, bool kPaired, int kRows = 1>
__device__ __forceinline__ void decode_row(const uint8_t* raw, uint8_t* tile, int row0, int r, int lane) {
  constexpr int kAhead = kRows < 2 ? kRows : 2;
  const int c0 = lane * 16, upper_first = (lane >> 2) & 1;
  auto load = [&](int k) { return row_decode::load16<F>(raw + (r + k) * kRowBytes, c0, upper_first); };
  row_decode::Raw16 loaded[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k) loaded[k] = load(k);
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    uint4 first, second;
    row_decode::decode16<F, kPaired>(loaded[k % kAhead], c0, first, second);
    if (k + kAhead < kRows) loaded[k % kAhead] = load(k + kAhead);
    *reinterpret_cast<uint4*>(tile + wgmma::sw128_offset(kTileRows, row0 + r + k, c0 + 8 * upper_first)) = first;
    *reinterpret_cast<uint4*>(tile + wgmma::sw128_offset(kTileRows, row0 + r + k, c0 + 8 * (upper_first ^ 1))) = second;
  }
}

// Whether tile u of a block's rows (first_row + 64u …) holds window rows: its raw rows then take
// the ring's larger places (Ring).
__device__ __forceinline__ bool is_wide_tile(const TokenRows& rows, int64_t first_row, int u) {
  return rows.window_rows_in_tile(first_row + int64_t{u} * kTileRows, kTileRows) > 0;
}

// The warp's rows of the one group of a token where the window ends (window rows, then picks): out
// of line, to keep the hot loop small in the instruction cache.
template <KvRowFormat kWindow, KvRowFormat kCompressed, int kRowBytes>
__device__ __noinline__ void decode_mixed_rows(const uint8_t* raw, uint8_t* tile, int row0, int window_rows, int lane) {
#pragma unroll 1
  for (int r = 0; r < kRowsPerProducerWarp; ++r) {
    constexpr bool kPaired = kPairedTiles<kWindow, kCompressed>;
    if (r < window_rows) decode_row<kWindow, kRowBytes, kPaired>(raw, tile, row0, r, lane);
    else decode_row<kCompressed, kRowBytes, kPaired>(raw, tile, row0, r, lane);
  }
}

// A warp's group of kRowsPerProducerWarp raw rows (window_rows of them window rows, the rest
// picks) into tile rows row0 …: a group of one kind decodes without branches (four independent
// chains).
template <KvRowFormat kWindow, KvRowFormat kCompressed, int kRowBytes>
__device__ __forceinline__ void decode_rows(const uint8_t* raw, uint8_t* tile, int row0, int window_rows, int lane) {
  constexpr bool kPaired = kPairedTiles<kWindow, kCompressed>;
  if (window_rows == 0) {
    decode_row<kCompressed, kRowBytes, kPaired, kRowsPerProducerWarp>(raw, tile, row0, 0, lane);
  } else if (window_rows == kRowsPerProducerWarp) {
    decode_row<kWindow, kRowBytes, kPaired, kRowsPerProducerWarp>(raw, tile, row0, 0, lane);
  } else {
    decode_mixed_rows<kWindow, kCompressed, kRowBytes>(raw, tile, row0, window_rows, lane);
  }
}

// A consumer warpgroup's output (mma::finish_output, no split) through shared memory: staged in
// `stage` as rows of its 64 heads x 256 channels (padded by 8 values, so that a quarter warp's
// stores to 8 heads fall on different banks), then copied out in 16-byte pieces, whole sectors in
// order, where a lane's own values are 4 bytes (bf16) of 8 heads. (A split's fp32 partials go out
// directly: a quarter warp's 8-byte values fill whole sectors.) acc: the tiles' values' products
// (kTileValueScale); kPaired: in paired channel order, staged so and put back in channel order as
// the pieces go out.
template <class Out, bool kPaired>
__device__ __forceinline__ void write_output_staged(const SparseAttentionLaunch& a, int64_t t, int head0, int head_end,
                                                    int half, int lane, const float (&acc)[kOutTiles][4],
                                                    const mma::SoftmaxState& state, float value_scale, uint8_t* stage) {
  constexpr int kRowValues = kHalfChannels + 8, kPieceValues = 16 / sizeof(Out), kPieces = kHalfChannels / kPieceValues;
  Out* const rows = reinterpret_cast<Out*>(stage);
  const int warp_in_group = (threadIdx.x / kWarpSize) % 4, column0 = 2 * (lane & 3);
  mma::finish_output(a, t, head0 + warp_in_group * 16, head_end, half == 0, lane, acc, state,
                     [&](int head, int j, float x, float y) {
                       mma::store_pair(rows + (head - head0) * kRowValues + 8 * j + column0, x, y);
                     },
                     value_scale);
  barrier_sync(kStagedBarrier + half, kConsumerThreads / 2);
  const int heads = head_end - head0;
  for (int item = threadIdx.x % (kConsumerThreads / 2); item < heads * kPieces; item += kConsumerThreads / 2) {
    const int h = item / kPieces, piece = item % kPieces;
    uint4 values = *reinterpret_cast<const uint4*>(rows + h * kRowValues + piece * kPieceValues);
    if constexpr (kPaired && sizeof(Out) == 2) {
      values = row_decode::bf16x8_unpaired(values);
    } else if constexpr (kPaired) {  // the group's other half is the neighbour lane's (kPieces is even)
      float v[4] = {__uint_as_float(values.x), __uint_as_float(values.y), __uint_as_float(values.z), __uint_as_float(values.w)};
      row_decode::f32x4_half_unpaired(v, lane);
      values = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
    }
    *reinterpret_cast<uint4*>(mma::output_row<Out, kHeadDim>(a, t, head0 + h) + half * kHalfChannels + piece * kPieceValues) = values;
  }
}

// The split merge (splits > 1): the largest cluster an H100 / H200 runs (a non-portable size), and
// what each block of it shares, in the space of P, Q and the tiles, free once its MMAs are done:
// its partial output (rows of 64 heads x 512 channels, padded by 8 values so that a half warp's
// 8-byte stores of 4 heads fall on different banks) and its heads' (max, sum) in log2 units; then,
// for its own merge, the merge weights of the heads it merges.
inline constexpr int kMaxClusterSplits = 16;
inline constexpr int kPartialRowValues = kHeadDim + 8;
inline constexpr size_t kPartialBytes = size_t{kHeadsPerBlock} * kPartialRowValues * sizeof(float);
inline constexpr size_t kMergeBytes =
    kPartialBytes + kHeadsPerBlock * sizeof(float2) + size_t{kMaxClusterSplits} * kHeadsPerBlock * sizeof(float);
static_assert(kMergeBytes <= q_bytes(8) + 2 * kTileBytes);
inline constexpr int kMergePieces = kHeadDim / 4;  // a head's four-channel pieces
// The most heads a block merges where the token splits (two splits or more: half of a group's
// pieces, and a head its range begins or ends inside).
inline constexpr int kMaxMergedHeads = kHeadsPerBlock / 2 + 1;
// Loads from the other blocks' shared memory a consumer thread has in flight at a time: each waits a
// round trip, so they go out together (16-byte values: 128 registers).
inline constexpr int kMergeLoadsInFlight = 32;

// Whether a split's partials are in paired channel order (paired tiles' tile order, two values a
// store; their merge puts them back: b1 -0.2 us) or in channel order. A pair of splits keeps channel
// order (single values): its merge of 16 pieces a thread measured b64 +1.2 us with the lanes'
// exchange.
__host__ __device__ constexpr bool paired_partials(bool paired_tiles, int splits) { return paired_tiles && splits != 2; }

// Pieces [first, end) of a token's merge (piece i: head i / 128, channels 4·(i % 128) …): the splits'
// partials from their blocks' shared memory (at `partial` in each), weighted and summed in split
// order. kMaxSplits >= splits bounds the loads per piece, so that each thread's
// kMergeLoadsInFlight / kMaxSplits pieces load together. load_weights<kMaxSplits> issues the
// splits' (max, sum) loads first, so that they do not queue behind the values; every consumer
// thread runs the first round, its loads in flight while it makes the weights (ending in a consumer
// barrier: the weights are whole after it). kPaired: the partials are in paired channel order; the
// lanes of a pair, whose pieces are a group's halves (first is even), put them back in channel order.
template <class Out, int kMaxSplits, bool kPaired, class LoadWeights>
__device__ __forceinline__ void merge_pieces(const SparseAttentionLaunch& a, int64_t t, int head0, int first, int end,
                                             uint32_t partial, const float* weights, LoadWeights load_weights) {
  constexpr int kTogether = kMergeLoadsInFlight / kMaxSplits;
  const int splits = a.splits;
  auto make_weights = load_weights.template operator()<kMaxSplits>();
#pragma unroll 1
  for (int base = first + static_cast<int>(threadIdx.x), round = 0; round == 0 || base < end;
       base += kTogether * kConsumerThreads, ++round) {
    float4 values[kTogether][kMaxSplits];
#pragma unroll
    for (int i = 0; i < kTogether; ++i) {
      const int piece = base + i * kConsumerThreads;
      const uint32_t local = partial + ((piece / kMergePieces) * kPartialRowValues + 4 * (piece % kMergePieces)) * sizeof(float);
#pragma unroll
      for (int z = 0; z < kMaxSplits; ++z)
        if (piece < end && z < splits)
          values[i][z] = load_cluster_shared_v4(cluster_shared_address(local, static_cast<uint32_t>(z)));
    }
    if (round == 0) make_weights();
#pragma unroll
    for (int i = 0; i < kTogether; ++i) {
      const int piece = base + i * kConsumerThreads, h = piece / kMergePieces;
      if (piece >= end) break;
      float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int z = 0; z < kMaxSplits; ++z)
        if (z < splits) {
          const float w = weights[z * kHeadsPerBlock + h];
          sum[0] += values[i][z].x * w, sum[1] += values[i][z].y * w, sum[2] += values[i][z].z * w, sum[3] += values[i][z].w * w;
        }
      if constexpr (kPaired) row_decode::f32x4_half_unpaired(sum, static_cast<int>(threadIdx.x) % kWarpSize);
      store4(mma::output_row<Out, kHeadDim>(a, t, head0 + h) + 4 * (piece % kMergePieces), sum);
    }
  }
}

// Out[t, h] = Σ_z acc_z·weight_z·inverse (split_merge.cuh), the weights folded with the inverse and
// the sums in split order z = 0, 1, … whichever block runs them; block z of the cluster writes
// pieces [2·(z·n / splits), 2·((z + 1)·n / splits)) of the token's 2n = heads x 128 four-channel
// pieces, and the lse of each head whose first piece is among them. The weights of a head come from the splits'
// (max, sum) in their blocks' shared memory, loaded while the block's first pieces load. The partial
// rows and stats of a head group's padding are not written, and nothing read of them is used.
// Called by the 256 consumer threads of every block of the cluster (the producers have exited,
// which releases them from its barriers). acc and kPaired: as write_output_staged's, value_scale
// folded into the weights; the partials' order below.
template <class Out, bool kPaired>
__device__ __forceinline__ void merge_splits_in_cluster(const SparseAttentionLaunch& a, int64_t t, int head0,
                                                        int head_end, int half, int lane,
                                                        const float (&acc)[kOutTiles][4],
                                                        const mma::SoftmaxState& state, float value_scale,
                                                        uint8_t* shared) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  float* const partial = reinterpret_cast<float*>(shared);
  float2* const stats = reinterpret_cast<float2*>(shared + kPartialBytes);
  float* const weights = reinterpret_cast<float*>(stats + kHeadsPerBlock);  // [split][head]
  const int warp_in_group = (threadIdx.x / kWarpSize) % 4, g = lane / 4, c = lane % 4;
  const int heads = head_end - head0;
  // Paired tiles' values put back in channel order one by one (paired_partials), else two a store.
  const bool unpaired_values = kPaired && !paired_partials(kPaired, a.splits);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = warp_in_group * 16 + g + 8 * r;
    if (head >= heads) continue;  // a head group's padding
#pragma unroll
    for (int j = 0; j < kOutTiles; ++j) {
      float* const row = partial + head * kPartialRowValues + half * kHalfChannels + 8 * j;
      if (unpaired_values) row[c] = acc[j][2 * r], row[c + 4] = acc[j][2 * r + 1];
      else *reinterpret_cast<float2*>(row + 2 * c) = make_float2(acc[j][2 * r], acc[j][2 * r + 1]);
    }
    if (half == 0 && c == 0) stats[head] = make_float2(state.running_max[r], state.running_sum[r]);
  }
  // Every block's partial is whole: its shared-memory writes released to the cluster, acquired by
  // the wait.
  fence_release_shared_to_cluster();
  cluster_arrive_relaxed();
  cluster_wait();
  DSV4_PHASE_STAMP(kStampMergeShared);

  // Ranges of whole pairs of pieces, groups of eight channels (whose halves two lanes put back in
  // channel order, kPaired).
  const int splits = a.splits, rank = static_cast<int>(cluster.block_rank());
  const int pairs = heads * kMergePieces / 2, first = 2 * (rank * pairs / splits), end = 2 * ((rank + 1) * pairs / splits);
  // The weights of the heads of pieces [first, end), each made by a group of kLanes lanes (kLanes >=
  // splits), split z's by lane z of the group, in as many passes as it takes the 256 / kLanes groups
  // to cover the at most kMaxMergedHeads heads a block merges: all passes' loads at once, then the
  // returned function makes the weights from them.
  auto load_weights = [&]<int kLanes>() {
    constexpr int kWeightGroups = kConsumerThreads / kLanes;
    constexpr int kWeightPasses = (kMaxMergedHeads + kWeightGroups - 1) / kWeightGroups;
    const int first_head = first / kMergePieces, last_head = (end - 1) / kMergePieces;
    const int z = lane % kLanes, group = static_cast<int>(threadIdx.x) / kLanes;
    float2 split[kWeightPasses];
    float sink_log2[kWeightPasses];
#pragma unroll
    for (int pass = 0; pass < kWeightPasses; ++pass) {
      const int head = first_head + pass * kWeightGroups + group;
      split[pass] = head <= last_head && z < splits
                        ? load_cluster_shared_v2(cluster_shared_address(shared_address(stats + head), static_cast<uint32_t>(z)))
                        : make_float2(-INFINITY, 0.0f);
      sink_log2[pass] = a.sink && head <= last_head ? a.sink[head0 + head] * kLog2e : -INFINITY;
    }
    return [&, split, sink_log2, first_head, last_head, z, group] {
#pragma unroll
      for (int pass = 0; pass < kWeightPasses; ++pass) {
        const int head = first_head + pass * kWeightGroups + group;
        if (first_head + pass * kWeightGroups > last_head) break;  // the same in the whole block
        float weight;
        const SplitNormalization n =
            normalize_splits_across_lanes<kLanes>(splits, split[pass], sink_log2[pass], weight);
        if (head <= last_head) {
          if (z < splits) weights[z * kHeadsPerBlock + head] = weight * n.inverse * value_scale;
          if (z == 0 && a.lse && head * kMergePieces >= first) a.lse[t * a.heads + head0 + head] = n.lse();
        }
      }
      barrier_sync(kConsumerBarrier, kConsumerThreads);  // the weights are whole
      DSV4_PHASE_STAMP(kStampMergeWeights);
    };
  };
  const uint32_t partial_rows = shared_address(partial);
  // Three variants, each with as many pieces' loads in flight as its splits leave room for: pairs
  // (steps of up to half a wave of blocks), up to 8 splits and up to 16; four spill. A pair pushing
  // its partner's rows in one bulk copy (cp.async.bulk.shared::cluster) instead measured no faster
  // where it merges and slower elsewhere (bench/RESULTS.md, twenty-fourth and twenty-fifth sessions).
  if (splits == 2) merge_pieces<Out, 2, paired_partials(kPaired, 2)>(a, t, head0, first, end, partial_rows, weights, load_weights);
  else if (splits <= 8) merge_pieces<Out, 8, paired_partials(kPaired, 8)>(a, t, head0, first, end, partial_rows, weights, load_weights);
  else merge_pieces<Out, kMaxClusterSplits, paired_partials(kPaired, kMaxClusterSplits)>(a, t, head0, first, end, partial_rows, weights, load_weights);
  DSV4_PHASE_STAMP(kStampMergePieces);
  // No block leaves while the others read its shared memory. This block's reads of theirs have all
  // returned (their values are summed above), and nothing else needs ordering: a relaxed arrival,
  // so that the barrier does not wait for the output stores.
  cluster_arrive_relaxed();
  cluster_wait();
}

}  // namespace attention_wgmma

// heads_per_block: the heads of a token one block takes (a group of at most kHeadsPerBlock, the rest
// of the MMAs' rows padding).
template <class Out, KvRowFormat kWindow, KvRowFormat kCompressed>
__global__ void __launch_bounds__(attention_wgmma::kThreads, 1)
    sparse_attention_wgmma_kernel(SparseAttentionLaunch a, int heads_per_block) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace attention_wgmma;
  using namespace row_decode;
  using R = Ring<kWindow, kCompressed>;
  extern __shared__ uint8_t shared_unaligned[];
  uint8_t* const shared = shared_unaligned + ((1024 - shared_address(shared_unaligned) % 1024) % 1024);
  uint8_t* const p_tile = shared;  // [64 heads x 64 rows] bf16, SW128
  uint8_t* const q_tile = p_tile + kPBytes;  // [64 heads x channels R::kQSharedFirst … 511] bf16, SW128
  uint8_t* const tiles = shared + R::kQBytes;                // [stage][64 rows x 512] bf16, SW128
  uint8_t* const ring = tiles + 2 * kTileBytes;              // raw rows: see Ring
  uint8_t* const valid_bits = ring + R::kRingBytes;          // [kValidStages][slot][producer warp]
  float* const exchange = reinterpret_cast<float*>(valid_bits + kValidBytes);  // [consumer warpgroup][head]
  // bf16 rows: tile stage s has landed (every producer thread's copies and its valid bits); where
  // the consumers decode: the raw rows of the tiles of parity s have (every producer lane's copies
  // or zeros, and its warp's valid bits).
  const uint32_t tile_landed = shared_address(exchange + 2 * kHeadsPerBlock);  // [stage] mbarrier
  // Launched as a dependent launch: nothing global is touched before the preceding grids are done
  // (they may have written Q, the picks, the caches). The next kernel may then be scheduled.
  wait_for_preceding_grids();
  allow_dependent_launch();
  DSV4_PHASE_STAMP(kStampStart);
  if constexpr (R::kDirect || R::kConsumersDecode) {
    if (threadIdx.x < 2) {
      mbarrier_init(tile_landed + 8 * threadIdx.x, R::kDirect ? kProducerThreads + kProducerWarps : kProducerThreads);
      fence_mbarrier_init();  // the native rows' bulk copies complete on it from the async proxy
    }
    __syncthreads();
  }

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int head0 = static_cast<int>(blockIdx.y) * heads_per_block, head_end = min(head0 + heads_per_block, a.heads);
  const TokenRows rows(a, t);
  const TokenRows::BlockRows block = rows.block_rows(a, kTileRows);
  const int64_t first_row = block.first, end_row = block.end;
  const int n_tiles = block.n_tiles;

  if (threadIdx.x >= kConsumerThreads) {
    release_registers<kProducerRegisters<R::kConsumersDecode>>();
    const int producer_warp = warp - kConsumerThreads / kWarpSize;
    const int n_slots = n_tiles * kSlotsPerTile;
    constexpr int kCopy = R::kCopyBytes;
    constexpr int kWindowData = static_cast<int>(row_codec::data_bytes(kWindow, kHeadDim) / kCopy);
    constexpr int kWindowPieces = kWindowData + static_cast<int>(row_codec::scale_bytes(kWindow, kHeadDim) / kCopy);
    constexpr int kCompressedData = static_cast<int>(row_codec::data_bytes(kCompressed, kHeadDim) / kCopy);
    constexpr int kCompressedPieces =
        kCompressedData + static_cast<int>(row_codec::scale_bytes(kCompressed, kHeadDim) / kCopy);
    constexpr int kLanesPerRow = kWarpSize / kRowsPerProducerWarp;  // a producer warp's lanes per row of a slot
    constexpr auto kRounds = [](int pieces) { return (pieces + kLanesPerRow - 1) / kLanesPerRow; };
    // The warp's row r of slot j, and the first of its rows.
    auto row_index = [&](int j, int r) {
      return first_row + int64_t{j} * kSlotRows + producer_warp * kRowsPerProducerWarp + r;
    };
    // Lane l looks up row l % 4 of slot (l / 4) of a batch of kLookupSlots slots, in three steps
    // a batch apart, so that each load is used a batch after it was issued: the pick (the row
    // number), the block-table entry (the page), the address.
    const int lookup_slot = lane / kRowsPerProducerWarp, lookup_row = lane % kRowsPerProducerWarp;
    auto lookup_index = [&](int batch) { return row_index(batch * kLookupSlots + lookup_slot, lookup_row); };
    auto first_page = [&](const DeviceRows& cache) {
      const bool tabled = cache.first_logical_page && cache.block_table && rows.sequence >= 0 &&
                          rows.sequence < cache.num_sequences;
      return tabled ? cache.first_logical_page[rows.sequence] : 0;
    };
    const int32_t window_first_page = first_page(a.window), compressed_first_page = first_page(a.compressed);
    const uint64_t streamed = row_copy_policy(a, t);
    DSV4_PHASE_STAMP_ON(kStampTokenRows, window_first_page + compressed_first_page + rows.n_rows);
    auto row_number = [&](int batch) { return rows.row_number(a, t, lookup_index(batch), end_row); };
    struct PageRow {
      int64_t page = -1;  // the page of a flat cache may exceed int32
      int32_t row = 0;
    };
    auto page_of = [&](const DeviceRows& cache, int32_t first, int64_t number) {
      const RowSplit split = split_rows(number, cache.rows_per_page);
      if (cache.block_table == nullptr) return PageRow{split.block, static_cast<int32_t>(split.row)};
      const int64_t block = split.block - first;
      if (rows.sequence < 0 || rows.sequence >= cache.num_sequences || block < 0 || block >= cache.blocks_per_sequence)
        return PageRow{};
      return PageRow{cache.block_table[rows.sequence * cache.blocks_per_sequence + block], static_cast<int32_t>(split.row)};
    };
    auto page_row = [&](int batch, int64_t number) {
      if (number < 0) return PageRow{};
      return lookup_index(batch) < rows.n_window ? page_of(a.window, window_first_page, number)
                                                 : page_of(a.compressed, compressed_first_page, number);
    };
    auto ref_of = [&](int batch, const PageRow& pr) {
      if (pr.page < 0) return RowRef{};
      return lookup_index(batch) < rows.n_window ? row_in_page(a.window, pr.page, pr.row)
                                                 : row_in_page(a.compressed, pr.page, pr.row);
    };
    // The refs of batches b (current) and b + 1 (next), the page of b + 2, the row number of b + 3:
    // at the start the four picks, then the three pages, each level's loads in flight together.
    const int64_t number0 = row_number(0), number1 = row_number(1), number2 = row_number(2);
    int64_t number_ahead = row_number(3);
    const PageRow page0 = page_row(0, number0), page1 = page_row(1, number1);
    PageRow page_ahead = page_row(2, number2);
    RowRef ref_current = ref_of(0, page0);
    RowRef ref_next = ref_of(1, page1);
    DSV4_PHASE_STAMP_ON(kStampFirstPages, page0.page + number0);
    int current_batch = 0;
    // Copies the warp's rows of slot j, piece c of its row r to shared address place(r, c), one
    // cp.async group, invalid rows zero-filled (they then decode to zeros: no stale bytes reach the
    // MMAs); returns the valid bits. Lane l copies pieces l % 8, l % 8 + 8, … of the warp's row
    // l / 8, so that it fetches that row's address once per slot (spreading a slot's pieces over
    // the lanes in rounds, each piece shuffling its row's address and deriving its row and place,
    // took ~50 instructions per cp.async); a slot of picks only takes the rounds of the smaller rows.
    auto request = [&](int j, auto place) {
      const RowRef ref = j / kLookupSlots == current_batch ? ref_current : ref_next;
      const int source = (j % kLookupSlots) * kRowsPerProducerWarp;
      const uint32_t valid = (__ballot_sync(kFullMask, ref.valid()) >> source) & ((1u << kRowsPerProducerWarp) - 1);
      const int window_rows = rows.window_rows_in_tile(row_index(j, 0), kRowsPerProducerWarp);
      const int r = lane / kLanesPerRow, first_piece = lane % kLanesPerRow;
      const RowRef row{reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.data), source + r)),
                       reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.scales), source + r))};
      const bool present = row.valid(), window_row = r < window_rows;
      const int data_pieces = window_row ? kWindowData : kCompressedData;
      const int pieces = window_row ? kWindowPieces : kCompressedPieces;
      auto copy_rounds = [&](auto rounds_constant) {
#pragma unroll
        for (int round = 0; round < decltype(rounds_constant)::value; ++round) {
          const int c = first_piece + round * kLanesPerRow;
          const uint8_t* from = !present ? reinterpret_cast<const uint8_t*>(a.q)  // any readable address; not read
                                : c < data_pieces ? row.data + kCopy * c : row.scales + kCopy * (c - data_pieces);
          if (c < pieces) cp_async<kCopy>(place(r, c), from, present, streamed);
        }
      };
      if (window_rows == 0) copy_rounds(std::integral_constant<int, kRounds(kCompressedPieces)>{});
      else copy_rounds(std::integral_constant<int, kRounds(kWindowPieces > kCompressedPieces ? kWindowPieces : kCompressedPieces)>{});
      cp_async_commit();
      return valid;
    };
    // Slots are requested in order. The one that opens batch b + 1 shifts the lookups: its refs
    // become current, and the next batch's refs, page and row number are prepared.
    auto advance_lookups = [&](int j) {
      if (j % kLookupSlots == 0 && j / kLookupSlots == current_batch + 1) {
        ++current_batch;
        ref_current = ref_next;
        ref_next = ref_of(current_batch + 1, page_ahead);
        page_ahead = page_row(current_batch + 2, number_ahead);
        number_ahead = row_number(current_batch + 3);
      }
    };
    auto row_bits = [](uint32_t valids, int s) {
      return static_cast<uint8_t>((valids >> (kRowsPerProducerWarp * s)) & ((1u << kRowsPerProducerWarp) - 1));
    };
    // The warp's rows of a raw-ring slot from `to` (its first row; rows row_bytes apart).
    auto in_ring = [&](uint8_t* to, int row_bytes) {
      const uint32_t slot = shared_address(to) + producer_warp * kRowsPerProducerWarp * row_bytes;
      return [slot, row_bytes](int r, int c) { return slot + r * row_bytes + kCopy * c; };
    };
    if constexpr (R::kDirect) {
      // bf16 rows, straight into slot s of tile u's stage (pieces of 8 channels). Nothing waits
      // for the copies here: each thread's land on the stage's mbarrier (with the warp's valid
      // bits, stored first), so tile u + 1's are in flight while the consumers compute tile u, and
      // tile u + 2's are issued as soon as they are done with tile u.
      static_assert(kCopy == 16);
      for (int u = 0; u < n_tiles; ++u) {
        if (u >= 2) barrier_sync(kEmptyBarrier + u % 2, kThreads);  // the consumers are done with tile u - 2
        const uint32_t tile = shared_address(tiles + (u % 2) * kTileBytes);
        uint32_t valids = 0;
#pragma unroll
        for (int s = 0; s < kSlotsPerTile; ++s) {
          const int row0 = s * kSlotRows + producer_warp * kRowsPerProducerWarp;
          advance_lookups(u * kSlotsPerTile + s);
          valids |= request(u * kSlotsPerTile + s, [tile, row0](int r, int c) {
                      return tile + wgmma::sw128_offset(kTileRows, row0 + r, 8 * c);
                    }) << (kRowsPerProducerWarp * s);
        }
        const uint32_t landed = tile_landed + 8 * (u % 2);
        cp_async_mbarrier_arrive(landed);
        if (lane == 0) {
#pragma unroll
          for (int s = 0; s < kSlotsPerTile; ++s)
            valid_bits[((u % kValidStages) * kSlotsPerTile + s) * kProducerWarps + producer_warp] = row_bits(valids, s);
          mbarrier_arrive(landed);
        }
      }
      cp_async_wait<0>();
      return;
    }
    if constexpr (R::kConsumersDecode) {
      // A tile at a time, as soon as its place in the ring is decoded: a wide tile needs the whole
      // ring (every earlier tile decoded), a narrow one its stage, last held by tile u - 2 (or by a
      // wide tile u - 1). Its rows' copies, its valid bits, and each lane's arrival on the tile
      // parity's mbarrier.
      int decoded = 0;  // the consumers' hand-backs met so far: tiles 0 … decoded - 1
      auto wait_decoded = [&](int tiles_decoded) {
        for (; decoded < tiles_decoded; ++decoded) barrier_sync(kRawFreeBarrier + decoded % 2, kThreads);
      };
      // Of the warp's row l % 4 of the tile's slot (l % 16) / 4, lane l < 16 copies the data and
      // lane l + 16 the scales, each in one bulk copy: the copy engine gathers the tile and nothing
      // waits for it here; the consumers wait on the tile parity's mbarrier for every lane's bytes.
      // A warp's bulk copies issue one at a time, so tile 0's scales, whose copies every block
      // waits for, go by 16-byte cp.async pieces beside the data's bulk copies (half the serial
      // issue; later tiles' copies overlap the MMAs and keep the streaming L2 policy). The pieces
      // take no L2 policy: with one, ptxas 13.0 put it in an odd uniform register (desc[UR1]), an
      // illegal instruction.
      const int slot = (lane % 16) / kRowsPerProducerWarp, r = lane % kRowsPerProducerWarp;
      const bool scales_part = lane >= 16;
      constexpr int kScalePieces = std::max(kWindowPieces - kWindowData, kCompressedPieces - kCompressedData);
      for (int u = 0; u < n_tiles; ++u) {
        const bool wide = is_wide_tile(rows, first_row, u);
        wait_decoded(wide || (u > 0 && is_wide_tile(rows, first_row, u - 1)) ? u : u - 1);
        // The consumers' reads of these ring bytes (and zero fills) before the copy engine's writes.
        wgmma::fence_shared_for_async_proxy();
        const int row_bytes = wide ? R::kRowBytes : R::kNarrowRowBytes;
        const int j = u * kSlotsPerTile + slot;
        advance_lookups(u * kSlotsPerTile);
        static_assert(kLookupSlots % kSlotsPerTile == 0);  // a tile's slots lie in one batch: the current one
        const RowRef ref = ref_current;
        const int first_source = (u * kSlotsPerTile) % kLookupSlots * kRowsPerProducerWarp;
        const uint32_t valids = (__ballot_sync(kFullMask, ref.valid()) >> first_source) & 0xffffu;
        const int source = first_source + slot * kRowsPerProducerWarp + r;
        const auto data = __shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.data), source);
        const auto scales = __shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(ref.scales), source);
        const bool window_row = row_index(j, r) < rows.n_window;
        const KvRowFormat format = window_row ? kWindow : kCompressed;
        const int data_bytes = static_cast<int>(row_codec::data_bytes(format, kHeadDim));
        const int bytes = scales_part ? static_cast<int>(row_codec::scale_bytes(format, kHeadDim)) : data_bytes;
        uint8_t* const place = R::tile_rows(ring, wide, u) +
                               (slot * kSlotRows + producer_warp * kRowsPerProducerWarp + r) * row_bytes +
                               (scales_part ? data_bytes : 0);
        const bool present = (valids >> (slot * kRowsPerProducerWarp + r)) & 1u;
        const uint32_t landed = tile_landed + 8 * (u % 2);
        const bool by_pieces = scales_part && u == 0;
        // Absent rows decode to zeros: no stale bytes reach the MMAs.
        if (by_pieces) {
          const uint8_t* const from = present ? reinterpret_cast<const uint8_t*>(scales)
                                              : reinterpret_cast<const uint8_t*>(a.q);  // any readable address; not read
#pragma unroll
          for (int c = 0; c < kScalePieces; ++c)
            if (c * kCopy < bytes) cp_async<kCopy>(shared_address(place) + c * kCopy, from + (present ? c * kCopy : 0), present);
        } else if (present) {
          bulk_copy(shared_address(place), reinterpret_cast<const uint8_t*>(scales_part ? scales : data), bytes, landed,
                    streamed);
        } else {
          for (int b = 0; b < bytes; b += 16) *reinterpret_cast<uint4*>(place + b) = make_uint4(0, 0, 0, 0);
        }
        DSV4_PHASE_STAMP(kStampCopiesIssued + u);
        if (lane == 0)
#pragma unroll
          for (int s = 0; s < kSlotsPerTile; ++s)
            valid_bits[((u % kValidStages) * kSlotsPerTile + s) * kProducerWarps + producer_warp] = row_bits(valids, s);
        if (by_pieces) cp_async_mbarrier_arrive(landed);
        else mbarrier_arrive_expect_tx(landed, present ? bytes : 0);
        __syncwarp();  // the data and scale lanes diverged: the warp meets the next aligned barrier whole
      }
      wait_decoded(n_tiles - 1);  // every hand-back met once
      cp_async_wait_all();  // tile 0's scale pieces (in no committed group) land before the lane exits
      return;
    }
    // Slots j + 1 … j + kAhead in flight while j is decoded (their valid bits in `valids`, slot j
    // lowest).
    uint32_t valids = 0;
#pragma unroll
    for (int j = 0; j < R::kAhead; ++j) {
      if (j < n_slots)
        valids |= request(j, in_ring(ring + (j % R::kSlots) * R::kSlotBytes, R::kRowBytes))
                  << (kRowsPerProducerWarp * j);
      else cp_async_commit();
    }
    for (int j = 0; j < n_slots; ++j) {
      const int issued = j + R::kAhead;
      advance_lookups(issued);
      if (issued < n_slots)
        valids |= request(issued, in_ring(ring + (issued % R::kSlots) * R::kSlotBytes, R::kRowBytes))
                  << (kRowsPerProducerWarp * R::kAhead);
      else cp_async_commit();  // an empty group: the wait below then always means slot j
      cp_async_wait<R::kAhead>();
      __syncwarp();  // every lane's bytes of slot j have landed
      const int tile_index = j / kSlotsPerTile, slot_in_tile = j % kSlotsPerTile, stage = tile_index % 2;
      if (slot_in_tile == 0 && tile_index >= 2) barrier_sync(kEmptyBarrier + stage, kThreads);  // tile - 2 consumed
      // A lane per 16 channels of a row.
      const uint8_t* const raw = ring + (j % R::kSlots) * R::kSlotBytes + producer_warp * kRowsPerProducerWarp * R::kRowBytes;
      const int row0 = slot_in_tile * kSlotRows + producer_warp * kRowsPerProducerWarp;
      decode_rows<kWindow, kCompressed, R::kRowBytes>(raw, tiles + stage * kTileBytes, row0,
                                                      rows.window_rows_in_tile(row_index(j, 0), kRowsPerProducerWarp), lane);
      if (lane == 0)
        valid_bits[((tile_index % kValidStages) * kSlotsPerTile + slot_in_tile) * kProducerWarps + producer_warp] =
            row_bits(valids, 0);
      __syncwarp();  // ring slot j % kSlots is read: slot j + kSlots may overwrite it
      if (slot_in_tile == kSlotsPerTile - 1) {
        wgmma::fence_shared_for_async_proxy();
        barrier_arrive(kFullBarrier + stage, kThreads);
      }
      valids >>= kRowsPerProducerWarp;
    }
    return;
  }

  // Consumers: warpgroup `half` scores rows [32·half, 32·half + 32) of each tile and computes output
  // channels [256·half, 256·half + 256).
  claim_registers<kConsumerRegisters<R::kConsumersDecode>>();
  constexpr bool kPaired = kPairedTiles<kWindow, kCompressed>;
  constexpr int kQRegisterSteps = R::kQRegisterSteps, kQSharedChannels = kHeadDim - R::kQSharedFirst;
  // Broadcast from lane 0, so that ptxas knows it is warp-uniform: the descriptors built from it
  // then stay in uniform registers (else each wgmma's costs a 64-bit add and two R2UR moves).
  const int half = __shfl_sync(kFullMask, static_cast<int>(threadIdx.x) / 128, 0), warp_in_group = warp % 4;
  const uint32_t q_address = shared_address(q_tile), tiles_address = shared_address(tiles);
  // Q's shared channels in 16-byte pieces: piece i is head i / kPiecesPerHead's channels
  // kQSharedFirst + 8·(i % kPiecesPerHead) …; its source is null for a head group's padding.
  constexpr int kPiecesPerHead = kQSharedChannels / 8, kQPieces = kHeadsPerBlock * kPiecesPerHead;
  const auto q_piece_source = [&](int i) -> const uint16_t* {
    const int h = i / kPiecesPerHead;
    return head0 + h < head_end ? a.q + (t * a.heads + head0 + h) * kHeadDim + R::kQSharedFirst + 8 * (i % kPiecesPerHead)
                                : nullptr;
  };
  const auto q_piece_destination = [&](int i) {
    return reinterpret_cast<uint4*>(q_tile + wgmma::sw128_offset(kHeadsPerBlock, i / kPiecesPerHead, 8 * (i % kPiecesPerHead)));
  };
  const uint64_t q_policy = row_copy_policy(a, t);
  for (int i = threadIdx.x; i < kQPieces; i += kConsumerThreads) {
    const uint16_t* const source = q_piece_source(i);
    if (source) cp_async<16>(shared_address(q_piece_destination(i)), source, true, q_policy);
    else *q_piece_destination(i) = make_uint4(0, 0, 0, 0);
  }
  // The A fragments of Q's first k steps: the warp's heads 16·w + g (+ 8), positions 16k + 2c (+ 8)
  // and the next (channels c and c + 4 of their group in paired order).
  uint32_t q_first[kQRegisterSteps][4];
  const int head_base = head0 + warp_in_group * 16, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int k = 0; k < kQRegisterSteps; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = head_base + g + 8 * (e & 1), position = 16 * k + 2 * c + 8 * (e >> 1);
      const uint16_t* const q_row = a.q + (t * a.heads + head) * kHeadDim;
      if (head >= head_end) q_first[k][e] = 0u;
      else if constexpr (kPaired)
        q_first[k][e] = uint32_t{q_row[paired_channel(position)]} | uint32_t{q_row[paired_channel(position + 1)]} << 16;
      else q_first[k][e] = *reinterpret_cast<const uint32_t*>(q_row + position);
    }
  cp_async_wait_all();
  if constexpr (kPaired) {  // each thread's own pieces into paired order, all its loads in flight together
    constexpr int kQPiecesPerThread = kQPieces / kConsumerThreads;
    static_assert(kQPieces % kConsumerThreads == 0);
    uint4 pieces[kQPiecesPerThread];
#pragma unroll
    for (int i = 0; i < kQPiecesPerThread; ++i) pieces[i] = *q_piece_destination(static_cast<int>(threadIdx.x) + i * kConsumerThreads);
#pragma unroll
    for (int i = 0; i < kQPiecesPerThread; ++i)
      *q_piece_destination(static_cast<int>(threadIdx.x) + i * kConsumerThreads) = row_decode::bf16x8_paired(pieces[i]);
  }
  wgmma::fence_shared_for_async_proxy();
  barrier_sync(kConsumerBarrier, kConsumerThreads);
  DSV4_PHASE_STAMP(kStampQLanded);

  mma::SoftmaxState softmax(a, head_base, head_end, lane);
  float acc[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  constexpr float kValueScale = kTileValueScale<kWindow, kCompressed>;
  const float scale_log2 = a.scale * kLog2e * kValueScale;
  // The lane's two heads in the exchange, the other warpgroup's entries kHeadsPerBlock away.
  float* const exchange_own = exchange + half * kHeadsPerBlock + warp_in_group * 16 + g;
  const float* const exchange_other = exchange + (half ^ 1) * kHeadsPerBlock + warp_in_group * 16 + g;

  // The descriptors of step k are the base's plus the step's offset (in the 16-byte units of the
  // start address field; every address here stays below 256 KB, so no carry leaves that field).
  const uint64_t q_descriptor = wgmma::k_major(q_address), p_descriptor = wgmma::k_major(shared_address(p_tile));
  auto step_offset = [](int k) { return static_cast<uint32_t>(((k / 4) * kTileRows * 128 + (k % 4) * 32) >> 4); };
  // Consumers that decode: the warp's rows of tile `tile_index` from the ring into its stage, once
  // the producer has handed them over; the ring then takes the next tile's.
  auto decode_tile = [&](int tile_index) {
    mbarrier_wait(tile_landed + 8 * (tile_index % 2), (tile_index / 2) & 1);
    uint8_t* const tile = tiles + (tile_index % 2) * kTileBytes;
    const bool wide = is_wide_tile(rows, first_row, tile_index);
    const uint8_t* const raw = R::tile_rows(ring, wide, tile_index);
    if (wide) {
#pragma unroll 1
      for (int group = 0; group < kRowsPerConsumerWarp; group += kRowsPerProducerWarp) {
        const int row0 = warp * kRowsPerConsumerWarp + group;
        const int window_rows =
            rows.window_rows_in_tile(first_row + int64_t{tile_index} * kTileRows + row0, kRowsPerProducerWarp);
        decode_rows<kWindow, kCompressed, R::kRowBytes>(raw + row0 * R::kRowBytes, tile, row0, window_rows, lane);
      }
    } else {
      decode_row<kCompressed, R::kNarrowRowBytes, kPaired, kRowsPerConsumerWarp>(
          raw + warp * kRowsPerConsumerWarp * R::kNarrowRowBytes, tile, warp * kRowsPerConsumerWarp, 0, lane);
    }
    if (tile_index + 1 < n_tiles) barrier_arrive(kRawFreeBarrier + tile_index % 2, kThreads);
    wgmma::fence_shared_for_async_proxy();  // the MMAs read the tile through the async proxy
  };
  if constexpr (R::kConsumersDecode)
    if (n_tiles > 0) decode_tile(0);
  DSV4_PHASE_STAMP(kStampFirstDecoded);
  for (int i = 0; i < n_tiles; ++i) {
    const int stage = i % 2;
    // Tile i is decoded (and every consumer is done with tile i - 1), or its bf16 rows have landed.
    if constexpr (R::kConsumersDecode) {
      barrier_sync(kConsumerBarrier, kConsumerThreads);
    } else if constexpr (R::kDirect) {
      mbarrier_wait(tile_landed + 8 * stage, (i / 2) & 1);
      wgmma::fence_shared_for_async_proxy();  // the copies' writes, before the MMAs read the tile
    } else {
      barrier_sync(kFullBarrier + stage, kThreads);
    }
    DSV4_PHASE_STAMP(tile_stamp(i, kTileReady));
    const uint32_t tile = tiles_address + stage * kTileBytes;
    const uint64_t key_descriptor = wgmma::k_major(tile + half * kWarpgroupRows * 128);
    const uint64_t value_descriptor = wgmma::mn_major(tile + half * 4 * kTileRows * 128, kTileRows);
    float s[kScoreTiles][4];
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kQRegisterSteps; ++k) wgmma::m64n32k16_rs(s, q_first[k], key_descriptor + step_offset(k), k > 0);
#pragma unroll
    for (int k = kQRegisterSteps; k < kQkSteps; ++k)
      wgmma::m64n32k16_ss(s, q_descriptor + step_offset(k - kQRegisterSteps), key_descriptor + step_offset(k), true);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(s);
    DSV4_PHASE_STAMP(tile_stamp(i, kScored));

    // This warpgroup's rows that hold a row (bit 16·s + 4·w + r: row r of producer warp w in the
    // warpgroup's slot s), packed from the tile's valid bits: a byte of four bits per slot and
    // producer warp, eight bytes for the warpgroup's two slots. (Sixteen byte loads shifted into a
    // 64-bit mask took about 60 instructions a tile, on the softmax's critical path.)
    static_assert(kRowsPerProducerWarp == 4 && kSlotsPerTile * kProducerWarps == 16 && kWarpgroupRows == 32);
    const uint2 warpgroup_bits =
        *reinterpret_cast<const uint2*>(valid_bits + ((i % kValidStages) * kSlotsPerTile + 2 * half) * kProducerWarps);
    auto four_nibbles = [](uint32_t bytes) {  // the low nibbles of four bytes, in order
      return __byte_perm(bytes | bytes >> 4, 0u, 0x4420u);
    };
    const uint32_t valid_rows = four_nibbles(warpgroup_bits.x) | four_nibbles(warpgroup_bits.y) << 16;
    // The heads' maxima over this warpgroup's rows. Where the consumers decode, after the first
    // tile (where every max rises: there is none yet), P is stored at once relative to the running
    // max, on the speculation that no head's max rises (it rises only by more than kMaxSlack), and
    // the P barrier checks that over both warpgroups. Where some head's does rise, its maxima over
    // the whole tile (this warpgroup's, then the other's) give P again, as exp_scores gives it, and
    // a second barrier. Either way the bits are those of exchanging the maxima first. (The other
    // kernels exchange them first: fp8_ds_mla's consumers would spill holding the scores through
    // the barrier, and the bf16 rows' would need a barrier at each tile's start; both measured
    // slower.)
    float tile_max[2];
    mma::scaled_tile_max(s, valid_rows, scale_log2, lane, tile_max);
    if (c == 0) exchange_own[0] = tile_max[0], exchange_own[8] = tile_max[1];
    // P of the warpgroup's rows, as bf16, into the P tile: element e of the A fragment of its k
    // step k, rows 16k + 2c (+ 8) of this half.
    const uint32_t p_address = shared_address(p_tile);
    auto store_p = [&](int k, int e, uint32_t pair) {
      const int head = warp_in_group * 16 + g + 8 * (e & 1), row = half * kWarpgroupRows + 16 * k + 8 * (e >> 1);
      store_shared_u32(p_address + wgmma::sw128_offset(kHeadsPerBlock, head, row) + 4 * c, pair);
    };
    bool p_whole = false;
    float tile_sum[2];
    if (R::kConsumersDecode && i > 0) {
      const bool raises =
          mma::raises_max(softmax.running_max[0], tile_max[0]) || mma::raises_max(softmax.running_max[1], tile_max[1]);
      mma::exp_scores_at_running_max(s, softmax, tile_sum, store_p);
      wgmma::fence_shared_for_async_proxy();
      DSV4_PHASE_STAMP(tile_stamp(i, kPStored));
      // The P tile is whole unless some head's max rises (the same answer in every consumer).
      p_whole = !barrier_sync_or(kConsumerBarrier, kConsumerThreads, raises);
    } else {
      barrier_sync(kConsumerBarrier, kConsumerThreads);  // the maxima are exchanged
    }
    if (p_whole) {
      softmax.running_sum[0] += tile_sum[0], softmax.running_sum[1] += tile_sum[1];
    } else {
      tile_max[0] = fmaxf(tile_max[0], exchange_other[0]), tile_max[1] = fmaxf(tile_max[1], exchange_other[8]);
      float correction[2];
      mma::exp_scores(s, tile_max, softmax, correction);
      mma::for_each_a_fragment(s, store_p);
      wgmma::fence_shared_for_async_proxy();
      if (correction[0] != 1.0f || correction[1] != 1.0f) mma::rescale(acc, correction);  // x 1 changes no bit
      barrier_sync(kConsumerBarrier, kConsumerThreads);  // the P tile is whole
    }
    DSV4_PHASE_STAMP(tile_stamp(i, kPWhole));
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kPvSteps; ++k)
      wgmma::m64n256k16_ss(acc, p_descriptor + step_offset(k), value_descriptor + ((k * 16 * 128) >> 4));
    wgmma::commit();
    if constexpr (R::kConsumersDecode)
      if (i + 1 < n_tiles) decode_tile(i + 1);  // while the MMAs run; its stage held tile i - 1
    DSV4_PHASE_STAMP(tile_stamp(i, kNextDecoded));
    wgmma::wait<0>();
    wgmma::pin(acc);
    DSV4_PHASE_STAMP(tile_stamp(i, kPvDone));
    if constexpr (!R::kConsumersDecode)
      if (i + 2 < n_tiles) barrier_arrive(kEmptyBarrier + stage, kThreads);  // the producer waits for it at tile i + 2
  }

  // Each warpgroup's sums cover its rows: both take the same total. (Every consumer read the last
  // maxima before the last P barrier, and after this barrier every MMA is done: Q, P and the tiles
  // are free to stage the output.)
  if (c == 0) exchange_own[0] = softmax.running_sum[0], exchange_own[8] = softmax.running_sum[1];
  barrier_sync(kConsumerBarrier, kConsumerThreads);
#pragma unroll
  for (int r = 0; r < 2; ++r)
    softmax.running_sum[r] = exchange[warp_in_group * 16 + g + 8 * r] + exchange[kHeadsPerBlock + warp_in_group * 16 + g + 8 * r];
  if (a.splits > 1) {
    merge_splits_in_cluster<Out, kPaired>(a, t, head0, head_end, half, lane, acc, softmax, kValueScale, shared);
  } else {
    write_output_staged<Out, kPaired>(a, t, head0, head_end, half, lane, acc, softmax, kValueScale,
                                      shared + half * kHeadsPerBlock * (kHalfChannels + 8) * sizeof(Out));
  }
  DSV4_PHASE_STAMP(kStampEnd);
#endif
}

// Out: uint16_t (bf16 bits) or float; the cache formats of the call (a cache without rows: either).
// `a` comes without its split: with split_allowed the launch plans it and the blocks' head groups
// (plan_split_kv_clusters, from what this device runs at once of this kernel's clusters), for tokens
// attending at most max_rows rows.
template <class Out, KvRowFormat kWindow, KvRowFormat kCompressed>
void launch_sparse_attention_wgmma(SparseAttentionLaunch a, int64_t max_rows, bool split_allowed, cudaStream_t stream) {
  using attention_wgmma::kMaxClusterSplits;
  const auto kernel = sparse_attention_wgmma_kernel<Out, kWindow, kCompressed>;
#ifdef DSV4_PHASE_STAMPS
  static const bool stamps_registered = (register_phase_stamps_dump(), true);
  (void)stamps_registered;
#endif
  constexpr size_t shared_bytes = attention_wgmma::Ring<kWindow, kCompressed>::kSharedBytes;
  static const int registers = [&] {
    cudaFuncAttributes attributes{};
    DSV4_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    return attributes.numRegs;
  }();
  DSV4_CHECK(registers == attention_wgmma::kLaunchRegisters, "sparse_attention (wgmma): the kernel has ", registers,
             " registers per thread, its register hand-over (setmaxnreg) expects ", attention_wgmma::kLaunchRegisters);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(attention_wgmma::kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  // The cluster of a token's split blocks; a dependent launch (the kernel waits for the preceding
  // grids before it reads anything), added for the launch only, not for the capacity queries.
  cudaLaunchAttribute attributes[2] = {{}, dependent_launch_attribute()};
  cudaLaunchAttribute& cluster = attributes[0];
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = 1;
  // capacity[s]: clusters of s blocks the device runs at once, per device (asked once).
  static std::mutex mutex;
  static std::array<std::array<int, kMaxClusterSplits + 1>, 64> capacities{};
  const int device = device_info().ordinal;
  DSV4_CHECK(device < static_cast<int>(capacities.size()), "sparse_attention (wgmma): device ", device,
             " is beyond the ", capacities.size(), " this kernel plans for");
  std::array<int, kMaxClusterSplits + 1> capacity;
  {
    const std::lock_guard lock(mutex);
    std::array<int, kMaxClusterSplits + 1>& known = capacities[static_cast<size_t>(device)];
    if (known[1] == 0)
      for (unsigned s = 1; s <= kMaxClusterSplits; ++s) {
        config.gridDim = dim3(1, 1, s);
        cluster.val.clusterDim.z = s;
        // A cluster size the device cannot place is an error here: it then has no capacity.
        if (cudaOccupancyMaxActiveClusters(&known[s], kernel, &config) != cudaSuccess) {
          (void)cudaGetLastError();
          known[s] = 0;
        }
      }
    capacity = known;
  }
  DSV4_CHECK(capacity[1] > 0, "sparse_attention (wgmma): the device runs no block of this kernel (",
             shared_bytes, " bytes of shared memory)");
  const int64_t tiles = (max_rows + attention_wgmma::kTileRows - 1) / attention_wgmma::kTileRows;
  const ClusterSplitPlan plan =
      split_allowed ? plan_split_kv_clusters(a.tokens, a.heads, attention_wgmma::kHeadsPerBlock, tiles, capacity)
                    : ClusterSplitPlan{{1, tiles}, attention_wgmma::kHeadsPerBlock};
  a.splits = plan.split.splits;
  a.tiles_per_split = plan.split.tiles_per_split;
  const unsigned head_groups = static_cast<unsigned>((a.heads + plan.heads_per_block - 1) / plan.heads_per_block);
  config.gridDim = dim3(static_cast<unsigned>(a.tokens), head_groups, static_cast<unsigned>(a.splits));
  cluster.val.clusterDim.z = static_cast<unsigned>(a.splits);
  config.numAttrs = 2;
  DSV4_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a, plan.heads_per_block));
}

}  // namespace dsv4::cuda

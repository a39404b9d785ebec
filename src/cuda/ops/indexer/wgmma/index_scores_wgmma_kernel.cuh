// Index scores on Hopper's fp8 tensor cores (wgmma m64n32k32 e4m3 -> f32, sm_90a) for FP4 queries
// (IndexScoresParams::fp4_queries) of at most 32 heads against index_mxfp4 keys, exact in every
// precision. See include/dsv4/cuda/indexer.h for the contract, fp4_dots.cuh for why the dots are
// exact: each 32-channel block is one MMA from zeroed accumulators, the e4m3 codes being the
// e2m1 ones moved bit for bit (the keys' codes times 2^-6, the queries' times 2^(d_b − 6)).
//
// Why not mma_f16: Hopper's mma.sync has no fp8 shape, so mma_f16 widens every key code to f16 and
// issues two f16 MMAs per block and 8 heads; one wgmma takes 64 keys x 32 heads x 32 channels
// straight from the e4m3 codes, which leaves the CUDA cores the block combine and the weighted
// head sum.
//
// Shape. A CTA is one warpgroup. It takes a range of keys_per_cta entries (the host sizes it to
// fill the GPU) for one token (decode: four CTAs per SM) or, with kTokenRuns, up to
// kMaxTokensPerCta tokens (prefill chunks: three per SM, for the registers below), and streams
// 128-row stages of the range through a kStages-deep cp.async pipeline (thread t copies row t; in
// fp32 token runs a warp copies its 32 rows as whole rows, a lane a chunk; rows that are not
// addressable are zero-filled). Per 64-row half of a stage each warp reads its 16 rows
// with ldmatrix and moves the codes to e4m3 in registers: the A operand (M = keys). The queries
// are B (N = 32 heads, padded with zero queries; K-major, 32-byte swizzle), staged once per CTA.
// Consecutive tokens of the CTA that read the same sequence (a run) share the stages' loads and,
// half by half, the A operand and the rows' scales, which stay in registers while the run's tokens
// are scored.
//
// Epilogue. A unit is one token and one half of a stage. A lane holds 2 rows x 8 heads of each
// block's accumulators: it combines the blocks with the rows' scales relative to block 0's (in
// block order, as mma_f16 does), forms the weighted terms (where the token and the warp's rows
// allow, of that P' with the folded weights hs·w: fp4_dots.cuh, "Folded weights" and "Row factor";
// bf16_rounding, with bf16 folded weights: one bf16 multiply a pair, "Packed terms") and writes
// them to one of the two 16-row slots of its warp's term buffer (fp32 pairs, or bf16 pairs in
// bf16_rounding); once both slots hold a unit (a token's two halves, or two units of a run), each
// lane adds one row's terms in head order (the reference's order), scales the sum by the row
// factor 2^ek0 where the terms are P''s, and stores the score.
//
// K order. A lane's A register of a block holds the codes of the 4 bytes ldmatrix gives it (bytes
// 4c … 4c + 3 of the block's 16 bytes): the low nibbles are logical k = 4c … 4c + 3, the high ones
// k = 16 + 4c …; logical k is channel 2 (k mod 16) + k / 16 (query_channel), and the queries are
// staged in that order.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/ops/indexer/fp4_dots.cuh"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/token_ranges.cuh"
#include "cuda/ops/indexer/visible_entries.cuh"
#include "dsv4/numeric.h"

namespace dsv4::cuda::index_wgmma {

using namespace index_fp4;

inline constexpr int kThreads = 128;              // one warpgroup
inline constexpr int kTileRows = 64;              // the MMA's M
inline constexpr int kWarpRows = 16;              // a warp's rows of a tile
inline constexpr int kStageRows = 2 * kTileRows;  // one per thread for the copies
inline constexpr int kStages = 3;  // with the term buffers, 4 CTAs fit an SM's shared memory
inline constexpr int kHeads = 32;                 // the MMA's N: the index heads, zero-padded
// The rows of a warp's term buffer (fp32 terms: one a word; bf16_rounding: a pair a word). The
// fragments' writes (a half warp: 4 rows x 8 words in 8-byte pairs; bf16: a warp, 8 rows x 4
// words) and a lane's 16-byte reads of its row (a quarter warp: 8 rows) do not conflict in bf16
// rows 20 words apart, nor in fp32 rows 32 words apart whose 4-word group q of row r lies at
// q ^ (2 (r mod 4) + (r / 4) mod 2): the token runs' rows (fp32 prefill −2.4 %). One-token CTAs
// keep unswizzled rows with 4 words of padding, which hold the row scales their lanes share: their
// fp32 writes conflict two ways, yet conflict-free rows measured slower there (RESULTS,
// forty-fifth session).
template <bool kBf16Rounding, bool kTokenRuns>
struct TermRows {
  static constexpr int kWords = kBf16Rounding ? kHeads / 2 : kHeads;
  static constexpr bool kSwizzled = !kBf16Rounding && kTokenRuns;
  static constexpr int kStride = kSwizzled ? kWords : kWords + 4;
  // Where word `word` of row `row` lies in the row.
  __device__ __forceinline__ static int word_in_row(int row, int word) {
    return kSwizzled ? word ^ ((row & 3) << 3 | (row & 4)) : word;
  }
};
inline constexpr int kMaxTokensPerCta = 8;
// The kernels count a CTA's rows (and the stages beyond them) in 32 bits.
inline constexpr int64_t kMaxEntries = int64_t{1} << 30;
// A CTA of one token (decode) fits 128 registers, four per SM; one that scores runs of several
// tokens keeps a stage's A operand and row scales in registers across the run's tokens, which
// takes more: three per SM.
__host__ __device__ constexpr int ctas_per_sm(bool token_runs) { return token_runs ? 3 : 4; }

__host__ __device__ constexpr int query_channel(int k) { return 2 * (k % 16) + k / 16; }

// The wgmma kernels' call: with tensor_copies (one-token CTAs, the decode kernel, over segregated
// pages of whole 64-row boxes, see index_scores_wgmma.cu) threads 0 and 64 copy a stage's two
// boxes of key_rows and scale_rows, landing on the stage's mbarrier; else every thread copies its
// row with cp.async.
struct IndexScoresWgmmaLaunch : IndexScoresRangeLaunch {
  CUtensorMap key_rows;    // [pages][rows][row bytes], the swizzle of SwizzledKeyRows
  CUtensorMap scale_rows;  // [pages][rows x kBlocks] scale bytes
  bool tensor_copies = false;
};
// A tensor copy's box of rows. (Four boxes a stage, one a warp, measured slower: every warp pays
// the issue, RESULTS, thirty-fourth session.) A box's scales land 128-byte aligned, as tensor
// copies need, for both row sizes.
inline constexpr int kCopyRows = 64;
static_assert(kStageRows % kCopyRows == 0 && kCopyRows % 32 == 0 && kCopyRows * 2 % 128 == 0);

// Shared memory of a CTA (256-byte aligned): the tokens' queries ([tokens][blocks] SW32 [32 heads
// x 32] e4m3), their TokenQueries and fast-path bounds, then the stages (key rows, scale words, row
// masks) and per warp its buffer of weighted terms.
template <int kBlocks, bool kBf16Rounding, bool kTokenRuns>
struct SharedLayout {
  using Terms = TermRows<kBf16Rounding, kTokenRuns>;
  using Keys = SwizzledKeyRows<kBlocks * kBlockChannels / 2>;  // MXFP4: two codes a byte
  static constexpr int kStageBytes = kStageRows * Keys::kBytes;
  static constexpr int kQueryBlockBytes = kHeads * kBlockChannels;
  static constexpr int kMaskWords = kStageRows / 32;  // per stage: addressable rows, then (dim 64) scale in the high half
  int tokens;
  __host__ __device__ size_t query_bytes() const { return size_t(tokens) * kBlocks * kQueryBlockBytes; }
  __host__ __device__ TokenArrays token_arrays() const { return {size_t(tokens), size_t(kHeads), size_t(kBlocks)}; }
  __host__ __device__ size_t tokens_offset() const { return query_bytes(); }
  __host__ __device__ size_t bounds_offset() const { return tokens_offset() + token_arrays().bytes(); }
  // Only one-token CTAs take tensor copies, whose swizzle follows the address bits: their base and
  // stages are 1024-byte aligned. (Token runs keep the smaller alignment: their CTAs fill the SM's
  // shared memory three at a time.)
  __host__ __device__ size_t base_alignment() const { return tokens == 1 ? 1024 : 256; }
  __host__ __device__ size_t stages_offset() const {
    const size_t end = bounds_offset() + TokenArrays::align16(size_t(tokens) * sizeof(FastBounds));
    return tokens == 1 ? (end + base_alignment() - 1) / base_alignment() * base_alignment() : end;
  }
  static constexpr size_t kScaleWordsOffset = size_t(kStages) * kStageBytes;
  static constexpr size_t kMasksOffset = kScaleWordsOffset + size_t(kStages) * kStageRows * 4;
  static constexpr size_t kTermsOffset = kMasksOffset + size_t(kStages) * 2 * kMaskWords * 4;
  static constexpr size_t kTermsBytes = size_t(kThreads / 32) * 2 * kWarpRows * Terms::kStride * 4;
  static constexpr size_t kBarriersOffset = kTermsOffset + kTermsBytes;  // [stage] mbarrier (tensor copies)
  // + base_alignment(): the kernel aligns its base
  __host__ __device__ size_t bytes() const { return stages_offset() + kBarriersOffset + kStages * 8 + base_alignment(); }
};

// Block b of q[t, h] (exponent eq, folded by `shift`; null: a padding head) as the e4m3 codes of
// v·2^(shift − 6) in row h of its SW32 tile, logical k order (query_channel).
inline __device__ __noinline__ void stage_query_block(const uint16_t* q, int h, int eq, int shift, uint8_t* tile) {
  float x[kBlockChannels];
  load_query_block(q, x);
  uint32_t words[8];
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    uint32_t pairs[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // exact: the values are e4m3 numbers
      auto value = [&](int k) { return eq == kNoExponent ? 0.0f : scaled_by_power_of_two(x[query_channel(k)], shift - 6 - eq); };
      pairs[i] = __nv_cvt_float2_to_fp8x2(make_float2(value(4 * w + 2 * i), value(4 * w + 2 * i + 1)), __NV_SATFINITE, __NV_E4M3);
    }
    words[w] = pairs[0] | pairs[1] << 16;
  }
#pragma unroll
  for (int u = 0; u < 2; ++u)
    *reinterpret_cast<uint4*>(tile + wgmma::sw32_offset(h, u)) =
        make_uint4(words[4 * u], words[4 * u + 1], words[4 * u + 2], words[4 * u + 3]);
  wgmma::fence_shared_for_async_proxy();  // the MMAs read the tile through the async proxy
}

// A key row's scales as the fast path reads them ("Row factor" in fp4_dots.cuh): the row factor
// 2^ek0 and the other blocks' 2^(ek_b − ek0) (right for the fast path's normal scale bytes, which
// lie at most kFastSpread apart; the double path rereads the scale bytes).
template <int kBlocks>
struct alignas(4 * kBlocks) RowScales {
  float factor;
  float relative[kBlocks - 1];
};
template <int kBlocks>
__device__ __forceinline__ RowScales<kBlocks> row_scales(uint32_t scale_bytes) {
  RowScales<kBlocks> s;
  const int e0 = static_cast<int>(scale_bytes & 0xffu);
  s.factor = __uint_as_float(static_cast<uint32_t>(e0) << 23);
#pragma unroll
  for (int b = 1; b < kBlocks; ++b)
    s.relative[b - 1] = __uint_as_float(static_cast<uint32_t>(static_cast<int>(__byte_perm(scale_bytes, 0u, 0x4440u + b)) - e0 + 127) << 23);
  return s;
}

template <int kBlocks, bool kBf16Rounding, bool kTokenRuns>
__global__ void __launch_bounds__(kThreads, ctas_per_sm(kTokenRuns))
    index_scores_wgmma_kernel(const __grid_constant__ IndexScoresWgmmaLaunch a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = SharedLayout<kBlocks, kBf16Rounding, kTokenRuns>;
  using Terms = typename Layout::Terms;
  // cp.async stages copied as whole rows a warp at a time: measured faster only in the fp32 token
  // runs, the kernel whose shared memory is the busiest (fp32 prefill −3.7 %, bf16 +0.3 %, the
  // one-token decode +4–6 %: RESULTS, forty-fifth session).
  constexpr bool kWholeRowCopies = kTokenRuns && !kBf16Rounding;
  constexpr int kTermsStride = Terms::kStride;
  using Keys = typename Layout::Keys;
  const Layout layout{a.tokens_per_cta};
  const uint32_t alignment = static_cast<uint32_t>(layout.base_alignment());
  extern __shared__ uint8_t shared_unaligned[];
  uint8_t* const shared = shared_unaligned + ((alignment - shared_address(shared_unaligned) % alignment) % alignment);
  uint8_t* const queries = shared;
  const TokenQueries tq = layout.token_arrays().at(shared + layout.tokens_offset());
  FastBounds* const token_bounds = reinterpret_cast<FastBounds*>(shared + layout.bounds_offset());  // [tokens]
  uint8_t* const stages = shared + layout.stages_offset();
  const uint32_t* const scale_words = reinterpret_cast<const uint32_t*>(stages + Layout::kScaleWordsOffset);
  uint32_t* const row_masks = reinterpret_cast<uint32_t*>(stages + Layout::kMasksOffset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  uint32_t* const terms = reinterpret_cast<uint32_t*>(stages + Layout::kTermsOffset) + warp * 2 * kWarpRows * kTermsStride;

  const uint32_t stage_base = shared_address(stages);
  const uint32_t stage_landed = stage_base + static_cast<uint32_t>(Layout::kBarriersOffset);  // [slot] mbarrier
  uint32_t landed_parity = 0;  // bit s: the parity of slot s's next phase (tensor copies)
  const bool tensor_copies = !kTokenRuns && a.tensor_copies;  // the token-run kernels have none
  // Each box's first thread issues its copies and arrives; start_tokens' barriers order the init
  // before every other use.
  if (tensor_copies && threadIdx.x == 0) {
    for (int slot = 0; slot < kStages; ++slot) mbarrier_init(stage_landed + 8 * slot, kStageRows / kCopyRows);
    fence_mbarrier_init();
  }

  const CtaRange cta(a);
  const int64_t t0 = cta.t0, k0 = cta.k0, k1 = cta.k1;
  const int count = cta.count;
  // Rows of the range are counted from k0 in 32 bits (the host bounds the entries:
  // kMaxEntries).
  const int range_rows = static_cast<int>(k1 - k0);
  if (!start_tokens<kBlocks, kThreads>(a, cta, kHeads, tq, [&](const uint16_t* q, int i, int h, int b, int eq, int shift) {
        stage_query_block(q, h, eq, shift, queries + (i * kBlocks + b) * Layout::kQueryBlockBytes);
      }))
    return;
  // Bit i: token i's weights fold and its fast rows' terms are formed from P' (factors_rows); and
  // (bf16_rounding) its weights are bf16 numbers, so that those terms are packed ("Packed terms").
  // In registers for every unit.
  uint32_t folding_tokens = 0, packing_tokens = 0;
  for (int i = 0; i < count; ++i) {
    const int* stats = tq.stats + kTokenStats * i;
    const bool folds = factors_rows(stats);
    folding_tokens |= static_cast<uint32_t>(folds) << i;
    packing_tokens |= static_cast<uint32_t>(kBf16Rounding && folds && stats[kWeightsBf16] != 0) << i;
  }
  auto fast_bounds = [&](int i) {
    return FastBounds(tq.stats + kTokenStats * i, true, kBf16Rounding, ((folding_tokens >> i) & 1u) != 0);
  };
  // Read by every unit of a token (the first stage's barrier orders these stores before them).
  for (int i = threadIdx.x; i < count; i += kThreads) token_bounds[i] = fast_bounds(i);

  const int stage_count = (range_rows + kStageRows - 1) / kStageRows;
  // Where token i's scores of the range go, and how many of its rows are visible to it.
  struct TokenScores {
    float* row;  // [range_rows] f32
    int visible, token;
  };
  auto token_scores = [&](int i) {
    const int64_t visible = min(max(tq.visible[i] - k0, int64_t{0}), int64_t{range_rows});
    return TokenScores{a.scores + (t0 + i) * a.entries + k0, static_cast<int>(visible), i};
  };
  // Token i's block b: its tile's start address in the descriptor's low word, which no tile's
  // offset carries out of (shared memory is below 2^18 bytes), so the offset is added in 32 bits:
  // as a 64-bit sum, ptxas spent three uniform instructions a block on it.
  const uint64_t query_descriptor = wgmma::sw32_k_major(shared_address(queries));  // token 0, block 0
  auto query_block_descriptor = [&](int i, int b) {
    const uint32_t low = static_cast<uint32_t>(query_descriptor) + static_cast<uint32_t>((i * kBlocks + b) * (Layout::kQueryBlockBytes / 16));
    return (query_descriptor >> 32) << 32 | low;
  };

  // Where this lane's ldmatrix reads of half 0 of a stage lie in it (half 1's are kTileRows rows
  // further, under the same swizzle): formed once, where ptxas rebuilt them in every half.
  uint32_t a_offsets[kBlocks / 2];
#pragma unroll
  for (int m = 0; m < kBlocks / 2; ++m)
    a_offsets[m] = static_cast<uint32_t>(Keys::offset(warp * kWarpRows + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * m + (lane >> 4)));
  static_assert(Keys::offset(kTileRows + 5, 1) == Keys::offset(5, 1) + kTileRows * Keys::kBytes);
  // This lane's heads' folded weights hs·w (heads 8j + 2c, + 1 of n tile j) for token i. (The
  // plain path, rare, reads hs and w where it uses them.)
  struct HeadFactors {
    float2 weight[kHeads / 8];
  };
  auto load_head_factors = [&](int i) {
    HeadFactors f;
#pragma unroll
    for (int j = 0; j < kHeads / 8; ++j)
      f.weight[j] = *reinterpret_cast<const float2*>(tq.folded_weights + i * kHeads + 8 * j + 2 * c);
    return f;
  };
  for (int first = 0; first < count;) {
    // A run of tokens reading the same sequence: its stages are loaded once.
    const TokenRun run(cta, first, tq);
    const int end = kTokenRuns ? run.end : first + 1;  // without runs, a CTA has one token
    // (Token runs.) A row within the bounds of every token of the run is a fast row for each, so
    // that a half whose rows all are skips the tokens' checks (bf16 prefill −2 %).
    FastBounds run_bounds = fast_bounds(first);
    if constexpr (kTokenRuns)
      for (int i = first + 1; i < end; ++i) run_bounds = run_bounds.intersection(fast_bounds(i));
    const TokenScores first_scores = token_scores(first);  // (one-token CTAs)
    // (One-token CTAs: read once, not in each half; decode −2.6 %.)
    const HeadFactors first_head = load_head_factors(first);
    const int64_t sequence = run.sequence;
    const int load_rows = static_cast<int>(max(run.load_end - k0, int64_t{0}));  // rows the run loads

    // Thread t copies row t of stage n (cp.async), or (tensor copies) the box of rows from there.
    // Stages are issued in order, so the thread follows its row's (page, row) instead of dividing
    // per stage, and reads the block table a stage ahead (else each stage's copies wait for that
    // load).
    const SequenceRows sequence_rows(a.keys, sequence);
    RowWalk next(k0 + threadIdx.x, kStageRows, a.keys.rows_per_page);
    int32_t next_entry = sequence_rows.entry(next.at);  // 32 bits until used: nothing waits for the load
    auto advance = [&] {
      next.advance();
      next_entry = sequence_rows.entry(next.at);
    };
    // Tensor copies: a box's first thread copies it when it starts among the run's rows in a page that
    // exists, records which of its rows are addressable and arrives on the stage's barrier. The
    // warpgroup's first MMA waits for the last warp to come (Nsight Compute's "Stall GMMA"): with
    // thread 0 dividing and reading the block table for the whole stage, a third of the scan's
    // samples. Two warps share the issue now, which takes coordinates only, from the row walk.
    auto issue_tensor_copies = [&](int n) {
      const int slot = n % kStages;
      const int first_row = n * kStageRows + threadIdx.x;
      if (threadIdx.x % kCopyRows != 0 || n * kStageRows >= load_rows) return;
      const uint32_t barrier = stage_landed + 8 * slot;
      const int64_t page = first_row < load_rows ? sequence_rows.page(next.at, next_entry) : -1;
      const bool exists = page >= 0 && page < a.keys.num_pages;
      const int row = static_cast<int>(next.at.row);
      advance();
      if (exists) {
        // The keys are read once: evict-first, so that what every step reads again stays in L2.
        const uint64_t policy = l2_evict_first_policy();
        tensor_copy_3d(stage_base + slot * Layout::kStageBytes + threadIdx.x * Keys::kBytes, &a.key_rows, 0, row,
                       static_cast<int>(page), barrier, policy);
        tensor_copy_2d(stage_base + static_cast<uint32_t>(Layout::kScaleWordsOffset) + slot * kStageRows * 4 + threadIdx.x * kBlocks,
                       &a.scale_rows, row * kBlocks, static_cast<int>(page), barrier, policy);
      }
      const int rows = exists ? min(load_rows - first_row, kCopyRows) : 0;
      uint32_t* masks = row_masks + slot * 2 * Layout::kMaskWords + warp;
#pragma unroll
      for (int w = 0; w < kCopyRows / 32; ++w)  // the low min(rows - 32w, 32) bits: ~0u shifted in, clamped at 32
        masks[w] = __funnelshift_lc(~0u, 0u, static_cast<uint32_t>(max(rows - 32 * w, 0)));
      mbarrier_arrive_expect_tx(barrier, exists ? kCopyRows * (Keys::kBytes + kBlocks) : 0);
    };
    auto issue = [&](int n) {
      if (tensor_copies) return issue_tensor_copies(n);
      const int slot = n % kStages;
      if (n * kStageRows < load_rows) {
        const int j = n * kStageRows + threadIdx.x;
        const RowRef ref =
            j < load_rows ? row_in_page(a.keys, sequence_rows.page(next.at, next_entry), next.at.row) : RowRef{};
        advance();
        const uint8_t* data = ref.valid() ? ref.data : a.keys.pages;
        const uint32_t rows = stage_base + slot * Layout::kStageBytes;
        // The rows' addressable bits: before the copies where they read them, else after (as the
        // other kernels were measured).
        uint32_t addressable = kWholeRowCopies ? __ballot_sync(kFullMask, ref.valid()) : 0u;
        if constexpr (kWholeRowCopies) {
          // The warp's 32 rows in Keys::kChunks copies of 32 / kChunks whole rows (a lane a chunk,
          // its row's address from the lane that walks it): each copy fills whole lines of the
          // stage, where a copy of one chunk of each lane's row costs a shared-memory wavefront a
          // lane.
#pragma unroll
          for (int k = 0; k < Keys::kChunks; ++k) {
            const int row = k * (32 / Keys::kChunks) + lane / Keys::kChunks, chunk = lane % Keys::kChunks;  // of the warp's
            const uint8_t* row_data = reinterpret_cast<const uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(data), row));
            cp_async<16>(rows + Keys::offset(warp * 32 + row, chunk), row_data + 16 * chunk, ((addressable >> row) & 1u) != 0);
          }
        } else {
#pragma unroll
          for (int q = 0; q < Keys::kChunks; ++q) cp_async<16>(rows + Keys::offset(threadIdx.x, q), data + 16 * q, ref.valid());
        }
        // A dim-64 row has a 2-byte scale: the aligned word holding it.
        const uintptr_t scale_address = reinterpret_cast<uintptr_t>(ref.valid() ? ref.scales : a.keys.pages);
        cp_async<4>(stage_base + static_cast<uint32_t>(Layout::kScaleWordsOffset) + (slot * kStageRows + threadIdx.x) * 4,
                    reinterpret_cast<const void*>(scale_address & ~uintptr_t{3}), ref.valid());
        if constexpr (!kWholeRowCopies) addressable = __ballot_sync(kFullMask, ref.valid());
        const uint32_t high_half = __ballot_sync(kFullMask, (scale_address & 2) != 0);
        uint32_t* masks = row_masks + slot * 2 * Layout::kMaskWords;
        if (lane == 0) masks[warp] = addressable, masks[Layout::kMaskWords + warp] = high_half;
      }
      cp_async_commit();
    };

    for (int n = 0; n < kStages - 1; ++n) issue(n);
    for (int n = 0; n < stage_count; ++n) {
      if (!tensor_copies) cp_async_wait<kStages - 2>();
      __syncthreads();  // (cp.async) stage n has landed; every thread is done with the slot issue() refills
      issue(n + kStages - 1);
      const int slot = n % kStages;
      const int stage_row = n * kStageRows;  // the stage's first row
      if (tensor_copies && stage_row < load_rows) {  // issued: wait for its copies and row masks
        mbarrier_wait(stage_landed + 8 * slot, (landed_parity >> slot) & 1u);
        landed_parity ^= 1u << slot;
      }
      if (stage_row >= load_rows) {  // beyond every token of the run
        const int j = stage_row + threadIdx.x;
        for (int i = first; i < end; ++i)
          if (j < range_rows) token_scores(i).row[j] = -INFINITY;
        continue;
      }
      const uint32_t rows = stage_base + slot * Layout::kStageBytes;
      const uint32_t* masks = row_masks + slot * 2 * Layout::kMaskWords;
      auto addressable = [&](int row) { return ((masks[row / 32] >> (row % 32)) & 1u) != 0; };
      // A row's kBlocks ue8m0 scale bytes.
      // (Tensor copies land a box's scales packed: kBlocks bytes a row.)
      auto scale_word = [&](int row) {
        if constexpr (kBlocks == 2) {
          if (tensor_copies) return uint32_t{reinterpret_cast<const uint16_t*>(scale_words + slot * kStageRows)[row]};
          const uint32_t word = scale_words[slot * kStageRows + row];
          return (masks[Layout::kMaskWords + row / 32] >> (row % 32)) & 1u ? word >> 16 : word & 0xffffu;
        }
        return scale_words[slot * kStageRows + row];
      };

      // The work of one unit (one token, one 64-row half of the stage), in the pieces both loop
      // orders below share. The A operand of the warp's 16 rows of half `half`: rows g and g + 8
      // of each block, codes moved to e4m3.
      auto load_a = [&](int half, uint32_t (&frag)[kBlocks][4]) {
#pragma unroll
        for (int m = 0; m < kBlocks / 2; ++m) {
          uint32_t r[4];  // rows g / g + 8 of blocks 2m and 2m + 1
          ldmatrix_x4(r, rows + a_offsets[m] + half * (kTileRows * Keys::kBytes));
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            uint32_t(&f)[4] = frag[2 * m + s];
            f[0] = low_e2m1x4_to_e4m3x4(r[2 * s]), f[1] = low_e2m1x4_to_e4m3x4(r[2 * s + 1]);
            f[2] = high_e2m1x4_to_e4m3x4(r[2 * s]), f[3] = high_e2m1x4_to_e4m3x4(r[2 * s + 1]);
          }
        }
      };
      auto issue_mmas = [&](int i, const uint32_t (&frag)[kBlocks][4], float (&acc)[kBlocks][4][4]) {
        wgmma::fence();
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) wgmma::m64n32k32_e4m3_rs(acc[b], frag[b], query_block_descriptor(i, b));
        wgmma::commit();
      };
      // Waits for them; the accumulators and the A operand stay put until then.
      auto finish_mmas = [&](float (&acc)[kBlocks][4][4], uint32_t (&frag)[kBlocks][4]) {
        wgmma::wait<0>();
#pragma unroll
        for (int b = 0; b < kBlocks; ++b) wgmma::pin(acc[b]);
        wgmma::pin(frag);
      };
      // Token i's dots of this lane's 2 rows x 8 heads of the warp's rows from warp_row, from the
      // finished MMAs; their weighted terms into buffer slot `slot` of the warp's term buffer.
      // Returns whether the terms are the fast rows' P' terms, whose sums the row factor scales
      // ("Row factor"; the same answer in every lane of the warp).
      auto store_terms = [&](int i, const float (&acc)[kBlocks][4][4], const RowScales<kBlocks> (&rs)[2],
                             const bool (&fast)[2], bool known_fast, const HeadFactors& head, int warp_row, int slot) {
        float value[kHeads / 8][2][2];  // [n tile j][row r][head 8j + 2c + k]: P', then (unfolded) the dot
        // Block by block (in block order for each value), so that each block's accumulators and
        // scales are done with before the next block's are read.
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
#pragma unroll
          for (int j = 0; j < kHeads / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int k = 0; k < 2; ++k)
                value[j][r][k] = b == 0 ? acc[0][j][2 * r + k]
                                        : __fmaf_rn(acc[b][j][2 * r + k], rs[r].relative[b - 1], value[j][r][k]);
        // (known_fast: the caller knows every row of the warp's to be fast.)
        const bool all_fast = known_fast || __all_sync(kFullMask, fast[0] && fast[1]);
        // Word `word` of buffer row g + 8r of the slot.
        auto row_term = [&](int r, int word) {
          const int row = slot * kWarpRows + g + 8 * r;
          return terms + row * kTermsStride + Terms::word_in_row(row, word);
        };
        auto store = [&](int j, int r, float2 weight) {
          const float x = value[j][r][0], y = value[j][r][1];
          if constexpr (kBf16Rounding)
            *row_term(r, 4 * j + c) = bf16_weighted_term_pair(x, y, weight);
          else
            *reinterpret_cast<float2*>(row_term(r, 8 * j + 2 * c)) =
                make_float2(__fmul_rn(relu(x), weight.x), __fmul_rn(relu(y), weight.y));
        };
        if (((packing_tokens >> i) & 1u) != 0 && all_fast) {
#pragma unroll
          for (int j = 0; j < kHeads / 8; ++j) {
            const uint32_t weight = bf16_pair(head.weight[j]);  // exact: kWeightsBf16
#pragma unroll
            for (int r = 0; r < 2; ++r) *row_term(r, 4 * j + c) = packed_weighted_terms(value[j][r][0], value[j][r][1], weight);
          }
          return true;
        }
        if (((folding_tokens >> i) & 1u) != 0 && all_fast) {
#pragma unroll
          for (int j = 0; j < kHeads / 8; ++j) store(j, 0, head.weight[j]), store(j, 1, head.weight[j]);
          return true;
        }
        // Else the dots themselves, row by row (the row's scale bytes reread: this path is rare):
        // P'·2^ek0·hs on the fast path (both exact), else the double sum.
        const float* bs = tq.block_scales + size_t(i) * kHeads * kBlocks;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t word = scale_word(warp_row + g + 8 * r);
          const float factor = row_scales<kBlocks>(word).factor;
#pragma unroll
          for (int j = 0; j < kHeads / 8; ++j)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
              const int h = 8 * j + 2 * c + k;
              if (fast[r]) {
                value[j][r][k] = __fmul_rn(__fmul_rn(value[j][r][k], factor), tq.head_scales[i * kHeads + h]);
                continue;
              }
              double sum = 0.0;
#pragma unroll
              for (int b = 0; b < kBlocks; ++b)
                sum = __fma_rn(static_cast<double>(acc[b][j][2 * r + k]) *
                                   static_cast<double>(ue8m0_to_float(static_cast<uint8_t>(word >> (8 * b)))),
                               static_cast<double>(bs[h * kBlocks + b]), sum);
              value[j][r][k] = __double2float_rn(sum);
            }
        }
#pragma unroll
        for (int j = 0; j < kHeads / 8; ++j) {
          const float2 weight = *reinterpret_cast<const float2*>(tq.weights + i * kHeads + 8 * j + 2 * c);
          store(j, 0, weight), store(j, 1, weight);
        }
        return false;
      };
      // Each lane adds the terms of one buffer row (slot lane / 16, row lane % 16: row sum_row of
      // the stage for token `token`) in the reference's order, head by head, and stores the score
      // times `factor` (the row factor for P' terms, else 1; exact) when `stores`. Padding heads
      // (zero queries and weights) add +0, which leaves the sum alone: it starts at +0 and a
      // round-to-nearest sum is never -0 unless both terms are.
      auto sum_terms = [&](int sum_row, const TokenScores& out, bool stores, float factor) {
        const int j = stage_row + sum_row;
        const bool in_range = stores && j < range_rows;
        // The row's mask first: its loads are in flight while the terms are added.
        const bool visible = addressable(sum_row) & (j < out.visible);
        __syncwarp();
        float score = 0.0f;
        const uint32_t* row = terms + lane * kTermsStride;
#pragma unroll
        for (int k = 0; k < Terms::kWords; k += 4) {
          const uint4 t = *reinterpret_cast<const uint4*>(row + Terms::word_in_row(lane, k));
          if constexpr (kBf16Rounding) {  // four head pairs
            for (const uint32_t pair : {t.x, t.y, t.z, t.w}) score = __fadd_rn(__fadd_rn(score, low_bf16(pair)), high_bf16(pair));
          } else {
            for (const uint32_t term : {t.x, t.y, t.z, t.w}) score = __fadd_rn(score, __uint_as_float(term));
          }
        }
        score = __fmul_rn(score, factor);
        if (in_range) {
          const bool listed = !a.candidates || contains_block(a.candidates + (t0 + out.token) * a.num_candidates,
                                                              a.num_candidates, split_rows(k0 + j, a.candidate_block_size).block);
          out.row[j] = !(visible && listed) ? -INFINITY : kBf16Rounding && !a.partial ? bf16_rounded(score) : score;
        }
        __syncwarp();
      };
      const int lane_row = warp * kWarpRows + lane % kWarpRows;  // of its half

      if constexpr (!kTokenRuns) {
        // One token: its two halves fill the two buffer slots. Unrolled, so that the lane's
        // addresses are formed once per stage: in a loop ptxas rebuilt them from threadIdx.x in
        // each half, and the S2R's latency stalled the half's first instructions (3 % at 64 x 128K).
        const int sum_row = (lane / kWarpRows) * kTileRows + lane_row;
        // Each lane reads the scale bytes of the row it sums (an MMA fragment holds a row in four
        // lanes, and two rows a half): it checks the fast path, whose checks the warp shares by
        // ballot (bit 16·half + row of the half's 16), and forms the row's scales, which the
        // fragments' lanes read (slot 16·half + row).
        const uint32_t sum_word = scale_word(sum_row);
        const FastBounds bounds = token_bounds[first];
        const uint32_t fast_rows = __ballot_sync(kFullMask, !addressable(sum_row) || bounds.holds(key_exponents<kBlocks>(sum_word)));
        static_assert(sizeof(RowScales<kBlocks>) <= (Terms::kStride - Terms::kWords) * 4);
        auto row_scale_slot = [&](int i) {  // the padding of buffer row i
          return reinterpret_cast<RowScales<kBlocks>*>(terms + i * kTermsStride + Terms::kWords);
        };
        const RowScales<kBlocks> sum_scales = row_scales<kBlocks>(sum_word);
        *row_scale_slot(lane) = sum_scales;
        __syncwarp();
        uint32_t factored_halves = 0;  // bit h: half h's terms are P' terms
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int warp_row = half * kTileRows + warp * kWarpRows;  // the warp's first row in the stage
          uint32_t frag[kBlocks][4];
          load_a(half, frag);
          float acc[kBlocks][4][4];
          issue_mmas(first, frag, acc);
          // Meanwhile the rows' scales.
          const HeadFactors& head = first_head;
          const RowScales<kBlocks> rs[2] = {*row_scale_slot(kWarpRows * half + g), *row_scale_slot(kWarpRows * half + g + 8)};
          const bool fast[2] = {((fast_rows >> (kWarpRows * half + g)) & 1u) != 0, ((fast_rows >> (kWarpRows * half + g + 8)) & 1u) != 0};
          finish_mmas(acc, frag);
          factored_halves |= static_cast<uint32_t>(store_terms(first, acc, rs, fast, false, head, warp_row, half)) << half;
        }
        sum_terms(sum_row, first_scores, true, (factored_halves >> (lane / kWarpRows)) & 1u ? sum_scales.factor : 1.0f);
      } else {
        // A run of tokens: half by half, the A operand and the rows' scales stay in registers
        // while the run's tokens are scored; consecutive units fill the buffer slots in turn, and
        // every full pair (or the last unit) is summed.
        int unit = 0;
        int2 slot_units[2] = {};  // (half + 2 · P' terms, token) of each buffer slot
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
          const int warp_row = half * kTileRows + warp * kWarpRows;
          uint32_t frag[kBlocks][4];
          load_a(half, frag);
          float acc[kBlocks][4][4];
          issue_mmas(first, frag, acc);  // the first token's MMAs run while the rows' scales are read
          // Rows g and g + 8 of the warp's: their scales, and what each token's fast-path check reads.
          const uint32_t words[2] = {scale_word(warp_row + g), scale_word(warp_row + g + 8)};
          const RowScales<kBlocks> rs[2] = {row_scales<kBlocks>(words[0]), row_scales<kBlocks>(words[1])};
          const ExponentRange ranges[2] = {key_exponents<kBlocks>(words[0]), key_exponents<kBlocks>(words[1])};
          const bool addressable_rows[2] = {addressable(warp_row + g), addressable(warp_row + g + 8)};
          const bool run_fast = __all_sync(kFullMask, (!addressable_rows[0] || run_bounds.holds(ranges[0])) &&
                                                          (!addressable_rows[1] || run_bounds.holds(ranges[1])));
#pragma unroll 1
          for (int i = first; i < end; ++i, ++unit) {
            if (i > first) issue_mmas(i, frag, acc);
            const HeadFactors head = load_head_factors(i);
            bool fast[2] = {true, true};
            if (!run_fast) {
              const FastBounds bounds = token_bounds[i];
              fast[0] = !addressable_rows[0] || bounds.holds(ranges[0]), fast[1] = !addressable_rows[1] || bounds.holds(ranges[1]);
            }
            finish_mmas(acc, frag);
            const int buffer_slot = unit & 1;
            const bool factored = store_terms(i, acc, rs, fast, run_fast, head, warp_row, buffer_slot);
            (buffer_slot == 0 ? slot_units[0] : slot_units[1]) = make_int2(half + 2 * factored, i);
            const bool last = half == 1 && i == end - 1;
            if (buffer_slot == 0 && !last) continue;  // the pair is not full yet
            const int mine = lane / kWarpRows;
            const int2 summed = mine == 0 ? slot_units[0] : slot_units[1];
            const int sum_row = (summed.x & 1) * kTileRows + lane_row;
            sum_terms(sum_row, token_scores(summed.y), mine <= buffer_slot, summed.x > 1 ? row_scales<kBlocks>(scale_word(sum_row)).factor : 1.0f);
          }
        }
      }
    }
    cp_async_wait<0>();  // the remaining groups are empty; the next run reuses the stages
    __syncthreads();
    first = end;
  }
#endif
}

template <int kBlocks, bool kBf16Rounding, bool kTokenRuns>
void launch_index_scores_wgmma(const IndexScoresWgmmaLaunch& a, cudaStream_t stream) {
  const size_t shared = SharedLayout<kBlocks, kBf16Rounding, kTokenRuns>{a.tokens_per_cta}.bytes();
  auto kernel = index_scores_wgmma_kernel<kBlocks, kBf16Rounding, kTokenRuns>;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  kernel<<<range_grid(a), kThreads, shared, stream>>>(a);
}

}  // namespace dsv4::cuda::index_wgmma

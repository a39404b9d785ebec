// Index scores on tensor cores (mma.sync m16n8k16 f16 with fp32 accumulation, the keys' FP8 /
// FP4 codes widened in registers; sm_89+, built for sm_90a) for FP4 queries
// (IndexScoresParams::fp4_queries) against index_mxfp4 keys (exact) or index_fp8 keys (fp32
// precision only). See include/dsv4/cuda/indexer.h for the contract.
//
// Why f16 and not fp8 MMAs: Hopper runs fp8 only in wgmma; an e4m3 mma.sync compiles to an
// emulation (e4m3 -> f16 unpacks, two f16 MMAs and fp32 adds per instruction), which Nsight
// Compute showed dominating this kernel. Widening the codes once per fragment and issuing the f16
// MMAs directly does the same arithmetic with a third of the instructions.
//
// Shape. A CTA takes up to kMaxTokensPerCta tokens and a range of keys_per_cta entries (the host
// sizes it to fill the GPU). Each warp streams its own 32-row stages of the range (stages warp,
// warp + kWarps, …) through a kStages-deep cp.async pipeline into shared memory (no CTA barrier
// in the loop), reads the two 16-row fragments of a stage with ldmatrix (the MMA's M; rows
// swizzled so that the 8 row addresses of a matrix hit 8 bank groups), and multiplies them by
// the queries' B fragments: the index heads are N (n tiles of 8, padded with zero queries), each
// 32-channel block two K = 16 steps accumulated from zero. Consecutive tokens of the CTA that read the same sequence (a
// prefill chunk) share the stage's loads and conversions.
//
// Exactness (index_mxfp4): fp4_dots.cuh; the e4m3 codes of queries and keys are widened to f16
// (exact) for the f16 MMAs.
//
// index_fp8 keys: the e4m3 × e2m1 block sums are fp32 sums of exact products, rounded where they
// need more than 24 bits, and the block terms are always added in fp32: fp32 precision only; the
// chooser leaves bf16_rounding calls to the SIMT kernel.
//
// K order. A lane widens the 4-byte words ldmatrix gives it (bytes 4c … 4c + 3 of its rows' 16-byte
// chunks) into the f16 pairs of its A registers without moving bytes between lanes, so logical k
// of a block's K step s maps to a channel (query_channel): index_fp8 keys hold the channels in
// order, index_mxfp4 keys two per byte (low nibble first). The queries are staged in that order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/async_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/indexer/fp4_dots.cuh"
#include "cuda/ops/indexer/token_ranges.cuh"

namespace dsv4::cuda::index_mma {

using namespace index_fp4;

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kFragmentKeys = 16;  // the MMA's M
inline constexpr int kStageRows = 32;     // rows a warp copies and scores per stage: one per lane
inline constexpr int kStages = 3;         // a warp's stages in its pipeline
inline constexpr int kKeyGranule = kWarps * kStageRows;  // keys_per_cta is a multiple of it
inline constexpr int kSumHeads = 32;       // heads per pass of the ordered head sum
inline constexpr int kTermsStride = kSumHeads + 4;  // 16-byte rows: a lane's float4 reads of its row do not conflict
inline constexpr int kMaxTokensPerCta = 8;
inline constexpr int kMinBlocksPerSm = 4;
inline constexpr int kMaxHeads = 128;

__host__ __device__ constexpr int head_tiles(int heads) { return (heads + 7) / 8; }

// A warp's stage of key rows (SwizzledKeyRows).
template <int kBlocks, bool kFp8>
struct KeyRows : SwizzledKeyRows<kFp8 ? kBlocks * kBlockChannels : kBlocks * kBlockChannels / 2> {
  using Rows = KeyRows::SwizzledKeyRows;  // 2, 4 or 8 chunks
  static constexpr int kStageBytes = kStageRows * Rows::kBytes;
  // ldmatrix.x4 per 16-row fragment, each covering chunks 2m and 2m + 1: two MXFP4 blocks, one fp8 block
  static constexpr int kLoads = Rows::kChunks / 2;
};

// Shared memory of a CTA: the tokens' query fragments, scales, weights and ranges, then per warp
// its pipeline stages, the current stage's key scales and the staging of weighted terms for the
// ordered head sum.
template <int kBlocks, bool kFp8>
struct SharedLayout {
  using Keys = KeyRows<kBlocks, kFp8>;
  int tokens, tiles;
  __host__ __device__ SharedLayout(int tokens_per_cta, int heads) : tokens(tokens_per_cta), tiles(head_tiles(heads)) {}
  __host__ __device__ int padded_heads() const { return tiles * 8; }
  // uint4 [tokens][tiles][kBlocks][32 lanes]: a lane's f16 B fragments of one n tile and block,
  // (b0, b1) of K step 0, then of K step 1.
  __host__ __device__ size_t query_bytes() const { return size_t(tokens) * tiles * kBlocks * 32 * 16; }
  // The tokens' scales, weights, exponents and ranges (TokenQueries).
  __host__ __device__ TokenArrays token_arrays() const {
    return {size_t(tokens), size_t(padded_heads()), size_t(kBlocks)};
  }
  __host__ __device__ size_t tokens_offset() const { return query_bytes(); }
  __host__ __device__ size_t warps_offset() const { return tokens_offset() + token_arrays().bytes(); }
  // Per warp: [kStages][kStageBytes] key rows, uint32 [kStages][32] scale words, uint32
  // [kStages][2] row masks (addressable; MXFP4 dim 64: scale in the word's high half), float
  // [32][kBlocks] the stage's key scales 2^ek_b, float [16][kTermsStride] a fragment's weighted
  // terms.
  static constexpr size_t kScaleWordsOffset = size_t(kStages) * Keys::kStageBytes;
  static constexpr size_t kMasksOffset = kScaleWordsOffset + size_t(kStages) * kStageRows * 4;
  static constexpr size_t kKeyScalesOffset = (kMasksOffset + kStages * 8 + 15) / 16 * 16;
  static constexpr size_t kTermsOffset = kKeyScalesOffset + size_t(kStageRows) * kBlocks * 4;
  static constexpr size_t kWarpBytes = kTermsOffset + size_t(kFragmentKeys) * kTermsStride * 4;
  __host__ __device__ size_t bytes() const { return warps_offset() + kWarps * kWarpBytes; }
};

// Four e4m3 codes -> two f16 pairs (bytes 0, 1 and 2, 3; exact).
__device__ __forceinline__ uint2 e4m3x4_to_f16x4(uint32_t codes) {
  uint2 pairs{0u, 0u};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
      : "=r"(pairs.x), "=r"(pairs.y)
      : "r"(codes));
#else
  __trap();  // the chooser runs this implementation on sm_90 only
#endif
  return pairs;
}

// d = a·b (+ d when kAccumulate) on f16 tensor cores with fp32 accumulation. A 16x16 row major:
// a[0] (g, 2c..2c+1), a[1] (g+8, 2c..), a[2] (g, 8+2c..), a[3] (g+8, 8+2c..); B 16x8: b.x (k 2c..,
// n g), b.y (k 8+2c.., n g); C: d[0..1] (g, 2c..2c+1), d[2..3] (g+8, 2c..); lane l, g = l / 4, c = l % 4.
template <bool kAccumulate>
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kAccumulate)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// The block sum of one 32-channel block: two K = 16 steps from zero.
__device__ __forceinline__ void block_mma(float (&d)[4], const uint32_t (&a)[2][4], uint4 b) {
  mma_f16<false>(d, a[0], b.x, b.y);
  mma_f16<true>(d, a[1], b.z, b.w);
}

// The channel at k (0 … 15) of K step s of a block, in the order the key words are widened: a
// lane's word of rows g / g + 8 gives k = 2c, 2c + 1 (its first two codes) and 8 + 2c, 9 + 2c
// (the last two) of each step.
template <bool kFp8>
__host__ __device__ constexpr int query_channel(int s, int k) {
  const int c = (k % 8) / 2, half = k / 8, i = k % 2;
  // index_fp8: step s is the block's chunk s (channels 16s …), the word bytes 4c … 4c + 3;
  // index_mxfp4: the word is bytes 4c … 4c + 3 of the block, step 0 their low nibbles, step 1 the high.
  return kFp8 ? 16 * s + 4 * c + 2 * half + i : 2 * (4 * c + 2 * half + i) + s;
}


// Converts block b of q[t, h] (exponent eq, folded by `shift`) into the f16 B fragments of its n
// tile: values v·2^(shift − 6) (exact), lane 4·(h % 8) + c holding k = 2c, 2c + 1 and 8 + 2c, 9 + 2c
// of both K steps, in the keys' K order (query_channel).
template <int kBlocks, bool kFp8>
__device__ __noinline__ void stage_query_block(const uint16_t* q, int h, int b, int eq, int shift, uint4* fragments) {
  float x[kBlockChannels];
  load_query_block(q, x);
  uint16_t values[kBlockChannels];  // f16 bits, by channel: x / 2^eq is e2m1, so these are exact
#pragma unroll
  for (int i = 0; i < kBlockChannels; ++i)
    values[i] = eq == kNoExponent ? 0 : __half_as_ushort(__float2half_rn(scaled_by_power_of_two(x[i], shift - 6 - eq)));
  auto pair = [&](int s, int k) { return values[query_channel<kFp8>(s, k)] | uint32_t{values[query_channel<kFp8>(s, k + 1)]} << 16; };
#pragma unroll
  for (int c = 0; c < 4; ++c)
    fragments[((h / 8) * kBlocks + b) * 32 + 4 * (h % 8) + c] =
        make_uint4(pair(0, 2 * c), pair(0, 8 + 2 * c), pair(1, 2 * c), pair(1, 8 + 2 * c));
}

template <int kBlocks, bool kFp8>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) index_scores_mma_kernel(IndexScoresRangeLaunch a) {
  using Layout = SharedLayout<kBlocks, kFp8>;
  using Keys = KeyRows<kBlocks, kFp8>;
  extern __shared__ float4 shared4[];
  uint8_t* shared = reinterpret_cast<uint8_t*>(shared4);
  const Layout layout(a.tokens_per_cta, a.heads);
  const int tiles = layout.tiles, padded_heads = layout.padded_heads();
  uint4* q_fragments = reinterpret_cast<uint4*>(shared);
  const TokenQueries tq = layout.token_arrays().at(shared + layout.tokens_offset());
  const float* head_scales = tq.head_scales;
  const float* block_scales = tq.block_scales;
  const float* w_shared = tq.weights;
  const int* stats = tq.stats;
  const int64_t* visible = tq.visible;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint8_t* warp_shared = shared + layout.warps_offset() + warp * Layout::kWarpBytes;
  uint32_t* scale_words = reinterpret_cast<uint32_t*>(warp_shared + Layout::kScaleWordsOffset);
  uint32_t* row_masks = reinterpret_cast<uint32_t*>(warp_shared + Layout::kMasksOffset);
  float* key_scales = reinterpret_cast<float*>(warp_shared + Layout::kKeyScalesOffset);
  float* terms = reinterpret_cast<float*>(warp_shared + Layout::kTermsOffset);

  const CtaRange cta(a);
  const int64_t t0 = cta.t0, k0 = cta.k0, k1 = cta.k1;
  const int count = cta.count;
  if (!start_tokens<kBlocks, kThreads>(a, cta, padded_heads, tq, [&](const uint16_t* q, int i, int h, int b, int eq, int shift) {
        stage_query_block<kBlocks, kFp8>(q, h, b, eq, shift, q_fragments + size_t(i) * tiles * kBlocks * 32);
      }))
    return;

  const int g = lane >> 2, c = lane & 3;
  const int stages = static_cast<int>((k1 - k0 + kStageRows - 1) / kStageRows);
  const int my_stages = (stages - warp + kWarps - 1) / kWarps;
  auto stage_row0 = [&](int n) { return k0 + int64_t{warp + n * kWarps} * kStageRows; };
  const uint32_t stage_base = shared_address(warp_shared);

  for (int first = 0; first < count;) {
    // A run of tokens reading the same sequence: its stages are loaded once.
    const TokenRun run(cta, first, tq);
    const int end = run.end;
    const int64_t sequence = run.sequence, load_end = run.load_end;

    // Lane l copies row l of stage n: its chunks (zero-filled when not addressable) and its scale
    // word; lane 0 records which rows are addressable.
    auto issue = [&](int n) {
      const int slot = n % kStages;
      const int64_t row0 = stage_row0(n);
      if (n < my_stages && row0 < load_end) {
        const int64_t j = row0 + lane;
        const RowRef ref = j < load_end ? row_of_sequence(a.keys, sequence, j) : RowRef{};
        const uint8_t* data = ref.valid() ? ref.data : a.keys.pages;
        const uint32_t rows = stage_base + slot * Keys::kStageBytes;
#pragma unroll
        for (int q = 0; q < Keys::kChunks; ++q) cp_async<16>(rows + Keys::offset(lane, q), data + 16 * q, ref.valid());
        // A dim-64 MXFP4 row has a 2-byte scale: the aligned word holding it.
        const uintptr_t scale_address = reinterpret_cast<uintptr_t>(ref.valid() ? ref.scales : a.keys.pages);
        cp_async<4>(stage_base + static_cast<uint32_t>(Layout::kScaleWordsOffset) + (slot * kStageRows + lane) * 4,
                    reinterpret_cast<const void*>(scale_address & ~uintptr_t{3}), ref.valid());
        const uint32_t addressable = __ballot_sync(kFullMask, ref.valid());
        const uint32_t high_half = __ballot_sync(kFullMask, (scale_address & 2) != 0);
        if (lane == 0) row_masks[2 * slot] = addressable, row_masks[2 * slot + 1] = high_half;
      }
      cp_async_commit();
    };

    for (int n = 0; n < kStages - 1; ++n) issue(n);
    for (int n = 0; n < my_stages; ++n) {
      issue(n + kStages - 1);
      cp_async_wait<kStages - 1>();
      __syncwarp();
      const int slot = n % kStages;
      const int64_t row0 = stage_row0(n), j = row0 + lane;
      const bool in_range = j < k1;
      if (row0 >= load_end) {  // beyond every token of the run
        for (int i = first; i < end; ++i)
          if (in_range) a.scores[(t0 + i) * a.entries + j] = -INFINITY;
        continue;
      }
      const bool own_row = (row_masks[2 * slot] >> lane) & 1u;
      // Row `lane`'s block scales 2^ek_b (index_fp8: its fp32 scale, times 2^-6 for the queries'
      // 2^-6 that the e4m3 keys lack) and exponent range.
      uint32_t word = scale_words[slot * kStageRows + lane];
      if constexpr (!kFp8 && kBlocks == 2) word = (row_masks[2 * slot + 1] >> lane) & 1u ? word >> 16 : word & 0xffffu;
      ExponentRange own_range{0, 0};
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        key_scales[lane * kBlocks + b] =
            kFp8 ? float_from_bits(word) * 0x1p-6f : ue8m0_to_float(static_cast<uint8_t>(word >> (8 * b)));
      if constexpr (!kFp8) own_range = key_exponents<kBlocks>(word);
      __syncwarp();

      // The stage's two 16-row fragments, one after the other (the tokens of the run share its A
      // registers): lane l < 16 sums and stores row 16f + l.
#pragma unroll 1
      for (int f = 0; f < 2; ++f) {
        uint32_t frag[kBlocks][2][4];  // block, K step: the f16 A fragment
        float row_scale[2][kBlocks];  // this lane's rows g and g + 8
        {
          const uint32_t rows = stage_base + slot * Keys::kStageBytes;
          const int row = 16 * f + (lane & 7) + 8 * ((lane >> 3) & 1);
          // The A fragment of one K step from the e4m3 words of rows g and g + 8.
          auto widen = [](uint32_t (&a)[4], uint32_t row_g, uint32_t row_g8) {
            const uint2 p = e4m3x4_to_f16x4(row_g), q = e4m3x4_to_f16x4(row_g8);
            a[0] = p.x, a[1] = q.x, a[2] = p.y, a[3] = q.y;
          };
#pragma unroll
          for (int m = 0; m < Keys::kLoads; ++m) {
            uint32_t r[4];
            ldmatrix_x4(r, rows + Keys::offset(row, 2 * m + (lane >> 4)));
            if constexpr (kFp8) {  // r: rows g / g + 8 of block m's chunks 0 and 1 (its K steps)
              widen(frag[m][0], r[0], r[1]);
              widen(frag[m][1], r[2], r[3]);
            } else {  // r: rows g / g + 8 of blocks 2m and 2m + 1; K step 0 the low nibbles, 1 the high
#pragma unroll
              for (int s = 0; s < 2; ++s) {
                widen(frag[2 * m + s][0], low_e2m1x4_to_e4m3x4(r[2 * s]), low_e2m1x4_to_e4m3x4(r[2 * s + 1]));
                widen(frag[2 * m + s][1], high_e2m1x4_to_e4m3x4(r[2 * s]), high_e2m1x4_to_e4m3x4(r[2 * s + 1]));
              }
            }
          }
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int b = 0; b < kBlocks; ++b) row_scale[r][b] = key_scales[(16 * f + g + 8 * r) * kBlocks + b];
        }
        const int64_t fj = row0 + 16 * f + lane;  // lanes 0-15: the row they sum and store
        const bool f_own_row = lane < kFragmentKeys && ((row_masks[2 * slot] >> (16 * f + lane)) & 1u) != 0;

        for (int i = first; i < end; ++i) {
          const int* token_stats = stats + kTokenStats * i;
          // index_fp8: the fp32 path whenever every head is folded (fp32 precision only).
          const bool own_fast = kFp8 ? token_stats[kEqSpread] <= kMaxFoldShift
                                     : !own_row || FastBounds(token_stats, false, false).holds(own_range);
          const uint32_t fast_rows = __ballot_sync(kFullMask, own_fast) >> (16 * f);
          const bool all_fast = (fast_rows & 0xffffu) == 0xffffu;  // warp-uniform
          const bool fast[2] = {((fast_rows >> g) & 1u) != 0, ((fast_rows >> (g + 8)) & 1u) != 0};
          const uint4* qf = q_fragments + size_t(i) * tiles * kBlocks * 32;
          const float* hs = head_scales + i * padded_heads;
          const float* bs = block_scales + size_t(i) * padded_heads * kBlocks;
          const float* w = w_shared + i * padded_heads;
          float score = 0.0f;  // lanes 0-15: of row 16f + lane
          for (int tile0 = 0; tile0 < tiles; tile0 += kSumHeads / 8) {
            const int tile_end = min(tiles, tile0 + kSumHeads / 8);
            for (int tile = tile0; tile < tile_end; ++tile) {
              float acc[kBlocks][4];
#pragma unroll
              for (int b = 0; b < kBlocks; ++b) block_mma(acc[b], frag[b], qf[(tile * kBlocks + b) * 32 + lane]);
              // This lane's two heads, 2c and 2c + 1 of the tile.
              const int h = tile * 8 + 2 * c;
              const float2 head_scale = *reinterpret_cast<const float2*>(hs + h);
              const float2 weights = *reinterpret_cast<const float2*>(w + h);
              float dot[4];  // rows g, g, g + 8, g + 8; heads 2c, 2c + 1, 2c, 2c + 1
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, k = e & 1;
                float partial = __fmul_rn(acc[0][e], row_scale[r][0]);
#pragma unroll
                for (int b = 1; b < kBlocks; ++b) partial = __fmaf_rn(acc[b][e], row_scale[r][b], partial);
                dot[e] = __fmul_rn(partial, k ? head_scale.y : head_scale.x);
              }
              if (!all_fast) {  // the rows outside the fast path's bounds: the double sum
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  const int r = e >> 1, k = e & 1;
                  if (fast[r]) continue;
                  double sum = 0.0;
#pragma unroll
                  for (int b = 0; b < kBlocks; ++b)
                    sum = __fma_rn(static_cast<double>(acc[b][e]) * static_cast<double>(row_scale[r][b]),
                                   static_cast<double>(bs[(h + k) * kBlocks + b]), sum);
                  dot[e] = __double2float_rn(sum);
                }
              }
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const float2 term = a.bf16_rounding ? bf16_weighted_terms(dot[2 * r], dot[2 * r + 1], weights)
                                                    : make_float2(__fmul_rn(relu(dot[2 * r]), weights.x),
                                                                  __fmul_rn(relu(dot[2 * r + 1]), weights.y));
                *reinterpret_cast<float2*>(terms + (g + 8 * r) * kTermsStride + (tile - tile0) * 8 + 2 * c) = term;
              }
            }
            __syncwarp();
            // The reference's order, head by head. Padding heads (zero queries and weights) add +0,
            // which leaves the sum alone: it starts at +0 and a round-to-nearest sum is never -0
            // unless both terms are.
            if (lane < kFragmentKeys)
              for (int k = 0; k < (tile_end - tile0) * 8; k += 4) {
                const float4 t = *reinterpret_cast<const float4*>(terms + lane * kTermsStride + k);
                score = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(score, t.x), t.y), t.z), t.w);
              }
            __syncwarp();
          }
          if (lane < kFragmentKeys && fj < k1) {
            const bool listed = !a.candidates || contains_block(a.candidates + (t0 + i) * a.num_candidates,
                                                                a.num_candidates, split_rows(fj, a.candidate_block_size).block);
            const bool scored = f_own_row && fj < visible[i] && listed;
            a.scores[(t0 + i) * a.entries + fj] =
                !scored ? -INFINITY : a.bf16_rounding && !a.partial ? bf16_rounded(score) : score;
          }
        }
      }
    }
    cp_async_wait<0>();  // the remaining groups are empty; the next run reuses the stages
    __syncwarp();
    first = end;
  }
}

template <int kBlocks, bool kFp8>
void launch_index_scores_mma(const IndexScoresRangeLaunch& a, cudaStream_t stream) {
  const size_t shared = SharedLayout<kBlocks, kFp8>(a.tokens_per_cta, a.heads).bytes();
  auto kernel = index_scores_mma_kernel<kBlocks, kFp8>;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  kernel<<<range_grid(a), kThreads, shared, stream>>>(a);
}

}  // namespace dsv4::cuda::index_mma

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
// Exactness (index_mxfp4). q[h] block b is v·2^eq_b (v e2m1), key j block b is u·2^ek_b (u e2m1,
// ek_b its ue8m0 exponent). The queries are staged once per CTA as e4m3 codes of v·2^(d_b − 6)
// with d_b = eq_b − eqmin_h (the head's blocks folded onto its smallest exponent; exact in e4m3
// for d_b <= kMaxFoldShift) and held as f16 (exact), the keys as e4m3 codes of u·2^-6 (the bit
// move of HOPPER_DESIGN §3.2: ((n & 8) << 4) | ((n & 7) << 2)) widened to f16 (exact). The MMAs'
// block sum from a zeroed accumulator is then acc_b = 2^(d_b − 12) Σ v·u: the products are exact
// multiples of 2^(d_b − 14), the 32-term sum below 2^(d_b − 1), so every partial sum has at most
// 13 significant bits and the fp32 accumulation adds them exactly. The dot is
//     dot = 2^(12 + eqmin_h) · Σ_b acc_b·2^ek_b,
// each term acc_b·2^ek_b exact. The four (two for dim 64) fp32 terms are multiples of
// 2^(min E_b − eqmin_h − 14) below 2^(max E_b − eqmin_h + 1) with E_b = eq_b + ek_b, so their fp32
// sum is exact when max E_b − min E_b <= 9 (24 bits), and so is the product with the head's
// power of two when min E_b >= -147 (no bits below 2^-149), max E_b <= 114 and the partial sum
// does not overflow (max d_b + max ek_b <= 126): the fast path, checked per (token, key row) with
// bounds over the token's heads (fast_row). Otherwise the same terms are added in double
// (acc_b · 2^ek_b · 2^(12 + eq_b − d_b), exact while max E_b − min E_b <= 38; a head whose blocks
// span more than kMaxFoldShift octaves is staged unfolded, d_b = 0). Either way the dot is the
// exact dot rounded once to fp32 — what the reference computes (reference/ops.cpp `dot`: eight
// double sums of exact products, exact under the same condition, then one rounding to fp32). So
// the bf16_rounding scores equal the reference's bit for bit, and the fp32 scores differ only by
// the reference's fp32 head sum order (here also in head order: equal unless the host contracts
// multiply-adds). Blocks whose exponents lie more than 38 octaves apart could differ in the last
// bit of the dot's fp32 rounding (neither side sums exactly then).
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
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/visible_entries.cuh"
#include "dsv4/numeric.h"

namespace dsv4::cuda::index_mma {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kFragmentKeys = 16;  // the MMA's M
inline constexpr int kStageRows = 32;     // rows a warp copies and scores per stage: one per lane
inline constexpr int kStages = 3;         // a warp's stages in its pipeline
inline constexpr int kKeyGranule = kWarps * kStageRows;  // keys_per_cta is a multiple of it
inline constexpr int kBlockChannels = 32;  // the MMA's K; the MXFP4 scale tile
inline constexpr int kSumHeads = 32;       // heads per pass of the ordered head sum
inline constexpr int kTermsStride = kSumHeads + 4;  // 16-byte rows: a lane's float4 reads of its row do not conflict
inline constexpr int kMaxTokensPerCta = 8;
inline constexpr int kMinBlocksPerSm = 4;
inline constexpr int kMaxHeads = 128;
inline constexpr int kFastSpread = 9;      // see "Exactness" above
inline constexpr int kFastMinExponent = -147;
inline constexpr int kFastMaxExponent = 114;
inline constexpr int kMaxPartialExponent = 126;
inline constexpr int kMaxFoldShift = 12;     // 6 · 2^(12 − 6) = 384 <= 448, the e4m3 maximum
inline constexpr int kMaxQueryExponent = 115;  // 2^(12 + eq) stays a finite fp32
inline constexpr int16_t kNoExponent = INT16_MIN;  // an all-zero block
inline constexpr int16_t kNotFp4 = INT16_MAX;      // a block that is not e2m1 times a power of two

struct IndexScoresMmaLaunch : IndexScoresLaunch {
  int tokens_per_cta = 1;              // 1 … kMaxTokensPerCta
  int64_t keys_per_cta = kKeyGranule;  // a multiple of kKeyGranule
};

__host__ __device__ constexpr int head_tiles(int heads) { return (heads + 7) / 8; }

// A key row in shared memory: kChunks 16-byte chunks, chunk q of row r at slot
// q ^ ((r · kChunks / 8) % kChunks), so that the 8 rows of an ldmatrix matrix (one chunk each)
// fall on 8 different groups of 4 banks.
template <int kBlocks, bool kFp8>
struct KeyRows {
  static constexpr int kRowBytes = kFp8 ? kBlocks * kBlockChannels : kBlocks * kBlockChannels / 2;
  static constexpr int kChunks = kRowBytes / 16;  // 2, 4 or 8
  static constexpr int kStageBytes = kStageRows * kRowBytes;
  // ldmatrix.x4 per 16-row fragment, each covering chunks 2m and 2m + 1: two MXFP4 blocks, one fp8 block
  static constexpr int kLoads = kChunks / 2;
  __device__ static int offset(int row, int chunk) {
    return row * kRowBytes + ((chunk ^ ((row * kChunks / 8) % kChunks)) << 4);
  }
};

// Shared memory of a CTA: the tokens' query fragments, scales, weights and ranges, then per warp
// its pipeline stages, the current stage's key scales and the staging of weighted terms for the
// ordered head sum.
template <int kBlocks, bool kFp8>
struct SharedLayout {
  using Keys = KeyRows<kBlocks, kFp8>;
  int tokens, tiles;
  __host__ __device__ SharedLayout(int tokens_per_cta, int heads) : tokens(tokens_per_cta), tiles(head_tiles(heads)) {}
  __host__ __device__ static size_t align16(size_t n) { return (n + 15) / 16 * 16; }
  __host__ __device__ int padded_heads() const { return tiles * 8; }
  // uint4 [tokens][tiles][kBlocks][32 lanes]: a lane's f16 B fragments of one n tile and block,
  // (b0, b1) of K step 0, then of K step 1.
  __host__ __device__ size_t query_bytes() const { return size_t(tokens) * tiles * kBlocks * 32 * 16; }
  // float [tokens][heads]: 2^(12 + eqmin_h), NaN for a head with a block that is not FP4.
  __host__ __device__ size_t head_scale_offset() const { return query_bytes(); }
  // float [tokens][heads][kBlocks]: 2^(12 + eq_b − d_b), the slow path's block factors.
  __host__ __device__ size_t block_scale_offset() const { return head_scale_offset() + size_t(tokens) * padded_heads() * 4; }
  __host__ __device__ size_t weight_offset() const { return block_scale_offset() + size_t(tokens) * padded_heads() * kBlocks * 4; }
  // int16 [tokens][heads][kBlocks]: eq_b, kNoExponent (zero block) or kNotFp4.
  __host__ __device__ size_t exponent_offset() const { return weight_offset() + size_t(tokens) * padded_heads() * 4; }
  // int [tokens][4]: eq low, eq high, largest per-head eq spread, sequence.
  __host__ __device__ size_t stats_offset() const {
    return align16(exponent_offset() + size_t(tokens) * padded_heads() * kBlocks * 2);
  }
  __host__ __device__ size_t visible_offset() const { return stats_offset() + size_t(tokens) * 4 * 4; }  // int64 [tokens]
  __host__ __device__ size_t warps_offset() const { return align16(visible_offset() + size_t(tokens) * 8); }
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

// e2m1 codes in the low nibbles of the 4 bytes -> e4m3 bytes of the values times 2^-6; the high
// nibbles likewise.
__device__ __forceinline__ uint32_t low_e2m1x4_to_e4m3x4(uint32_t w) {
  return ((w & 0x08080808u) << 4) | ((w & 0x07070707u) << 2);
}
__device__ __forceinline__ uint32_t high_e2m1x4_to_e4m3x4(uint32_t w) {
  return (w & 0x80808080u) | ((w >> 2) & 0x1c1c1c1cu);
}

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

// The range of a key row's MXFP4 block exponents ek = byte − 127 (a NaN scale, 0xff, gives 128,
// beyond the fast path's bounds: the double path carries the NaN).
struct ExponentRange {
  int lo, hi;
};

template <int kBlocks>
__device__ __forceinline__ ExponentRange key_exponents(uint32_t scales) {
  ExponentRange range{INT_MAX, INT_MIN};
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const int e = static_cast<int>((scales >> (8 * b)) & 0xffu) - 127;
    range.lo = min(range.lo, e), range.hi = max(range.hi, e);
  }
  return range;
}

// Whether the fp32 sums of a key row's block terms are exact for every head of the token (stats:
// its query exponent bounds; see "Exactness").
__device__ __forceinline__ bool fast_row(ExponentRange key, const int* stats) {
  return stats[2] + (key.hi - key.lo) <= kFastSpread && stats[0] + key.lo >= kFastMinExponent &&
         stats[1] + key.hi <= kFastMaxExponent && stats[2] + key.hi <= kMaxPartialExponent;
}

__device__ __forceinline__ float bf16_rounded(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }  // keeps NaN, as std::max(x, 0.0f)

// The reference's weighted terms of two dots in bf16_rounding: bf16(relu(bf16(dot)) · w), a pair
// per conversion. relu keeps NaN (__hmax2_nan); it may turn a -0 into +0, which changes no sum.
__device__ __forceinline__ float2 bf16_weighted_terms(float dot0, float dot1, float2 w) {
  const float2 r = __bfloat1622float2(__hmax2_nan(__floats2bfloat162_rn(dot0, dot1), __float2bfloat162_rn(0.0f)));
  return __bfloat1622float2(__floats2bfloat162_rn(__fmul_rn(r.x, w.x), __fmul_rn(r.y, w.y)));
}

// x · 2^k, exact whenever the result is a normal fp32 or larger than x in magnitude (|k| <= 252):
// two power-of-two factors, the first one moving toward the result.
__device__ __forceinline__ float scaled_by_power_of_two(float x, int k) {
  const int k1 = k / 2;
  return __fmul_rn(__fmul_rn(x, __int_as_float((127 + k1) << 23)), __int_as_float((127 + k - k1) << 23));
}

// Whether y is ±0, ±0.5, ±1, ±1.5, ±2, ±3, ±4 or ±6 (an e2m1 value; NaN is not).
__device__ __forceinline__ bool is_e2m1_value(float y) {
  const float t = 2.0f * fabsf(y);
  return t == rintf(t) && (t <= 4.0f || t == 6.0f || t == 8.0f || t == 12.0f);
}

// The 32 values of block b of q[t, h] (null: a padding head) as floats.
__device__ __forceinline__ void load_query_block(const uint16_t* q, float (&x)[kBlockChannels]) {
#pragma unroll
  for (int i = 0; i < kBlockChannels; i += 8) {
    const uint4 v = q ? __ldg(reinterpret_cast<const uint4*>(q + i)) : make_uint4(0, 0, 0, 0);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) x[i + k] = bf16_bits_to_float(static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2))));
  }
}

// The block's exponent eq = floor(log2(block amax)) − 2, which puts the values on e2m1 codes
// whenever they are e2m1 times one power of two (the largest is then 4 or 6 times 2^eq);
// kNoExponent for a zero block, kNotFp4 when the values are not FP4.
inline __device__ __noinline__ int16_t query_block_exponent(const uint16_t* q) {
  float x[kBlockChannels];
  load_query_block(q, x);
  float amax = 0.0f;  // fmaxf skips NaN: is_e2m1_value rejects it
#pragma unroll
  for (int i = 0; i < kBlockChannels; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const int eq = amax > 0.0f ? ilogbf(amax) - 2 : 0;
  if (eq > kMaxQueryExponent) return kNotFp4;  // inf: ilogbf gives INT_MAX
  for (int i = 0; i < kBlockChannels; ++i)
    if (!is_e2m1_value(scaled_by_power_of_two(x[i], -eq))) return kNotFp4;
  return amax > 0.0f ? static_cast<int16_t>(eq) : kNoExponent;
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
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) index_scores_mma_kernel(IndexScoresMmaLaunch a) {
  using Layout = SharedLayout<kBlocks, kFp8>;
  using Keys = KeyRows<kBlocks, kFp8>;
  constexpr int kDim = kBlocks * kBlockChannels;
  extern __shared__ float4 shared4[];
  uint8_t* shared = reinterpret_cast<uint8_t*>(shared4);
  const Layout layout(a.tokens_per_cta, a.heads);
  const int tiles = layout.tiles, padded_heads = layout.padded_heads();
  uint4* q_fragments = reinterpret_cast<uint4*>(shared);
  float* head_scales = reinterpret_cast<float*>(shared + layout.head_scale_offset());
  float* block_scales = reinterpret_cast<float*>(shared + layout.block_scale_offset());
  float* w_shared = reinterpret_cast<float*>(shared + layout.weight_offset());
  int16_t* q_exponents = reinterpret_cast<int16_t*>(shared + layout.exponent_offset());
  int* stats = reinterpret_cast<int*>(shared + layout.stats_offset());
  int64_t* visible = reinterpret_cast<int64_t*>(shared + layout.visible_offset());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint8_t* warp_shared = shared + layout.warps_offset() + warp * Layout::kWarpBytes;
  uint32_t* scale_words = reinterpret_cast<uint32_t*>(warp_shared + Layout::kScaleWordsOffset);
  uint32_t* row_masks = reinterpret_cast<uint32_t*>(warp_shared + Layout::kMasksOffset);
  float* key_scales = reinterpret_cast<float*>(warp_shared + Layout::kKeyScalesOffset);
  float* terms = reinterpret_cast<float*>(warp_shared + Layout::kTermsOffset);

  const int64_t t0 = int64_t{blockIdx.y} * a.tokens_per_cta;
  const int count = static_cast<int>(a.tokens - t0 < a.tokens_per_cta ? a.tokens - t0 : a.tokens_per_cta);
  const int64_t k0 = int64_t{blockIdx.x} * a.keys_per_cta;
  const int64_t k1 = k0 + a.keys_per_cta < a.entries ? k0 + a.keys_per_cta : a.entries;
  for (int i = threadIdx.x; i < count; i += kThreads) {
    stats[4 * i] = INT_MAX, stats[4 * i + 1] = INT_MIN, stats[4 * i + 2] = 0;
    stats[4 * i + 3] = a.token_sequence ? a.token_sequence[t0 + i] : 0;
    const int64_t n_vis = visible_entries(a.token_position[t0 + i], a.compress_ratio);
    visible[i] = n_vis < a.entries ? n_vis : a.entries;
  }
  __syncthreads();
  int64_t cta_visible = 0;
  for (int i = 0; i < count; ++i) cta_visible = max(cta_visible, visible[i]);
  if (k0 >= cta_visible) {  // the range is in every token's future
    for (int i = 0; i < count; ++i)
      for (int64_t j = k0 + threadIdx.x; j < k1; j += kThreads) a.scores[(t0 + i) * a.entries + j] = -INFINITY;
    return;
  }

  // The queries: block exponents, then each head folded onto its smallest one.
  auto query = [&](int i, int h, int b) {
    return h < a.heads ? a.q + ((t0 + i) * a.heads + h) * kDim + b * kBlockChannels : nullptr;
  };
  for (int task = threadIdx.x; task < count * padded_heads * kBlocks; task += kThreads) {
    const int i = task / (padded_heads * kBlocks), h = task / kBlocks % padded_heads, b = task % kBlocks;
    q_exponents[task] = query_block_exponent(query(i, h, b));
    if (b == 0) w_shared[i * padded_heads + h] = h < a.heads ? a.weights[(t0 + i) * a.heads + h] : 0.0f;
  }
  __syncthreads();
  for (int task = threadIdx.x; task < count * padded_heads * kBlocks; task += kThreads) {
    const int i = task / (padded_heads * kBlocks), h = task / kBlocks % padded_heads, b = task % kBlocks;
    const int16_t* e = q_exponents + (task - b);
    bool fp4 = true, nonzero = false;
    int lo = INT_MAX, hi = INT_MIN;
    for (int k = 0; k < kBlocks; ++k) {
      fp4 = fp4 && e[k] != kNotFp4;
      if (e[k] != kNoExponent && e[k] != kNotFp4) lo = min(lo, int{e[k]}), hi = max(hi, int{e[k]}), nonzero = true;
    }
    if (!nonzero) lo = hi = 0;
    const bool folded = hi - lo <= kMaxFoldShift;
    const int eq = e[b] == kNotFp4 ? kNoExponent : e[b];  // a head that is not FP4 gets NaN scales
    const int shift = folded && eq != kNoExponent ? eq - lo : 0;
    stage_query_block<kBlocks, kFp8>(query(i, h, b), h, b, eq, shift, q_fragments + size_t(i) * tiles * kBlocks * 32);
    const float nan = __int_as_float(0x7fc00000);
    block_scales[task] = !fp4 ? nan : ldexpf(1.0f, 12 + (folded ? lo : eq == kNoExponent ? 0 : eq));
    if (b == 0) {
      head_scales[i * padded_heads + h] = fp4 ? ldexpf(1.0f, 12 + lo) : nan;
      if (fp4 && nonzero && h < a.heads) {
        atomicMin(&stats[4 * i], lo);
        atomicMax(&stats[4 * i + 1], hi);
        atomicMax(&stats[4 * i + 2], hi - lo);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += kThreads)
    if (stats[4 * i] > stats[4 * i + 1]) stats[4 * i] = stats[4 * i + 1] = 0;  // no nonzero FP4 block
  __syncthreads();

  const int g = lane >> 2, c = lane & 3;
  const int stages = static_cast<int>((k1 - k0 + kStageRows - 1) / kStageRows);
  const int my_stages = (stages - warp + kWarps - 1) / kWarps;
  auto stage_row0 = [&](int n) { return k0 + int64_t{warp + n * kWarps} * kStageRows; };
  const uint32_t stage_base = shared_address(warp_shared);

  for (int first = 0; first < count;) {
    // A run of tokens reading the same sequence: its stages are loaded once.
    int end = first + 1;
    int64_t run_visible = visible[first];
    while (end < count && stats[4 * end + 3] == stats[4 * first + 3]) run_visible = max(run_visible, visible[end++]);
    const int64_t sequence = stats[4 * first + 3];
    const int64_t load_end = run_visible < k1 ? run_visible : k1;

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
          const int* token_stats = stats + 4 * i;
          // index_fp8: the fp32 path whenever every head is folded (fp32 precision only).
          const bool own_fast = kFp8 ? token_stats[2] <= kMaxFoldShift : !own_row || fast_row(own_range, token_stats);
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
void launch_index_scores_mma(const IndexScoresMmaLaunch& a, cudaStream_t stream) {
  const size_t shared = SharedLayout<kBlocks, kFp8>(a.tokens_per_cta, a.heads).bytes();
  auto kernel = index_scores_mma_kernel<kBlocks, kFp8>;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>((a.entries + a.keys_per_cta - 1) / a.keys_per_cta),
                  static_cast<unsigned>((a.tokens + a.tokens_per_cta - 1) / a.tokens_per_cta));
  kernel<<<grid, kThreads, shared, stream>>>(a);
}

}  // namespace dsv4::cuda::index_mma

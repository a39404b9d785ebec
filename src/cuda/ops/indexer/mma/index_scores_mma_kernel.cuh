// Index scores on fp8 tensor cores (mma.sync m16n8k32 e4m3, sm_89+; built for sm_90a) for FP4
// queries (IndexScoresParams::fp4_queries) against index_mxfp4 keys (exact) or index_fp8 keys
// (fp32 precision only). See include/dsv4/cuda/indexer.h for the contract.
//
// Shape. A CTA takes up to kMaxTokensPerCta tokens and a chunk of kChunkKeys entries; each of its
// warps takes 16-key fragments of the chunk (the MMA's M), the index heads are N (n tiles of 8,
// padded with zero queries) and each 32-channel block is one K = 32 step. Consecutive tokens of the
// CTA that read the same sequence share the fragments' loads and conversions (prefill). Key bytes
// go from global memory straight into the A fragment registers, the next fragment's loads in flight
// while the current one is multiplied.
//
// Exactness (index_mxfp4). q[h] block b is v·2^eq (v e2m1), key j block b is u·2^ek (u e2m1, ek
// its ue8m0 exponent). The e4m3 bytes of v·2^-6 and u·2^-6 (the bit move of HOPPER_DESIGN §3.2:
// ((n & 8) << 4) | ((n & 7) << 2)) make the MMA's block sum acc = 2^-12 Σ v·u: the products are
// multiples of 2^-14 of magnitude at most 36·2^-12, the 32-term sum at most 1152·2^-12, so every
// partial sum has at most 13 significant bits and the fp8 MMA's accumulation (about 14 bits, e8m13,
// HOPPER_DESIGN §3.2) adds them exactly from a zeroed accumulator. acc · 2^ek is exact in fp32
// (subnormals included: acc is a multiple of 2^-14, 2^ek >= 2^-127). With E_b = eq + ek, the block
// value acc·2^ek·2^(12+eq) is a multiple of 2^(E_b - 2) of magnitude below 2^(E_b + 11), and the
// dot's four (two for dim 64) running fp32 sums, fmaf(acc·2^ek, 2^(12+eq), sum), are exact when
// max E_b − min E_b <= 9 (at most 24 significant bits: the sum of four is below 2^(max E_b + 13)),
// min E_b >= -147 (no bits below 2^-149) and max E_b <= 114 (no overflow): the fast path, checked
// per (token, key row) with bounds over the token's heads (fast_row). When every row of a
// fragment has one ek for all its blocks, the fast path sums acc·2^(12+eq) (the same condition on
// the eq alone: exact) and multiplies by 2^ek once (exact under the bounds). Otherwise the same terms
// are added in double, exact while max E_b − min E_b <= 38 (53 bits). Either way the dot is the
// exact dot rounded once to fp32 — what the reference computes (reference/ops.cpp `dot`: eight
// double sums of exact products, exact under the same condition, then one rounding to fp32). So
// the bf16_rounding scores equal the reference's bit for bit, and the fp32 scores differ only by
// the reference's fp32 head sum order (here also in head order: equal unless the host contracts
// multiply-adds). Blocks whose exponents lie more than 38 octaves apart could differ in the last
// bit of the dot's fp32 rounding (neither side sums exactly then).
//
// index_fp8 keys: an e4m3 × e2m1 product has up to 6 significant bits over a wide exponent range,
// so a 32-term block sum is not exact in the MMA's ~14-bit accumulation: fp32 precision only
// (relative error of a block sum about 2^-13 of its largest products); the chooser leaves
// bf16_rounding calls to the SIMT kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/indexer/visible_entries.cuh"
#include "dsv4/numeric.h"

namespace dsv4::cuda::index_mma {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kFragmentKeys = 16;  // the MMA's M
inline constexpr int kFragmentsPerWarp = 16;  // the queries' staging is amortized over 1024 entries
inline constexpr int kChunkKeys = kWarps * kFragmentsPerWarp * kFragmentKeys;  // entries per CTA
inline constexpr int kBlockChannels = 32;  // the MMA's K; the MXFP4 scale tile
inline constexpr int kSumHeads = 32;       // heads per pass of the ordered head sum
inline constexpr int kTermsStride = kSumHeads + 4;  // 16-byte rows: a lane's float4 reads of its row do not conflict
inline constexpr int kMaxTokensPerCta = 8;
inline constexpr int kMinBlocksPerSm = 4;  // 16 warps per SM keep enough key loads in flight
inline constexpr int kMaxHeads = 128;
inline constexpr int kFastSpread = 9;      // see "Exactness" above
inline constexpr int kFastMinExponent = -147;
inline constexpr int kFastMaxExponent = 114;
inline constexpr int kMaxQueryExponent = 115;  // 2^(12 + eq) stays a finite fp32
inline constexpr int16_t kNoExponent = INT16_MIN;

struct IndexScoresMmaLaunch {
  const uint16_t* q = nullptr;        // [tokens, heads, dim] bf16
  const float* weights = nullptr;     // [tokens, heads]
  DeviceRows keys;
  const int32_t* token_sequence = nullptr;  // null: flat keys
  const int32_t* token_position = nullptr;
  int compress_ratio = 1;
  const int32_t* candidates = nullptr;  // [tokens, num_candidates] or null
  int64_t num_candidates = 0;
  int64_t candidate_block_size = 1;
  float* scores = nullptr;            // [tokens, entries]
  int64_t entries = 0;
  int64_t tokens = 0;
  int heads = 0;
  int tokens_per_cta = 1;             // 1 ... kMaxTokensPerCta
  bool bf16_rounding = false;
  bool partial = false;
};

__host__ __device__ constexpr int head_tiles(int heads) { return (heads + 7) / 8; }

// Shared memory of a CTA: the tokens' query fragments, block scales, weights and ranges, and each
// warp's staging of weighted terms for the ordered head sum.
template <int kBlocks>
struct SharedLayout {
  int tokens, tiles;
  __host__ __device__ SharedLayout(int tokens_per_cta, int heads) : tokens(tokens_per_cta), tiles(head_tiles(heads)) {}
  // uint2 [tokens][tiles][kBlocks][32 lanes]: a lane's B fragment (b0, b1) of one n tile and block.
  __host__ __device__ size_t query_bytes() const { return size_t(tokens) * tiles * kBlocks * 32 * 8; }
  // float [tokens][tiles * 8][kBlocks]: 2^(12 + eq), NaN for a block that is not FP4.
  __host__ __device__ size_t scale_offset() const { return query_bytes(); }
  __host__ __device__ size_t weight_offset() const { return scale_offset() + size_t(tokens) * tiles * 8 * kBlocks * 4; }
  // int16 [tokens][tiles * 8][kBlocks]: eq, kNoExponent for a zero or not-FP4 block.
  __host__ __device__ size_t exponent_offset() const { return weight_offset() + size_t(tokens) * tiles * 8 * 4; }
  // int [tokens][4]: eq low, eq high, largest per-head eq spread, sequence.
  __host__ __device__ size_t stats_offset() const { return exponent_offset() + size_t(tokens) * tiles * 8 * kBlocks * 2; }
  __host__ __device__ size_t visible_offset() const { return stats_offset() + size_t(tokens) * 4 * 4; }  // int64 [tokens]
  // float [kWarps][16][kTermsStride], 16-byte aligned
  __host__ __device__ size_t terms_offset() const { return (visible_offset() + size_t(tokens) * 8 + 15) / 16 * 16; }
  __host__ __device__ size_t bytes() const { return terms_offset() + size_t(kWarps) * 16 * kTermsStride * 4; }
};

// A head's block scales 2^(12 + eq), read with one shared-memory load.
template <int kBlocks>
struct alignas(4 * kBlocks) HeadScales {
  float v[kBlocks];
};

// e2m1 codes in the low nibbles of the 4 bytes -> e4m3 bytes of the values times 2^-6.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t nibbles) {
  return ((nibbles & 0x08080808u) << 4) | ((nibbles & 0x07070707u) << 2);
}

__device__ __forceinline__ uint8_t e2m1_to_e4m3_code(uint8_t code) {
  return static_cast<uint8_t>(((code & 8u) << 4) | ((code & 7u) << 2));
}

// d = a·b on fp8 tensor cores from a zeroed accumulator. A 16x32 row major: a[0] (g, 4c..4c+3),
// a[1] (g+8, 4c..), a[2] (g, 16+4c..), a[3] (g+8, 16+4c..); B 32x8: b0 (k 4c.., n g), b1 (k 16+4c..,
// n g); C: d[0..1] (g, 2c..2c+1), d[2..3] (g+8, 2c..); lane l, g = l / 4, c = l % 4.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
#else
  __trap();  // the chooser runs this implementation on sm_90 only
#endif
}

// The K order inside a block: logical k = 4c + i holds channel 8c + 2i, k = 16 + 4c + i channel
// 8c + 2i + 1 — the low and high nibbles of the 4 MXFP4 bytes 4c … 4c + 3, so that a lane's key
// word needs no shuffling; the queries are laid out in the same order.
//
// The raw bytes of one 16-key fragment for a lane (rows g and g + 8), loaded ahead of their use.
template <int kBlocks, bool kFp8>
struct RawFragment {
  static_assert(kBlocks == 2 || kBlocks == 4);  // a row's MXFP4 scales are one 2- or 4-byte load
  static constexpr int kWords = kFp8 ? 2 : 1;    // 4-byte words per row and block
  uint32_t words[2][kBlocks][kWords];
  uint32_t scales[2];  // MXFP4: the kBlocks ue8m0 bytes, low first; fp8: the row's fp32 scale bits
  bool own_row = false;         // lanes 0-15: row j0 + lane is addressable
};

template <int kBlocks, bool kFp8>
__device__ __forceinline__ void load_fragment(RawFragment<kBlocks, kFp8>& raw, const DeviceRows& keys, int64_t sequence,
                                              int64_t j0, int64_t rows_end, int lane) {
  RowRef own;
  if (lane < kFragmentKeys && j0 + lane < rows_end) own = row_of_sequence(keys, sequence, j0 + lane);
  raw.own_row = own.valid();
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* data = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(own.data), g + 8 * r));
    const uint8_t* scales = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(own.scales), g + 8 * r));
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      if constexpr (kFp8) {
        const uint8_t* p = data + b * kBlockChannels + 8 * c;
        raw.words[r][b][0] = data ? __ldg(reinterpret_cast<const uint32_t*>(p)) : 0u;
        raw.words[r][b][1] = data ? __ldg(reinterpret_cast<const uint32_t*>(p + 4)) : 0u;
      } else {
        raw.words[r][b][0] = data ? __ldg(reinterpret_cast<const uint32_t*>(data + b * kBlockChannels / 2 + 4 * c)) : 0u;
      }
    }
    // A row that is not read gets scales 1 (ue8m0 127).
    if constexpr (kFp8) raw.scales[r] = data ? __ldg(reinterpret_cast<const uint32_t*>(scales)) : float_bits(1.0f);
    else if constexpr (kBlocks == 4) raw.scales[r] = data ? __ldg(reinterpret_cast<const uint32_t*>(scales)) : 0x7f7f7f7fu;
    else raw.scales[r] = data ? __ldg(reinterpret_cast<const uint16_t*>(scales)) : 0x7f7fu;
  }
}

// One row's A fragment words of block b and its scale 2^ek per block.
template <int kBlocks, bool kFp8>
__device__ __forceinline__ void fragment_registers(const RawFragment<kBlocks, kFp8>& raw, uint32_t (&a)[kBlocks][4],
                                                   float (&key_scale)[2][kBlocks]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      if constexpr (kFp8) {
        a[b][r] = __byte_perm(raw.words[r][b][0], raw.words[r][b][1], 0x6420);      // even channels
        a[b][2 + r] = __byte_perm(raw.words[r][b][0], raw.words[r][b][1], 0x7531);  // odd channels
        key_scale[r][b] = float_from_bits(raw.scales[r]) * 0x1p-6f;  // qs holds 2^12 for two 2^-6 factors: the e4m3 keys have none
      } else {
        a[b][r] = e2m1x4_to_e4m3x4(raw.words[r][b][0] & 0x0f0f0f0fu);
        a[b][2 + r] = e2m1x4_to_e4m3x4((raw.words[r][b][0] >> 4) & 0x0f0f0f0fu);
        key_scale[r][b] = ue8m0_to_float(static_cast<uint8_t>(raw.scales[r] >> (8 * b)));
      }
    }
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

// Whether the fp32 block sums of a key row are exact for every head of the token (stats: its
// query exponent bounds; see "Exactness").
__device__ __forceinline__ bool fast_row(ExponentRange key, const int* stats) {
  return stats[2] + (key.hi - key.lo) <= kFastSpread && stats[0] + key.lo >= kFastMinExponent &&
         stats[1] + key.hi <= kFastMaxExponent;
}

__device__ __forceinline__ float bf16_rounded(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }  // keeps NaN, as std::max(x, 0.0f)

// The reference's weighted terms of two dots in bf16_rounding: bf16(relu(bf16(dot)) · w), a pair
// per conversion. relu keeps NaN (__hmax2_nan); it may turn a -0 into +0, which changes no sum.
__device__ __forceinline__ float2 bf16_weighted_terms(float dot0, float dot1, float2 w) {
  const float2 r = __bfloat1622float2(__hmax2_nan(__floats2bfloat162_rn(dot0, dot1), __float2bfloat162_rn(0.0f)));
  return __bfloat1622float2(__floats2bfloat162_rn(__fmul_rn(r.x, w.x), __fmul_rn(r.y, w.y)));
}

// The e2m1 code of x / 2^eq, or 0xff when that is not an e2m1 value.
__device__ __forceinline__ uint8_t e2m1_code(float x, int eq) {
  const uint32_t bits = float_bits(x), mantissa = bits & 0x7fffffu;
  const int field = static_cast<int>((bits >> 23) & 0xffu);
  if (field == 0) {  // zero, or an fp32 subnormal (bf16's smallest values): the general way
    const float value = ldexpf(x, -eq);
    const uint8_t code = float_to_e2m1(value);
    return e2m1_to_float(code) == value && (value != 0.0f || x == 0.0f) ? code : 0xff;
  }
  const int e = field - 127 - eq;  // x / 2^eq = (1 + mantissa) · 2^e; NaN and inf have e > 2
  if (e < -1 || e > 2 || (mantissa != 0 && (mantissa != 0x400000u || e < 0))) return 0xff;
  return static_cast<uint8_t>(((bits >> 28) & 8u) | (e < 0 ? 1 : 2 * (e + 1) + (mantissa != 0)));
}

// Converts block b of q[t, h] (FP4 values in bf16; null: a padding head) into the e4m3 B fragments,
// its scale 2^(12 + eq) and eq (kNoExponent: a zero or not-FP4 block). eq = floor(log2(block
// amax)) − 2 puts the values on e2m1 codes whenever they are e2m1 times one power of two (the
// largest is then 4 or 6 times 2^eq).
template <int kBlocks>
__device__ void stage_query_block(const uint16_t* q, int h, int b, uint2* fragments, float* scales, int16_t* exponents) {
  float x[kBlockChannels];
  float amax = 0.0f;  // fmaxf skips NaN: e2m1_code rejects it
#pragma unroll
  for (int i = 0; i < kBlockChannels; i += 8) {
    const uint4 v = q ? __ldg(reinterpret_cast<const uint4*>(q + i)) : make_uint4(0, 0, 0, 0);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      x[i + k] = bf16_bits_to_float(static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2))));
      amax = fmaxf(amax, fabsf(x[i + k]));
    }
  }
  int eq = amax > 0.0f ? ilogbf(amax) - 2 : 0;
  bool fp4 = eq <= kMaxQueryExponent;  // inf: ilogbf gives INT_MAX
  if (!fp4) eq = 0;
  uint8_t codes[kBlockChannels];
#pragma unroll
  for (int i = 0; i < kBlockChannels; ++i) {
    const uint8_t code = e2m1_code(x[i], eq);
    fp4 = fp4 && code != 0xff;
    codes[i] = e2m1_to_e4m3_code(code);
  }
  // Lane 4·(h % 8) + c of n tile h / 8 holds channels 8c + 2i (b0) and 8c + 2i + 1 (b1).
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint2 f;
    f.x = codes[8 * c] | codes[8 * c + 2] << 8 | codes[8 * c + 4] << 16 | uint32_t{codes[8 * c + 6]} << 24;
    f.y = codes[8 * c + 1] | codes[8 * c + 3] << 8 | codes[8 * c + 5] << 16 | uint32_t{codes[8 * c + 7]} << 24;
    fragments[((h / 8) * kBlocks + b) * 32 + 4 * (h % 8) + c] = f;
  }
  scales[h * kBlocks + b] = fp4 ? ldexpf(1.0f, 12 + eq) : __int_as_float(0x7fc00000);
  exponents[h * kBlocks + b] = static_cast<int16_t>(fp4 && amax > 0.0f ? eq : kNoExponent);  // zero blocks add exact zeros
}

template <int kBlocks, bool kFp8>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) index_scores_mma_kernel(IndexScoresMmaLaunch a) {
  constexpr int kDim = kBlocks * kBlockChannels;
  extern __shared__ float4 shared4[];
  uint8_t* shared = reinterpret_cast<uint8_t*>(shared4);
  const SharedLayout<kBlocks> layout(a.tokens_per_cta, a.heads);
  const int tiles = layout.tiles;
  uint2* q_fragments = reinterpret_cast<uint2*>(shared);
  float* q_scales = reinterpret_cast<float*>(shared + layout.scale_offset());
  float* w_shared = reinterpret_cast<float*>(shared + layout.weight_offset());
  int16_t* q_exponents = reinterpret_cast<int16_t*>(shared + layout.exponent_offset());
  int* stats = reinterpret_cast<int*>(shared + layout.stats_offset());
  int64_t* visible = reinterpret_cast<int64_t*>(shared + layout.visible_offset());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* terms = reinterpret_cast<float*>(shared + layout.terms_offset()) + warp * 16 * kTermsStride;

  const int64_t t0 = int64_t{blockIdx.y} * a.tokens_per_cta;
  const int count = static_cast<int>(a.tokens - t0 < a.tokens_per_cta ? a.tokens - t0 : a.tokens_per_cta);
  for (int i = threadIdx.x; i < count; i += kThreads) {
    stats[4 * i] = INT_MAX, stats[4 * i + 1] = INT_MIN, stats[4 * i + 2] = 0;
    stats[4 * i + 3] = a.token_sequence ? a.token_sequence[t0 + i] : 0;
    const int64_t n_vis = visible_entries(a.token_position[t0 + i], a.compress_ratio);
    visible[i] = n_vis < a.entries ? n_vis : a.entries;
  }
  __syncthreads();
  const int64_t chunk = int64_t{blockIdx.x} * kChunkKeys;
  const int64_t chunk_end = chunk + kChunkKeys < a.entries ? chunk + kChunkKeys : a.entries;
  int64_t cta_visible = 0;
  for (int i = 0; i < count; ++i) cta_visible = max(cta_visible, visible[i]);
  if (chunk >= cta_visible) {  // the chunk is in every token's future
    for (int i = 0; i < count; ++i)
      for (int64_t j = chunk + threadIdx.x; j < chunk_end; j += kThreads) a.scores[(t0 + i) * a.entries + j] = -INFINITY;
    return;
  }
  for (int task = threadIdx.x; task < count * tiles * 8 * kBlocks; task += kThreads) {
    const int i = task / (tiles * 8 * kBlocks), h = task / kBlocks % (tiles * 8), b = task % kBlocks;
    const uint16_t* q = h < a.heads ? a.q + ((t0 + i) * a.heads + h) * kDim + b * kBlockChannels : nullptr;
    stage_query_block<kBlocks>(q, h, b, q_fragments + size_t(i) * tiles * kBlocks * 32,
                               q_scales + size_t(i) * tiles * 8 * kBlocks, q_exponents + size_t(i) * tiles * 8 * kBlocks);
    if (b == 0) w_shared[i * tiles * 8 + h] = h < a.heads ? a.weights[(t0 + i) * a.heads + h] : 0.0f;
  }
  __syncthreads();
  for (int task = threadIdx.x; task < count * a.heads; task += kThreads) {
    const int i = task / a.heads, h = task % a.heads;
    const int16_t* e = q_exponents + (size_t(i) * tiles * 8 + h) * kBlocks;
    int lo = INT_MAX, hi = INT_MIN;
    for (int b = 0; b < kBlocks; ++b)
      if (e[b] != kNoExponent) lo = min(lo, int{e[b]}), hi = max(hi, int{e[b]});
    if (lo <= hi) {
      atomicMin(&stats[4 * i], lo);
      atomicMax(&stats[4 * i + 1], hi);
      atomicMax(&stats[4 * i + 2], hi - lo);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += kThreads)
    if (stats[4 * i] > stats[4 * i + 1]) stats[4 * i] = stats[4 * i + 1] = 0;  // no nonzero FP4 block
  __syncthreads();

  const int g = lane >> 2, c = lane & 3;
  for (int first = 0; first < count;) {
    // A run of tokens reading the same sequence: its fragments are loaded once.
    int end = first + 1;
    int64_t run_visible = visible[first];
    while (end < count && stats[4 * end + 3] == stats[4 * first + 3]) run_visible = max(run_visible, visible[end++]);
    const int64_t sequence = stats[4 * first + 3];

    RawFragment<kBlocks, kFp8> next;
    int f = warp;
    auto fragment_start = [&](int fragment) { return chunk + int64_t{fragment} * kFragmentKeys; };
    if (f < kWarps * kFragmentsPerWarp && fragment_start(f) < run_visible)
      load_fragment(next, a.keys, sequence, fragment_start(f), run_visible, lane);
    for (; f < kWarps * kFragmentsPerWarp && fragment_start(f) < a.entries; f += kWarps) {
      const int64_t j0 = fragment_start(f), j = j0 + lane;
      if (j0 >= run_visible) {  // in every token's future
        for (int i = first; i < end; ++i)
          if (lane < kFragmentKeys && j < a.entries) a.scores[(t0 + i) * a.entries + j] = -INFINITY;
        continue;
      }
      const RawFragment<kBlocks, kFp8> raw = next;
      if (f + kWarps < kWarps * kFragmentsPerWarp && fragment_start(f + kWarps) < run_visible)
        load_fragment(next, a.keys, sequence, fragment_start(f + kWarps), run_visible, lane);
      uint32_t frag[kBlocks][4];
      float key_scale[2][kBlocks];
      fragment_registers(raw, frag, key_scale);
      ExponentRange key_range[2] = {};  // index_fp8 (fp32 precision only) takes the fp32 path
      if constexpr (!kFp8) key_range[0] = key_exponents<kBlocks>(raw.scales[0]), key_range[1] = key_exponents<kBlocks>(raw.scales[1]);
      // Every row of the fragment has one scale for all its blocks (index_fp8: always): see "Exactness".
      const bool uniform_scales =
          __all_sync(0xffffffffu, key_range[0].lo == key_range[0].hi && key_range[1].lo == key_range[1].hi);

      for (int i = first; i < end; ++i) {
        const int* token_stats = stats + 4 * i;
        const bool fast[2] = {kFp8 || fast_row(key_range[0], token_stats), kFp8 || fast_row(key_range[1], token_stats)};
        const uint2* qf = q_fragments + size_t(i) * tiles * kBlocks * 32;
        const float* qs = q_scales + size_t(i) * tiles * 8 * kBlocks;
        const float* w = w_shared + i * tiles * 8;
        float score = 0.0f;  // lanes 0-15: row j0 + lane
        for (int tile0 = 0; tile0 < tiles; tile0 += kSumHeads / 8) {
          for (int tile = tile0; tile < min(tiles, tile0 + kSumHeads / 8); ++tile) {
            float acc[kBlocks][4];
#pragma unroll
            for (int b = 0; b < kBlocks; ++b) {
              const uint2 bq = qf[(tile * kBlocks + b) * 32 + lane];
              mma_e4m3(acc[b], frag[b], bq.x, bq.y);
            }
            // This lane's two heads, 2c and 2c + 1 of the tile: their block scales and weights.
            const HeadScales<kBlocks> q_scale[2] = {reinterpret_cast<const HeadScales<kBlocks>*>(qs)[tile * 8 + 2 * c],
                                                    reinterpret_cast<const HeadScales<kBlocks>*>(qs)[tile * 8 + 2 * c + 1]};
            const float2 weights = reinterpret_cast<const float2*>(w)[tile * 4 + c];
            float dot[4];  // rows g, g, g + 8, g + 8; heads 2c, 2c + 1, 2c, 2c + 1
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int r = e >> 1, k = e & 1;
              if (fast[r] && uniform_scales) {  // the row's scale once: 2^ek · Σ acc·2^(12+eq)
                dot[e] = 0.0f;
#pragma unroll
                for (int b = 0; b < kBlocks; ++b) dot[e] = __fmaf_rn(acc[b][e], q_scale[k].v[b], dot[e]);
                dot[e] = __fmul_rn(dot[e], key_scale[r][0]);
              } else if (fast[r]) {
                dot[e] = 0.0f;
#pragma unroll
                for (int b = 0; b < kBlocks; ++b)
                  dot[e] = __fmaf_rn(__fmul_rn(acc[b][e], key_scale[r][b]), q_scale[k].v[b], dot[e]);
              } else {
                double sum = 0.0;
#pragma unroll
                for (int b = 0; b < kBlocks; ++b)
                  sum = __fma_rn(static_cast<double>(__fmul_rn(acc[b][e], key_scale[r][b])),
                                 static_cast<double>(q_scale[k].v[b]), sum);
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
            for (int k = 0; k < min(kSumHeads, (tiles - tile0) * 8); k += 4) {
              const float4 t = *reinterpret_cast<const float4*>(terms + lane * kTermsStride + k);
              score = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(score, t.x), t.y), t.z), t.w);
            }
          __syncwarp();
        }
        if (lane < kFragmentKeys && j < a.entries) {
          const bool listed = !a.candidates || contains_block(a.candidates + (t0 + i) * a.num_candidates,
                                                              a.num_candidates, split_rows(j, a.candidate_block_size).block);
          const bool scored = raw.own_row && j < visible[i] && listed;
          a.scores[(t0 + i) * a.entries + j] =
              !scored ? -INFINITY : a.bf16_rounding && !a.partial ? bf16_rounded(score) : score;
        }
      }
    }
    first = end;
  }
}

template <int kBlocks, bool kFp8>
void launch_index_scores_mma(const IndexScoresMmaLaunch& a, cudaStream_t stream) {
  const size_t shared = SharedLayout<kBlocks>(a.tokens_per_cta, a.heads).bytes();
  auto kernel = index_scores_mma_kernel<kBlocks, kFp8>;
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>((a.entries + kChunkKeys - 1) / kChunkKeys),
                  static_cast<unsigned>((a.tokens + a.tokens_per_cta - 1) / a.tokens_per_cta));
  kernel<<<grid, kThreads, shared, stream>>>(a);
}

}  // namespace dsv4::cuda::index_mma

// The FP4 query x MXFP4 key dots both tensor-core index-score implementations compute (mma_f16:
// mma.sync f16; wgmma: e4m3 warpgroup MMAs), exactly, and what they share: the queries' block
// exponents and folding, the key codes' bit move to e4m3, the fast path's bounds and the
// reference's bf16 rounding of the weighted terms.
//
// Exactness (index_mxfp4). q[h] block b is v·2^eq_b (v e2m1), key j block b is u·2^ek_b (u e2m1,
// ek_b its ue8m0 exponent). The queries are staged once per CTA as e4m3 codes of v·2^(d_b − 6)
// with d_b = eq_b − eqmin_h (the head's blocks folded onto its smallest exponent; exact in e4m3
// for d_b <= kMaxFoldShift), the keys as e4m3 codes of u·2^-6 (the bit move of HOPPER_DESIGN
// §3.2: ((n & 8) << 4) | ((n & 7) << 2); e2m1 subnormals land on e4m3 subnormals). The MMAs'
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
// Folded weights. With P = Σ_b acc_b·2^ek_b (exact on the fast path) and hs = 2^(12 + eqmin_h),
// relu(P·hs)·w = relu(P)·(hs·w) bit for bit whenever hs·w is exact: both round the same real
// product once. So a kernel may skip the head scale and weight the fast rows' P with hs·w
// (TokenQueries::folded_weights) when every head of the token has an exact hs·w (kWeightsFold).
// The bf16 rounding of the dot commutes with hs as well, bf16(P·hs) = hs·bf16(P), where P and P·hs
// are normal: P is a multiple of 2^(ek_lo − 14) and P·hs of 2^(E_min − 2), so the fast path that
// allows the fold there (FastBounds' normal_dots) also asks ek_lo >= -112 and E_min >= -124.
//
// Packed terms. With bf16 folded weights w' = hs·w (kWeightsBf16), a fast row's weighted term is
// bf16(relu(bf16(P))·w') (the reference's bf16(fp32(relu(bf16(dot))·w)), by "Folded weights" when
// the fp32 product is exact). relu(bf16(P)) is a multiple of 2^(ek_lo − 14) and w' at least
// 2^e_w (kWeightExponentMin), so a nonzero product of the two is at least 2^(ek_lo − 14 + e_w):
// normal, and then exact in fp32 (two 8-bit significands), when ek_lo >= −112 − e_w. Such rows
// (FastBounds' factored_terms) form their terms with one bf16 multiply a pair, which rounds the
// same exact product once.
//
// Row factor. A fast row's P is 2^ek0 · P' with P' = acc_0 + Σ_{b>=1} acc_b·2^(ek_b − ek0) (ek0:
// block 0's exponent), and a kernel may form the weighted terms and their head sum from P' and
// multiply the score by 2^ek0 once a row: one multiply a (row, head) fewer. P' is exact as P is
// (the same bits, moved), a multiple of 2^-23 (acc_b of 2^-14, ek_b − ek0 >= -9 on the fast path)
// and below 2^10 (each acc_b·2^(ek_b − ek0) below 2^(d_b + ek_b − ek0 − 1) <= 2^8). A power of two
// commutes with every rounding of the terms and the sum as long as no rounded result leaves the
// normal range in either scaling: a sum whose exact value is subnormal is exact in both, and a
// product is exact in neither, so the products (relu(P)·w', and bf16(P) in bf16_rounding) must be
// normal both ways and no term or partial sum may overflow. With e_w and E_w the smallest and
// largest exponents of the token's nonzero w' (kWeightExponentMin, kWeightExponentMax):
//   - real products normal: ek_lo >= −112 − e_w (as "Packed terms"), bf16(P) normal: ek_lo >= −112;
//   - primed products normal: 2^(−23 + e_w) >= 2^-126, e_w >= kMinFactoredWeightExponent;
//   - no overflow: 32 heads' terms below 2^(10 + 1 + E_w + 5) primed and 2^(ek_hi + 16 + E_w) real,
//     so E_w <= kMaxFactoredWeightExponent and ek_hi <= 111 − E_w.
// The first and last hold per row (FastBounds' factored_terms), the others per token
// (factors_rows). The score is then the reference's float times 2^-ek0, and the multiply exact.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/ops/indexer/indexer_launch.h"
#include "cuda/ops/indexer/visible_entries.cuh"
#include "dsv4/numeric.h"

namespace dsv4::cuda::index_fp4 {

inline constexpr int kBlockChannels = 32;  // the MMA's K; the MXFP4 scale tile
inline constexpr int kFastSpread = 9;      // see "Exactness" above
inline constexpr int kFastMinExponent = -147;
inline constexpr int kNormalDotMinExponent = -124;  // bf16(P·hs) = hs·bf16(P): see "Folded weights"
inline constexpr int kNormalPartialMinScale = 15;   // the scale byte of ek = -112
inline constexpr int kPackedProductMinScale = 15;   // ek >= -112 - e_w: see "Packed terms"
inline constexpr int kFactoredPartialMaxScale = 238;  // ek <= 111 - E_w: see "Row factor"
inline constexpr int kMinFactoredWeightExponent = -103;
inline constexpr int kMaxFactoredWeightExponent = 110;
inline constexpr int kFastMaxExponent = 114;
inline constexpr int kMaxPartialExponent = 126;
inline constexpr int kMaxFoldShift = 12;     // 6 · 2^(12 − 6) = 384 <= 448, the e4m3 maximum
inline constexpr int kMaxQueryExponent = 115;  // 2^(12 + eq) stays a finite fp32
inline constexpr int16_t kNoExponent = INT16_MIN;  // an all-zero block
inline constexpr int16_t kNotFp4 = INT16_MAX;      // a block that is not e2m1 times a power of two

// Key rows of kRowBytes (32, 64 or 128) in shared memory: 16-byte chunk q of row r at chunk
// q ^ ((r · kChunks / 8) % kChunks), so that the 8 rows of an ldmatrix matrix (one chunk each)
// fall on 8 different groups of 4 banks.
template <int kRowBytes>
struct SwizzledKeyRows {
  static constexpr int kBytes = kRowBytes;
  static constexpr int kChunks = kRowBytes / 16;
  __host__ __device__ static constexpr int offset(int row, int chunk) {
    return row * kRowBytes + ((chunk ^ ((row * kChunks / 8) % kChunks)) << 4);
  }
};

// e2m1 codes in the low nibbles of the 4 bytes -> e4m3 bytes of the values times 2^-6; the high
// nibbles likewise.
__device__ __forceinline__ uint32_t low_e2m1x4_to_e4m3x4(uint32_t w) {
  return ((w & 0x08080808u) << 4) | ((w & 0x07070707u) << 2);
}
__device__ __forceinline__ uint32_t high_e2m1x4_to_e4m3x4(uint32_t w) {
  return (w & 0x80808080u) | ((w >> 2) & 0x1c1c1c1cu);
}

// The range of a key row's MXFP4 scale bytes, ek_b + 127 (a NaN scale, 0xff, is beyond the fast
// path's bounds: the double path carries the NaN).
struct ExponentRange {
  int lo, hi;
};

template <int kBlocks>
__device__ __forceinline__ ExponentRange key_exponents(uint32_t scales) {
  int lo = INT_MAX, hi = INT_MIN;
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const int e = static_cast<int>(__byte_perm(scales, 0u, 0x4440u + b));
    lo = min(lo, e), hi = max(hi, e);
  }
  return {lo, hi};
}

// A token's entries in TokenQueries::stats.
enum TokenStat {
  kEqLow,        // the smallest exponent eqmin_h of its FP4 heads' nonzero blocks
  kEqHigh,       // their largest
  kEqSpread,     // the largest eq spread of one head
  kSequence,     // the token's sequence
  kWeightsFold,  // 1 when hs·w is exact for every head (see "Folded weights")
  kWeightsBf16,  // 1 when every hs·w is also a bf16 number (see "Packed terms")
  kWeightExponentMin,  // the smallest exponent of a nonzero finite hs·w (INT_MAX: none)
  kWeightExponentMax,  // the largest (INT_MIN: none)
  kTokenStats = 8  // per token (32 bytes: the arrays after stats stay aligned)
};

// The fast path's bounds for one token (stats: its TokenStat entries; see "Exactness") on the key
// rows' exponent range: holds(range) tells whether the fp32 sums of a row's block terms are exact
// for every head of the token. normal_scales also excludes the scale bytes 0 (2^-127, a subnormal)
// and 255 (NaN), so that a kernel may form the fast rows' scales as byte << 23; normal_dots also
// keeps P and P·hs normal, so that bf16 rounding commutes with hs ("Folded weights").
// factored_terms also keeps the products of the terms formed from P (packed or not) and from P'
// normal and their sums finite ("Packed terms", "Row factor").
struct FastBounds {
  int spread, lo, hi;  // on scale bytes
  __device__ FastBounds(const int* stats, bool normal_scales, bool normal_dots, bool factored_terms = false)
      : spread(kFastSpread - stats[kEqSpread]),
        lo((normal_dots ? kNormalDotMinExponent : kFastMinExponent) - stats[kEqLow] + 127),
        hi(min(kFastMaxExponent - stats[kEqHigh], kMaxPartialExponent - stats[kEqSpread]) + 127) {
    if (normal_scales) lo = max(lo, 1), hi = min(hi, 254);
    if (normal_dots) lo = max(lo, kNormalPartialMinScale);
    if (factored_terms && stats[kWeightExponentMin] != INT_MAX) {  // e_w, E_w in [-149, 127]
      lo = max(lo, kPackedProductMinScale - stats[kWeightExponentMin]);
      hi = min(hi, kFactoredPartialMaxScale - stats[kWeightExponentMax]);
    }
  }
  __device__ bool holds(ExponentRange key) const {
    return (key.hi - key.lo <= spread) & (key.lo >= lo) & (key.hi <= hi);
  }
  // The bounds a key holds if and only if it holds both.
  __device__ FastBounds intersection(const FastBounds& o) const {
    FastBounds b = *this;
    b.spread = min(spread, o.spread), b.lo = max(lo, o.lo), b.hi = min(hi, o.hi);
    return b;
  }
};

// Whether a token whose weights fold may form its fast rows' terms from P' ("Row factor").
__device__ __forceinline__ bool factors_rows(const int* stats) {
  return stats[kWeightsFold] != 0 &&
         (stats[kWeightExponentMin] == INT_MAX ||
          (stats[kWeightExponentMin] >= kMinFactoredWeightExponent && stats[kWeightExponentMax] <= kMaxFactoredWeightExponent));
}

__device__ __forceinline__ float bf16_rounded(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// max(x, 0) that keeps NaN, as std::max(x, 0.0f) (one instruction; it may turn a -0 into +0,
// which changes no head sum: they start at +0).
__device__ __forceinline__ float relu(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats as a bf16 pair, x in the low half (exact for bf16 numbers).
__device__ __forceinline__ uint32_t bf16_pair(float2 v) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(v.y), "f"(v.x));
  return d;
}
__device__ __forceinline__ float low_bf16(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_bf16(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

// The reference's weighted terms of two dots in bf16_rounding: bf16(relu(bf16(dot)) · w), as a
// bf16 pair (dot0's term in the low half). relu keeps NaN (__hmax2_nan); it may turn a -0 into +0,
// which changes no sum.
__device__ __forceinline__ uint32_t bf16_weighted_term_pair(float dot0, float dot1, float2 w) {
  const float2 r = __bfloat1622float2(__hmax2_nan(__floats2bfloat162_rn(dot0, dot1), __float2bfloat162_rn(0.0f)));
  return bf16_pair(make_float2(__fmul_rn(r.x, w.x), __fmul_rn(r.y, w.y)));
}
__device__ __forceinline__ float2 bf16_weighted_terms(float dot0, float dot1, float2 w) {
  const uint32_t pair = bf16_weighted_term_pair(dot0, dot1, w);
  return make_float2(low_bf16(pair), high_bf16(pair));
}

// bf16_weighted_term_pair for bf16 weights w (a pair): relu(bf16(dot)) · w rounded once to bf16,
// one conversion and one bf16 multiply a pair. Equal to it where the products are
// normal (then the fp32 product of two bf16 numbers is exact, and so its rounding to bf16 is the
// bf16 multiply's): see "Packed terms".
__device__ __forceinline__ uint32_t packed_weighted_terms(float dot0, float dot1, uint32_t w) {
  uint32_t r, d;
  asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(dot1), "f"(dot0));  // relu keeps NaN
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(r), "r"(w));
  return d;
}

// x · 2^k, exact whenever the result is a normal fp32 or larger than x in magnitude (|k| <= 252):
// two power-of-two factors, the first one moving toward the result.
__device__ __forceinline__ float scaled_by_power_of_two(float x, int k) {
  const int k1 = k / 2;
  return __fmul_rn(__fmul_rn(x, __int_as_float((127 + k1) << 23)), __int_as_float((127 + k - k1) << 23));
}

// Whether scaled = w·hs (hs a power of two or NaN) is the exact product, for "Folded weights": so it
// is between normal numbers, for w = 0 or ±inf, and where hs is NaN (every term is NaN either way).
// Subnormal weights are taken as inexact.
__device__ __forceinline__ bool scales_exactly(float w, float scaled) {
  return isnan(scaled) || w == 0.0f || isinf(w) || (fabsf(w) >= FLT_MIN && fabsf(scaled) >= FLT_MIN && !isinf(scaled));
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

// A CTA's tokens in shared memory (each kernel's layout places the arrays).
struct TokenQueries {
  float* head_scales;   // [tokens, padded heads] 2^(12 + eqmin_h); NaN: a head with a block that is not FP4
  float* block_scales;  // [tokens, padded heads, blocks] 2^(12 + eq_b − d_b), the slow path's block factors
  float* weights;       // [tokens, padded heads] (0 for padding heads)
  float* folded_weights;  // [tokens, padded heads] hs·w (see "Folded weights")
  int16_t* exponents;   // [tokens, padded heads, blocks] eq_b, kNoExponent (zero block) or kNotFp4
  int* stats;           // [tokens, kTokenStats] TokenStat
  int64_t* visible;     // [tokens] min(n_vis(p), entries)
};

// Where the TokenQueries arrays of `tokens` tokens lie in a block of shared memory (16-byte
// aligned at its start; bytes() a multiple of 16).
struct TokenArrays {
  size_t tokens, heads, blocks;  // heads: padded
  __host__ __device__ static size_t align16(size_t n) { return (n + 15) / 16 * 16; }
  __host__ __device__ size_t block_scales() const { return tokens * heads * 4; }
  __host__ __device__ size_t weights() const { return block_scales() + tokens * heads * blocks * 4; }
  __host__ __device__ size_t folded_weights() const { return weights() + tokens * heads * 4; }
  __host__ __device__ size_t exponents() const { return folded_weights() + tokens * heads * 4; }
  __host__ __device__ size_t stats() const { return align16(exponents() + tokens * heads * blocks * 2); }
  __host__ __device__ size_t visible() const { return stats() + tokens * kTokenStats * 4; }
  __host__ __device__ size_t bytes() const { return align16(visible() + tokens * 8); }
  __device__ TokenQueries at(uint8_t* base) const {
    return {reinterpret_cast<float*>(base), reinterpret_cast<float*>(base + block_scales()),
            reinterpret_cast<float*>(base + weights()), reinterpret_cast<float*>(base + folded_weights()),
            reinterpret_cast<int16_t*>(base + exponents()),
            reinterpret_cast<int*>(base + stats()), reinterpret_cast<int64_t*>(base + visible())};
  }
};

// Tokens t0 … t0 + count − 1: their sequences and visible lengths, the exponent bounds emptied.
template <int kThreads>
__device__ void init_tokens(const IndexScoresLaunch& a, int64_t t0, int count, const TokenQueries& s) {
  for (int i = threadIdx.x; i < count; i += kThreads) {
    int* stats = s.stats + kTokenStats * i;
    stats[kEqLow] = INT_MAX, stats[kEqHigh] = INT_MIN, stats[kEqSpread] = 0, stats[kWeightsFold] = 1;
    stats[kWeightsBf16] = 1, stats[kWeightExponentMin] = INT_MAX, stats[kWeightExponentMax] = INT_MIN;
    stats[kSequence] = a.token_sequence ? a.token_sequence[t0 + i] : 0;
    const int64_t n_vis = visible_entries(a.token_position[t0 + i], a.compress_ratio);
    s.visible[i] = n_vis < a.entries ? n_vis : a.entries;
  }
}

// The tokens' queries (after init_tokens and a barrier): block exponents, then each head folded
// onto its smallest one (see "Exactness"); stage(q block or null for a padding head, token, head,
// block, eq, shift) writes the block's codes in the implementation's MMA layout. Ends with a barrier.
template <int kBlocks, int kThreads, class Stage>
__device__ void prepare_queries(const IndexScoresLaunch& a, int64_t t0, int count, int padded_heads,
                                const TokenQueries& s, Stage stage) {
  auto query = [&](int i, int h, int b) {
    return h < a.heads ? a.q + ((t0 + i) * a.heads + h) * (kBlocks * kBlockChannels) + b * kBlockChannels : nullptr;
  };
  for (int task = threadIdx.x; task < count * padded_heads * kBlocks; task += kThreads) {
    const int i = task / (padded_heads * kBlocks), h = task / kBlocks % padded_heads, b = task % kBlocks;
    s.exponents[task] = query_block_exponent(query(i, h, b));
    if (b == 0) s.weights[i * padded_heads + h] = h < a.heads ? a.weights[(t0 + i) * a.heads + h] : 0.0f;
  }
  __syncthreads();
  for (int task = threadIdx.x; task < count * padded_heads * kBlocks; task += kThreads) {
    const int i = task / (padded_heads * kBlocks), h = task / kBlocks % padded_heads, b = task % kBlocks;
    const int16_t* e = s.exponents + (task - b);
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
    stage(query(i, h, b), i, h, b, eq, shift);
    const float nan = __int_as_float(0x7fc00000);
    s.block_scales[task] = !fp4 ? nan : ldexpf(1.0f, 12 + (folded ? lo : eq == kNoExponent ? 0 : eq));
    if (b == 0) {
      int* stats = s.stats + kTokenStats * i;
      const float head_scale = fp4 ? ldexpf(1.0f, 12 + lo) : nan, w = s.weights[i * padded_heads + h];
      const float folded_weight = __fmul_rn(head_scale, w);
      s.head_scales[i * padded_heads + h] = head_scale;
      s.folded_weights[i * padded_heads + h] = folded_weight;
      if (!scales_exactly(w, folded_weight)) atomicAnd(&stats[kWeightsFold], 0);
      if ((__float_as_uint(folded_weight) & 0xffffu) != 0) atomicAnd(&stats[kWeightsBf16], 0);
      if (folded_weight != 0.0f && isfinite(folded_weight)) {
        atomicMin(&stats[kWeightExponentMin], ilogbf(folded_weight));
        atomicMax(&stats[kWeightExponentMax], ilogbf(folded_weight));
      }
      if (fp4 && nonzero && h < a.heads) {
        atomicMin(&stats[kEqLow], lo);
        atomicMax(&stats[kEqHigh], hi);
        atomicMax(&stats[kEqSpread], hi - lo);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += kThreads) {
    int* stats = s.stats + kTokenStats * i;
    if (stats[kEqLow] > stats[kEqHigh]) stats[kEqLow] = stats[kEqHigh] = 0;  // no nonzero FP4 block
  }
  __syncthreads();
}

}  // namespace dsv4::cuda::index_fp4

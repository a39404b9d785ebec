// Exact decoding of a raw cache row (its data bytes, then its scale bytes, as copied from a page
// into shared memory) to bf16, 16 channels at a time: what the warp-specialized attention kernels'
// decoding warps run (decode_mma's producers; wgmma's consumers for the V4.1 native rows, its
// producer for fp8_ds_mla). Every format taken here has values exact in bf16: bf16;
// e4m3 codes times ue8m0 scales (v41_fp8, fp8_ds_mla); e2m1 codes times e4m3 scales (v41_fp4).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cache/row_codec.h"
#include "cuda/ops/attention/mma/mma_fragments.cuh"

namespace dsv4::cuda::row_decode {

using mma::kRowChannels;

// Eight e4m3 codes (little-endian) times `scale` (a power of two or an e4m3 value) as bf16, the
// codec's values exactly: e4m3 is exact in f16 (cvt.rn.f16x2.e4m3x2, sm_89+), the product of two
// 4-bit significands exact in f32 and in bf16.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_codes, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes), __NV_E4M3);
  return mma::pack_bf16(__half2float(__half(__half_raw{h.x})) * scale, __half2float(__half(__half_raw{h.y})) * scale);
}
__device__ __forceinline__ uint4 e4m3x8_to_bf16(uint2 codes, float scale) {
  return make_uint4(e4m3x2_to_bf16x2(codes.x & 0xffffu, scale), e4m3x2_to_bf16x2(codes.x >> 16, scale),
                    e4m3x2_to_bf16x2(codes.y & 0xffffu, scale), e4m3x2_to_bf16x2(codes.y >> 16, scale));
}

// Paired order: a group of eight channels stored as the bf16 pairs (0, 4), (1, 5), (2, 6), (3, 7)
// instead of (0, 1) … (6, 7). A kernel whose Q·Kᵀ reads Q in the same order and whose P·V output
// is stored back in channel order may decode into it: the e2m1 codes then decode by moving bits
// (e2m1x8_to_bf16_paired_bits), without the table's lookups.
__device__ __forceinline__ uint4 e4m3x8_to_bf16_paired(uint2 codes, float scale) {
  return make_uint4(e4m3x2_to_bf16x2(__byte_perm(codes.x, codes.y, 0x40u), scale),
                    e4m3x2_to_bf16x2(__byte_perm(codes.x, codes.y, 0x51u), scale),
                    e4m3x2_to_bf16x2(__byte_perm(codes.x, codes.y, 0x62u), scale),
                    e4m3x2_to_bf16x2(__byte_perm(codes.x, codes.y, 0x73u), scale));
}
__device__ __forceinline__ uint4 bf16x8_paired(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410u), __byte_perm(v.x, v.z, 0x7632u), __byte_perm(v.y, v.w, 0x5410u),
                    __byte_perm(v.y, v.w, 0x7632u));
}
// Its inverse: eight bf16 in paired order back to channel order.
__device__ __forceinline__ uint4 bf16x8_unpaired(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.y, 0x5410u), __byte_perm(v.z, v.w, 0x5410u), __byte_perm(v.x, v.y, 0x7632u),
                    __byte_perm(v.z, v.w, 0x7632u));
}
// Four values, half a group in paired order (positions 4·odd …: channels 2·odd, 2·odd + 4,
// 2·odd + 1, 2·odd + 5), with the lane `lane ^ 1` that holds the other half (both calling): back
// to channel order, channels 4·odd … 4·odd + 3 of the group, odd = lane & 1.
__device__ __forceinline__ void f32x4_half_unpaired(float (&v)[4], int lane) {
  const bool odd = lane & 1;
  const unsigned pair = 3u << (lane & 30);
  const float given0 = __shfl_xor_sync(pair, odd ? v[0] : v[1], 1), given1 = __shfl_xor_sync(pair, odd ? v[2] : v[3], 1);
  if (odd) v[0] = given0, v[2] = v[1], v[1] = given1;
  else v[1] = v[2], v[2] = given0, v[3] = given1;
}

// The eight e2m1 magnitudes (codes 0 … 7) times one e4m3 scale as bf16 (exact: at most 2 + 4
// significant bits, so the bf16 products round nothing), split into byte tables for __byte_perm:
// low bytes of codes 0-3, of 4-7, high bytes of 0-3, of 4-7. Computed once per 16 channels (they
// share the scale).
struct E2m1Table {
  uint32_t low[2], high[2];
  // scale_code: the e4m3 scale, exact in f16 (cvt.rn.f16x2.e4m3x2) and in bf16.
  __device__ __forceinline__ explicit E2m1Table(uint8_t scale_code) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(scale_code), __NV_E4M3);
    const __nv_bfloat162 scale = __float2bfloat162_rn(__half2float(__half(__half_raw{h.x})));
    auto times = [&](float a, float b) {
      const __nv_bfloat162 product = __hmul2(__floats2bfloat162_rn(a, b), scale);
      return *reinterpret_cast<const uint32_t*>(&product);
    };
    const uint32_t w0 = times(0.0f, 0.5f), w1 = times(1.0f, 1.5f), w2 = times(2.0f, 3.0f), w3 = times(4.0f, 6.0f);
    low[0] = __byte_perm(w0, w1, 0x6420), low[1] = __byte_perm(w2, w3, 0x6420);
    high[0] = __byte_perm(w0, w1, 0x7531), high[1] = __byte_perm(w2, w3, 0x7531);
  }
  // Eight codes (the nibbles of `codes`, the first lowest) as four bf16 pairs: the magnitudes'
  // bytes looked up and interleaved, then each code's sign bit (bit 3 of its nibble) moved onto its
  // product's sign bit, flipping it ((-v)·s = -(v·s)): pair k's signs come from byte k of
  // codes << 4 (the even code's, into bit 15) and of codes (the odd code's, into bit 31).
  __device__ __forceinline__ uint4 lookup8(uint32_t codes) const {
    uint32_t pairs[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t index = (codes >> (16 * half)) & 0x7777u;
      const uint32_t lo = __byte_perm(low[0], low[1], index), hi = __byte_perm(high[0], high[1], index);
      pairs[2 * half] = __byte_perm(lo, hi, 0x5140), pairs[2 * half + 1] = __byte_perm(lo, hi, 0x7362);
    }
    const uint32_t even_signs = codes << 4;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t selector = 0x4000u + 0x1111u * k;  // byte 1 <- byte k of even_signs, byte 3 <- byte k of codes
      pairs[k] ^= __byte_perm(even_signs, codes, selector) & 0x80008000u;
    }
    return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
  }
};

// Eight e2m1 codes in paired order by moving bits instead of looking them up: a code s|eem placed
// as the bf16 bits s << 15 | eem << 6 is its value times 2^-126 exactly (the exponent's low two bits
// and the first mantissa bit; code 1, 0.5, lands on the subnormal 2^-127, which bf16 arithmetic
// keeps). Pair k takes codes k and k + 4: one shift for both magnitudes, one for both signs. Times
// `scale_2_119`, the scale times 2^119 (exact in bf16, below 2^128 for every e4m3 scale), the product
// is value x scale x 2^-7, exact (at most 6 significant bits, at least 2^-17): paired order's value
// (kPairedValueScale below). (Host-callable: row_decode_check.h runs it on the host for the tests.)
__host__ __device__ __forceinline__ __nv_bfloat162 e2m1_scale_times_2_119(uint8_t scale_code) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(scale_code), __NV_E4M3);
  return __float2bfloat162_rn(__half2float(__half(__half_raw{h.x})) * 0x1p119f);
}
// Paired order's values are the codec's times 2^-7 (1 / kPairedValueScale), which saves the e2m1
// codes a multiply a pair; a kernel that reads them compensates.
inline constexpr float kPairedValueScale = 128.0f;
__host__ __device__ __forceinline__ uint4 e2m1x8_to_bf16_paired_bits(uint32_t codes, __nv_bfloat162 scale_2_119) {
  uint32_t pairs[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t magnitudes = (k < 2 ? codes << (6 - 4 * k) : codes >> (4 * k - 6)) & 0x01c001c0u;
    const uint32_t bits = magnitudes | ((codes << (12 - 4 * k)) & 0x80008000u);
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), scale_2_119);
    pairs[k] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

// Eight e2m1 codes (packed, the even channel in the low nibble) times the table's scale as bf16.
__device__ __forceinline__ uint4 e2m1x8_to_bf16(uint32_t codes, const E2m1Table& table) { return table.lookup8(codes); }

// A lane's channels c0 … c0 + 15 of a row in their raw form: what decode16 reads (the codes of
// each half of 8 channels, `first` = c0 + 8·upper … + 7, `second` the other half, and their scale),
// apart from the conversion, so that a warp decoding several rows can issue all their loads before
// it stores any result (a row's stores would otherwise hold the next row's loads behind them: both
// are shared memory, which the compiler cannot tell apart). Only the words a format uses are kept.
struct Raw16 {
  uint4 first, second;  // bf16: all 16 bytes; e4m3: .x, .y; e2m1: .x
  uint32_t scale;       // e4m3: the f32 bits of the scale; e2m1: its e4m3 code
};

// Channels c0 … c0 + 15 (c0 a multiple of 16) of a row of format F (its data bytes at `row_data`,
// its scale bytes at `scales`), loaded for decode16 below (upper 0 or 1: the order a lane stores
// the halves in).
template <KvRowFormat F>
__device__ __forceinline__ Raw16 load16(const uint8_t* row_data, const uint8_t* scales, int c0, int upper) {
  const int c_first = c0 + 8 * upper, c_second = c0 + 8 * (upper ^ 1);
  auto data = [&](int c) { return row_data + row_codec::channel_offset<F>(c); };
  Raw16 raw{};
  switch (row_codec::channel_code<F>(c0)) {
    case row_codec::ChannelCode::bf16:
      raw.first = *reinterpret_cast<const uint4*>(data(c_first)), raw.second = *reinterpret_cast<const uint4*>(data(c_second));
      break;
    case row_codec::ChannelCode::e4m3: {
      const uint2 first = *reinterpret_cast<const uint2*>(data(c_first)), second = *reinterpret_cast<const uint2*>(data(c_second));
      raw.first.x = first.x, raw.first.y = first.y, raw.second.x = second.x, raw.second.y = second.y;
      raw.scale = __float_as_uint(row_codec::channel_scale<F>(scales, c0, 1.0f));
      break;
    }
    case row_codec::ChannelCode::e2m1:
      // v41_fp4: one e4m3 scale per 16 channels (index_mxfp4 keys, ue8m0 per 32, are not decoded here).
      static_assert(F != KvRowFormat::index_mxfp4 && row_codec::kV41Fp4Tile == 16);
      raw.first.x = *reinterpret_cast<const uint32_t*>(data(c_first));
      raw.second.x = *reinterpret_cast<const uint32_t*>(data(c_second));
      raw.scale = scales[c0 / 16];
      break;
    default: break;  // f32 rows are not decoded here
  }
  return raw;
}

// Those channels as bf16, in the same two halves. The values are the row codec's (code x scale),
// which are exact in bf16 for every format taken here.
// kPaired (the V4.1 native rows): each half in paired order (above), the scaled values times 2^-7
// (kPairedValueScale), which saves the e2m1 codes a multiply a pair and costs the e4m3 codes one a
// 16 channels.
template <KvRowFormat F, bool kPaired = false>
__device__ __forceinline__ void decode16(const Raw16& raw, int c0, uint4& first, uint4& second) {
  static_assert(!kPaired || F == KvRowFormat::v41_fp8 || F == KvRowFormat::v41_fp4,
                "paired order is decoded for the V4.1 native rows only");
  switch (row_codec::channel_code<F>(c0)) {
    case row_codec::ChannelCode::bf16:
      if constexpr (kPaired) first = bf16x8_paired(raw.first), second = bf16x8_paired(raw.second);
      else first = raw.first, second = raw.second;
      return;
    case row_codec::ChannelCode::e4m3: {
      const float scale = __uint_as_float(raw.scale) * (kPaired ? 1.0f / kPairedValueScale : 1.0f);
      const uint2 a = make_uint2(raw.first.x, raw.first.y), b = make_uint2(raw.second.x, raw.second.y);
      if constexpr (kPaired) first = e4m3x8_to_bf16_paired(a, scale), second = e4m3x8_to_bf16_paired(b, scale);
      else first = e4m3x8_to_bf16(a, scale), second = e4m3x8_to_bf16(b, scale);
      return;
    }
    case row_codec::ChannelCode::e2m1: {
      if constexpr (kPaired) {
        const __nv_bfloat162 scale = e2m1_scale_times_2_119(static_cast<uint8_t>(raw.scale));
        first = e2m1x8_to_bf16_paired_bits(raw.first.x, scale);
        second = e2m1x8_to_bf16_paired_bits(raw.second.x, scale);
        return;
      }
      const E2m1Table table(static_cast<uint8_t>(raw.scale));
      first = e2m1x8_to_bf16(raw.first.x, table), second = e2m1x8_to_bf16(raw.second.x, table);
      return;
    }
    default: return;
  }
}

// Both steps at once.
template <KvRowFormat F>
__device__ __forceinline__ void decode16(const uint8_t* row_data, const uint8_t* scales, int c0, int upper,
                                         uint4& first, uint4& second) {
  decode16<F>(load16<F>(row_data, scales, c0, upper), c0, first, second);
}

// The same of a raw row copied into shared memory: its data bytes, then its scale bytes.
template <KvRowFormat F>
__device__ __forceinline__ Raw16 load16(const uint8_t* raw, int c0, int upper) {
  return load16<F>(raw, raw + row_codec::data_bytes(F, kRowChannels), c0, upper);
}
template <KvRowFormat F>
__device__ __forceinline__ void decode16(const uint8_t* raw, int c0, int upper, uint4& first, uint4& second) {
  decode16<F>(load16<F>(raw, c0, upper), c0, first, second);
}

// Calls f(std::integral_constant<KvRowFormat, F>{}) for the format decode16 takes: v41_fp8, v41_fp4,
// fp8_ds_mla, else bf16 (its callers admit no other).
template <class Visit>
__host__ __device__ __forceinline__ void visit_decoded_format(KvRowFormat format, Visit&& f) {
  switch (format) {
    case KvRowFormat::v41_fp8: f(std::integral_constant<KvRowFormat, KvRowFormat::v41_fp8>{}); return;
    case KvRowFormat::v41_fp4: f(std::integral_constant<KvRowFormat, KvRowFormat::v41_fp4>{}); return;
    case KvRowFormat::fp8_ds_mla: f(std::integral_constant<KvRowFormat, KvRowFormat::fp8_ds_mla>{}); return;
    default: f(std::integral_constant<KvRowFormat, KvRowFormat::bf16>{}); return;
  }
}

__device__ __forceinline__ void decode16(KvRowFormat format, const uint8_t* raw, int c0, int upper, uint4& first,
                                         uint4& second) {
  visit_decoded_format(format, [&](auto f) { decode16<decltype(f)::value>(raw, c0, upper, first, second); });
}

// 8-byte chunks of a row's data and of its scales (every format decode_mma takes has both multiples of 8).
struct RawLayout {
  int data_chunks = 0, chunks = 0;
  __device__ explicit RawLayout(KvRowFormat f)
      : data_chunks(static_cast<int>(row_codec::data_bytes(f, kRowChannels) / 8)),
        chunks(data_chunks + static_cast<int>(row_codec::scale_bytes(f, kRowChannels) / 8)) {}
};

}  // namespace dsv4::cuda::row_decode

// The codec of every KV row format (SPEC §7, dsv4/kv_format.h, docs/formats.md): each format's
// constants, the per-tile encode (scale choice and codes), the per-channel decode and the
// little-endian placement of codes and scales in a row's data and scale bytes. Header-only and
// DSV4_HD: kv_format.cpp's encode_rows / decode_rows and the CUDA kernels' paged-row access
// (cuda/common/paged_rows.cuh) both call it, so bytes and rounding are decided here alone. Every
// number conversion is a numeric.h function.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"

// The per-channel helpers sit in the kernels' innermost loops.
#if defined(__CUDACC__)
#define DSV4_CODEC_INLINE __forceinline__
#else
#define DSV4_CODEC_INLINE inline
#endif

namespace dsv4::row_codec {

// ------------------------------------------------------------------------------------------------
// Format constants.

inline constexpr int kHeadDim = 512;             // v41_fp8 / v41_fp4 / fp8_ds_mla rows are whole heads
inline constexpr int kV41Fp8Tile = 32;           // e4m3 values per ue8m0 scale
inline constexpr int kV41Fp4Tile = 16;           // e2m1 values per e4m3 scale
inline constexpr int kMxfp4Tile = 32;            // e2m1 values per ue8m0 scale
inline constexpr int kDsMlaNopeDims = 448;       // fp8_ds_mla: e4m3 NoPE channels, then bf16 RoPE channels
inline constexpr int kDsMlaTile = 64;
inline constexpr int kDsMlaTiles = kDsMlaNopeDims / kDsMlaTile;  // 7 scale bytes, then 1 padding byte
inline constexpr int kIndexFp8ScaleBytes = 4;    // index_fp8: one fp32 scale per row
// bf16 / fp8_per_tensor / f32 rows have no scales; encode_tile writes them this many channels at a
// time.
inline constexpr int kPlainTile = 32;

// Bytes of values and of scales (with fp8_ds_mla's padding byte) of a row of `dims` channels;
// `dims` suits the format (row_layout checks it).
DSV4_HD constexpr int64_t data_bytes(KvRowFormat format, int64_t dims) {
  switch (format) {
    case KvRowFormat::bf16: return 2 * dims;
    case KvRowFormat::f32: return 4 * dims;
    case KvRowFormat::fp8_per_tensor:
    case KvRowFormat::v41_fp8:
    case KvRowFormat::index_fp8: return dims;
    case KvRowFormat::v41_fp4:
    case KvRowFormat::index_mxfp4: return dims / 2;
    case KvRowFormat::fp8_ds_mla: return kDsMlaNopeDims + 2 * (dims - kDsMlaNopeDims);
  }
  return 0;
}
DSV4_HD constexpr int64_t scale_bytes(KvRowFormat format, int64_t dims) {
  switch (format) {
    case KvRowFormat::bf16:
    case KvRowFormat::fp8_per_tensor:
    case KvRowFormat::f32: return 0;
    case KvRowFormat::v41_fp8: return dims / kV41Fp8Tile;
    case KvRowFormat::v41_fp4: return dims / kV41Fp4Tile;
    case KvRowFormat::fp8_ds_mla: return kDsMlaTiles + 1;
    case KvRowFormat::index_mxfp4: return dims / kMxfp4Tile;
    case KvRowFormat::index_fp8: return kIndexFp8ScaleBytes;
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------
// Little-endian byte placement.

DSV4_HD DSV4_CODEC_INLINE uint16_t load_u16_le(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
DSV4_HD DSV4_CODEC_INLINE void store_u16_le(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
DSV4_HD DSV4_CODEC_INLINE float load_f32_le(const uint8_t* p) {
  return float_from_bits(uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24);
}
DSV4_HD DSV4_CODEC_INLINE void store_f32_le(uint8_t* p, float f) {
  const uint32_t v = float_bits(f);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// ------------------------------------------------------------------------------------------------
// Decode.

// How channel c of a row of format F is stored.
enum class ChannelCode : uint8_t { bf16, e4m3, e2m1, f32 };

template <KvRowFormat F>
DSV4_HD DSV4_CODEC_INLINE constexpr ChannelCode channel_code(int c) {
  if constexpr (F == KvRowFormat::bf16) return ChannelCode::bf16;
  else if constexpr (F == KvRowFormat::f32) return ChannelCode::f32;
  else if constexpr (F == KvRowFormat::v41_fp4 || F == KvRowFormat::index_mxfp4) return ChannelCode::e2m1;
  else if constexpr (F == KvRowFormat::fp8_ds_mla) return c < kDsMlaNopeDims ? ChannelCode::e4m3 : ChannelCode::bf16;
  else return ChannelCode::e4m3;
}

// Offset in the row's data of channel c's code (e2m1: of the byte holding it, the even channel in
// the low nibble).
template <KvRowFormat F>
DSV4_HD DSV4_CODEC_INLINE constexpr int channel_offset(int c) {
  if constexpr (F == KvRowFormat::bf16) return 2 * c;
  else if constexpr (F == KvRowFormat::f32) return 4 * c;
  else if constexpr (F == KvRowFormat::v41_fp4 || F == KvRowFormat::index_mxfp4) return c / 2;
  else if constexpr (F == KvRowFormat::fp8_ds_mla) return c < kDsMlaNopeDims ? c : kDsMlaNopeDims + 2 * (c - kDsMlaNopeDims);
  else return c;
}

// The scale channel c's code is multiplied by (an e4m3 or e2m1 channel; `tensor_scale` is
// fp8_per_tensor's).
template <KvRowFormat F>
DSV4_HD DSV4_CODEC_INLINE float channel_scale(const uint8_t* scales, int c, float tensor_scale) {
  if constexpr (F == KvRowFormat::fp8_per_tensor) return tensor_scale;
  else if constexpr (F == KvRowFormat::v41_fp8) return ue8m0_to_float(scales[c / kV41Fp8Tile]);
  else if constexpr (F == KvRowFormat::v41_fp4) return e4m3_to_float(scales[c / kV41Fp4Tile]);
  else if constexpr (F == KvRowFormat::fp8_ds_mla) return ue8m0_to_float(scales[c / kDsMlaTile]);
  else if constexpr (F == KvRowFormat::index_mxfp4) return ue8m0_to_float(scales[c / kMxfp4Tile]);
  else if constexpr (F == KvRowFormat::index_fp8) return load_f32_le(scales);
  else return 1.0f;
}

// Channel c's code times `scale`, the scale of its tile (see channel_scale); bf16 and f32 channels
// have no scale and ignore it.
template <KvRowFormat F>
DSV4_HD DSV4_CODEC_INLINE float scaled_channel(const uint8_t* data, int c, float scale) {
  switch (channel_code<F>(c)) {
    case ChannelCode::bf16: return bf16_bits_to_float(load_u16_le(data + channel_offset<F>(c)));
    case ChannelCode::f32: return load_f32_le(data + channel_offset<F>(c));
    case ChannelCode::e4m3: return e4m3_to_float(data[channel_offset<F>(c)]) * scale;
    case ChannelCode::e2m1: return e2m1_to_float(unpack_e2m1(data, c)) * scale;
  }
  return 0.0f;
}

// The scale of the tile of channel c, or 1 for a bf16 channel (f32 rows: channel_scale's 1).
template <KvRowFormat F>
DSV4_HD DSV4_CODEC_INLINE float scale_of_channel(const uint8_t* scales, int c, float tensor_scale) {
  return channel_code<F>(c) == ChannelCode::bf16 ? 1.0f : channel_scale<F>(scales, c, tensor_scale);
}

// The exact dequantized value of channel c (code x scale) of a row of format F.
template <KvRowFormat F>
DSV4_HD DSV4_CODEC_INLINE float decode_channel(const uint8_t* data, const uint8_t* scales, int c, float tensor_scale) {
  return scaled_channel<F>(data, c, scale_of_channel<F>(scales, c, tensor_scale));
}

// Channels of a row of format F that share their code and scale, from channel 0 on: a tile, or
// the whole row when the format has one scale (or none) per row. fp8_ds_mla's 64 bf16 RoPE
// channels are its eighth run.
template <KvRowFormat F>
DSV4_HD constexpr int run_channels(int dims) {
  if constexpr (F == KvRowFormat::v41_fp8) return kV41Fp8Tile;
  else if constexpr (F == KvRowFormat::v41_fp4) return kV41Fp4Tile;
  else if constexpr (F == KvRowFormat::fp8_ds_mla) return kDsMlaTile;
  else if constexpr (F == KvRowFormat::index_mxfp4) return kMxfp4Tile;
  else return dims;
}

// Channels [c0, c0 + n) of a run (see run_channels) into out [n]: decode_channel's values, with
// the scale read once.
template <KvRowFormat F>
DSV4_HD inline void decode_run(const uint8_t* data, const uint8_t* scales, int c0, int n, float tensor_scale, float* out) {
  const float scale = scale_of_channel<F>(scales, c0, tensor_scale);
  for (int i = 0; i < n; ++i) out[i] = scaled_channel<F>(data, c0 + i, scale);
}

// Calls f(std::integral_constant<KvRowFormat, format>{}) so that loops inside f decode with a
// compile-time format.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable  // f is a device lambda in kernels, a host one in kv_format.cpp
#endif
template <class Visitor>
DSV4_HD DSV4_CODEC_INLINE void visit_format(KvRowFormat format, Visitor&& f) {
  switch (format) {
    case KvRowFormat::bf16: f(std::integral_constant<KvRowFormat, KvRowFormat::bf16>{}); return;
    case KvRowFormat::fp8_per_tensor: f(std::integral_constant<KvRowFormat, KvRowFormat::fp8_per_tensor>{}); return;
    case KvRowFormat::v41_fp8: f(std::integral_constant<KvRowFormat, KvRowFormat::v41_fp8>{}); return;
    case KvRowFormat::v41_fp4: f(std::integral_constant<KvRowFormat, KvRowFormat::v41_fp4>{}); return;
    case KvRowFormat::fp8_ds_mla: f(std::integral_constant<KvRowFormat, KvRowFormat::fp8_ds_mla>{}); return;
    case KvRowFormat::index_mxfp4: f(std::integral_constant<KvRowFormat, KvRowFormat::index_mxfp4>{}); return;
    case KvRowFormat::index_fp8: f(std::integral_constant<KvRowFormat, KvRowFormat::index_fp8>{}); return;
    case KvRowFormat::f32: f(std::integral_constant<KvRowFormat, KvRowFormat::f32>{}); return;
  }
}

// Decodes a whole row of `dims` channels into out, run by run.
DSV4_HD inline void decode_row(KvRowFormat format, int dims, const uint8_t* data, const uint8_t* scales,
                               float tensor_scale, float* out) {
  visit_format(format, [&](auto f) {
    constexpr KvRowFormat F = decltype(f)::value;
    const int run = run_channels<F>(dims);
    for (int c0 = 0; c0 < dims; c0 += run)
      decode_run<F>(data, scales, c0, run < dims - c0 ? run : dims - c0, tensor_scale, out + c0);
  });
}

// ------------------------------------------------------------------------------------------------
// Encode.

// e4m3 codes of one tile with a ue8m0 scale; returns the scale byte.
DSV4_HD DSV4_CODEC_INLINE uint8_t encode_fp8_tile(const float* x, int n, uint8_t* codes, Fp8ScaleFloor floor) {
  const uint8_t scale_byte = fp8_ue8m0_scale_byte(abs_max(x, n), floor);
  const float scale = ue8m0_to_float(scale_byte);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e4m3(divide_rn(x[i], scale));
  return scale_byte;
}

// e2m1 codes of one tile (n even), two per byte, the even channel in the low nibble.
DSV4_HD DSV4_CODEC_INLINE void encode_fp4_tile(const float* x, int n, float scale, uint8_t* packed) {
  for (int i = 0; i < n; i += 2)
    packed[i / 2] = pack_e2m1x2(float_to_e2m1(divide_rn(x[i], scale)), float_to_e2m1(divide_rn(x[i + 1], scale)));
}

// Tiles a row is encoded in: encode_tile(t) for every t < count writes the whole row (fp8_ds_mla:
// 7 e4m3 tiles, then one tile for the bf16 RoPE channels and the padding byte).
DSV4_HD constexpr int encode_tile_count(KvRowFormat format, int dims) {
  switch (format) {
    case KvRowFormat::v41_fp8: return dims / kV41Fp8Tile;
    case KvRowFormat::v41_fp4: return dims / kV41Fp4Tile;
    case KvRowFormat::fp8_ds_mla: return kDsMlaTiles + 1;
    case KvRowFormat::index_mxfp4: return dims / kMxfp4Tile;
    case KvRowFormat::index_fp8: return 1;
    case KvRowFormat::bf16:
    case KvRowFormat::fp8_per_tensor:
    case KvRowFormat::f32: return (dims + kPlainTile - 1) / kPlainTile;
  }
  return 0;
}

DSV4_HD constexpr int plain_tile_end(int dims, int t) { return dims < (t + 1) * kPlainTile ? dims : (t + 1) * kPlainTile; }

// Encodes tile t of the row x [dims] into the row's data and scale bytes. `tensor_scale` is
// fp8_per_tensor's (stored value e4m3(x / tensor_scale)); `floor` applies to the FP8 power-of-two
// scales of v41_fp8, fp8_ds_mla and index_fp8. Bytes the format leaves free (fp8_ds_mla's scale
// padding) are written as 0.
DSV4_HD inline void encode_tile(KvRowFormat format, int dims, const float* x, int t, uint8_t* data, uint8_t* scales,
                                float tensor_scale, Fp8ScaleFloor floor) {
  switch (format) {
    case KvRowFormat::bf16:
      for (int c = t * kPlainTile; c < plain_tile_end(dims, t); ++c) store_u16_le(data + 2 * c, float_to_bf16_bits(x[c]));
      return;
    case KvRowFormat::fp8_per_tensor:
      for (int c = t * kPlainTile; c < plain_tile_end(dims, t); ++c) data[c] = float_to_e4m3(divide_rn(x[c], tensor_scale));
      return;
    case KvRowFormat::f32:
      for (int c = t * kPlainTile; c < plain_tile_end(dims, t); ++c) store_f32_le(data + 4 * c, x[c]);
      return;
    case KvRowFormat::v41_fp8:
      scales[t] = encode_fp8_tile(x + t * kV41Fp8Tile, kV41Fp8Tile, data + t * kV41Fp8Tile, floor);
      return;
    case KvRowFormat::v41_fp4: {
      const float* tile = x + t * kV41Fp4Tile;
      scales[t] = fp4_e4m3_scale_code(abs_max(tile, kV41Fp4Tile));
      encode_fp4_tile(tile, kV41Fp4Tile, e4m3_to_float(scales[t]), data + t * kV41Fp4Tile / 2);
      return;
    }
    case KvRowFormat::fp8_ds_mla:
      if (t < kDsMlaTiles) {
        scales[t] = encode_fp8_tile(x + t * kDsMlaTile, kDsMlaTile, data + t * kDsMlaTile, floor);
      } else {
        for (int c = kDsMlaNopeDims; c < dims; ++c)
          store_u16_le(data + channel_offset<KvRowFormat::fp8_ds_mla>(c), float_to_bf16_bits(x[c]));
        scales[kDsMlaTiles] = 0;
      }
      return;
    case KvRowFormat::index_mxfp4: {
      const float* tile = x + t * kMxfp4Tile;
      scales[t] = fp4_ue8m0_scale_byte(abs_max(tile, kMxfp4Tile));
      encode_fp4_tile(tile, kMxfp4Tile, ue8m0_to_float(scales[t]), data + t * kMxfp4Tile / 2);
      return;
    }
    case KvRowFormat::index_fp8:
      // One scale over the whole row, stored as the fp32 value of the power of two.
      store_f32_le(scales, ue8m0_to_float(encode_fp8_tile(x, dims, data, floor)));
      return;
  }
}

// Encodes a whole row: every tile in order.
DSV4_HD inline void encode_row(KvRowFormat format, int dims, const float* x, uint8_t* data, uint8_t* scales,
                               float tensor_scale, Fp8ScaleFloor floor) {
  for (int t = 0; t < encode_tile_count(format, dims); ++t) encode_tile(format, dims, x, t, data, scales, tensor_scale, floor);
}

}  // namespace dsv4::row_codec

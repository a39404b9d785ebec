// Device side of paged-cache access: row lookup by slot or by (sequence, row), per-channel decode
// and per-tile encode of every KvRowFormat. Each conversion is a numeric.h function; the byte
// placement is the one of src/cache/kv_format.cpp (the tests compare bytes with encode_rows).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "cuda/common/paged_rows.h"
#include "dsv4/numeric.h"

namespace dsv4::cuda {

// Format constants (kv_format.h, SPEC §7).
inline constexpr int kV41Fp8Tile = 32;
inline constexpr int kV41Fp4Tile = 16;
inline constexpr int kMxfp4Tile = 32;
inline constexpr int kDsMlaNopeDims = 448;
inline constexpr int kDsMlaTile = 64;
inline constexpr int kDsMlaTiles = kDsMlaNopeDims / kDsMlaTile;
inline constexpr int kPlainTile = 32;  // bf16 / fp8_per_tensor: unscaled, any run of channels

// A row's bytes; data == nullptr when the row is not addressable.
struct RowRef {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  __device__ bool valid() const { return data != nullptr; }
};

__device__ __forceinline__ RowRef row_in_page(const DeviceRows& r, int64_t page, int64_t row) {
  if (page < 0 || page >= r.num_pages) return {};
  uint8_t* base = r.pages + page * r.page_stride;
  return {base + row * r.data_row_stride, base + r.scale_base + row * r.scale_row_stride};
}

__device__ __forceinline__ RowRef row_at_slot(const DeviceRows& r, int64_t slot) {
  if (slot < 0) return {};
  return row_in_page(r, slot / r.rows_per_page, slot % r.rows_per_page);
}

// Row `row` (a position or an entry index) of sequence `sequence`, through the block table.
__device__ __forceinline__ RowRef row_of_sequence(const DeviceRows& r, int64_t sequence, int64_t row) {
  if (sequence < 0 || sequence >= r.num_sequences || row < 0) return {};
  const int64_t first = r.first_logical_page ? r.first_logical_page[sequence] : 0;
  const int64_t block = row / r.rows_per_page - first;
  if (block < 0 || block >= r.blocks_per_sequence) return {};
  return row_in_page(r, r.block_table[sequence * r.blocks_per_sequence + block], row % r.rows_per_page);
}

__device__ __forceinline__ uint16_t load_u16_le(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
__device__ __forceinline__ float load_f32_le(const uint8_t* p) {
  return float_from_bits(uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24);
}
__device__ __forceinline__ void store_u16_le(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ __forceinline__ void store_f32_le(uint8_t* p, float f) {
  const uint32_t v = float_bits(f);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// The exact dequantized value of channel c (code x scale) of a row in format F.
template <KvRowFormat F>
__device__ __forceinline__ float decode_channel(const DeviceRows& r, const RowRef& row, int c) {
  if constexpr (F == KvRowFormat::bf16) {
    return bf16_bits_to_float(load_u16_le(row.data + 2 * c));
  } else if constexpr (F == KvRowFormat::fp8_per_tensor) {
    return e4m3_to_float(row.data[c]) * r.tensor_scale;
  } else if constexpr (F == KvRowFormat::v41_fp8) {
    return e4m3_to_float(row.data[c]) * ue8m0_to_float(row.scales[c / kV41Fp8Tile]);
  } else if constexpr (F == KvRowFormat::v41_fp4) {
    return e2m1_to_float(unpack_e2m1(row.data, c)) * e4m3_to_float(row.scales[c / kV41Fp4Tile]);
  } else if constexpr (F == KvRowFormat::fp8_ds_mla) {
    return c < kDsMlaNopeDims ? e4m3_to_float(row.data[c]) * ue8m0_to_float(row.scales[c / kDsMlaTile])
                              : bf16_bits_to_float(load_u16_le(row.data + kDsMlaNopeDims + 2 * (c - kDsMlaNopeDims)));
  } else if constexpr (F == KvRowFormat::index_mxfp4) {
    return e2m1_to_float(unpack_e2m1(row.data, c)) * ue8m0_to_float(row.scales[c / kMxfp4Tile]);
  } else {
    static_assert(F == KvRowFormat::index_fp8);
    return e4m3_to_float(row.data[c]) * load_f32_le(row.scales);
  }
}

// Channels c0 … c0 + 15 (c0 a multiple of 16) of a row in format F, as decode_channel gives them,
// read with 8-byte read-only loads so that a thread keeps several loads in flight. Needs 8-byte
// aligned row data, which every 512-channel layout has (row sizes and page strides are multiples
// of 8); the pages must not change while the kernel runs.
__device__ __forceinline__ uint2 load8(const uint8_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }

__device__ __forceinline__ void bf16x4_to_float(uint2 bits, float* out) {
  out[0] = bf16_bits_to_float(static_cast<uint16_t>(bits.x));
  out[1] = bf16_bits_to_float(static_cast<uint16_t>(bits.x >> 16));
  out[2] = bf16_bits_to_float(static_cast<uint16_t>(bits.y));
  out[3] = bf16_bits_to_float(static_cast<uint16_t>(bits.y >> 16));
}

__device__ __forceinline__ void e4m3x8_to_float(uint2 codes, float scale, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = e4m3_to_float(static_cast<uint8_t>((i < 4 ? codes.x : codes.y) >> (8 * (i % 4)))) * scale;
}

template <KvRowFormat F>
__device__ __forceinline__ void decode_chunk16(const DeviceRows& r, const RowRef& row, int c0, float (&out)[16]) {
  if constexpr (F == KvRowFormat::bf16) {
    const uint8_t* p = row.data + 2 * c0;
    const uint2 a = load8(p), b = load8(p + 8), c = load8(p + 16), d = load8(p + 24);
    bf16x4_to_float(a, out), bf16x4_to_float(b, out + 4), bf16x4_to_float(c, out + 8), bf16x4_to_float(d, out + 12);
  } else if constexpr (F == KvRowFormat::fp8_per_tensor || F == KvRowFormat::v41_fp8) {
    const uint2 a = load8(row.data + c0), b = load8(row.data + c0 + 8);
    const float scale = F == KvRowFormat::v41_fp8 ? ue8m0_to_float(row.scales[c0 / kV41Fp8Tile]) : r.tensor_scale;
    e4m3x8_to_float(a, scale, out), e4m3x8_to_float(b, scale, out + 8);
  } else if constexpr (F == KvRowFormat::v41_fp4) {
    const uint2 packed = load8(row.data + c0 / 2);
    const float scale = e4m3_to_float(row.scales[c0 / kV41Fp4Tile]);
    for (int i = 0; i < 16; ++i)
      out[i] = e2m1_to_float(static_cast<uint8_t>((i < 8 ? packed.x : packed.y) >> (4 * (i % 8)))) * scale;
  } else if constexpr (F == KvRowFormat::fp8_ds_mla) {
    if (c0 < kDsMlaNopeDims) {
      const uint2 a = load8(row.data + c0), b = load8(row.data + c0 + 8);
      const float scale = ue8m0_to_float(row.scales[c0 / kDsMlaTile]);
      e4m3x8_to_float(a, scale, out), e4m3x8_to_float(b, scale, out + 8);
    } else {
      const uint8_t* p = row.data + kDsMlaNopeDims + 2 * (c0 - kDsMlaNopeDims);
      const uint2 a = load8(p), b = load8(p + 8), c = load8(p + 16), d = load8(p + 24);
      bf16x4_to_float(a, out), bf16x4_to_float(b, out + 4), bf16x4_to_float(c, out + 8), bf16x4_to_float(d, out + 12);
    }
  } else {
    for (int i = 0; i < 16; ++i) out[i] = decode_channel<F>(r, row, c0 + i);
  }
}

// Calls f(std::integral_constant<KvRowFormat, format>{}) so that loops inside f decode with a
// compile-time format.
template <class F>
__device__ __forceinline__ void visit_format(KvRowFormat format, F&& f) {
  switch (format) {
    case KvRowFormat::bf16: f(std::integral_constant<KvRowFormat, KvRowFormat::bf16>{}); return;
    case KvRowFormat::fp8_per_tensor: f(std::integral_constant<KvRowFormat, KvRowFormat::fp8_per_tensor>{}); return;
    case KvRowFormat::v41_fp8: f(std::integral_constant<KvRowFormat, KvRowFormat::v41_fp8>{}); return;
    case KvRowFormat::v41_fp4: f(std::integral_constant<KvRowFormat, KvRowFormat::v41_fp4>{}); return;
    case KvRowFormat::fp8_ds_mla: f(std::integral_constant<KvRowFormat, KvRowFormat::fp8_ds_mla>{}); return;
    case KvRowFormat::index_mxfp4: f(std::integral_constant<KvRowFormat, KvRowFormat::index_mxfp4>{}); return;
    case KvRowFormat::index_fp8: f(std::integral_constant<KvRowFormat, KvRowFormat::index_fp8>{}); return;
  }
}

// Tiles a row of the format is encoded in; encode_tile(t) for every t < count writes the whole
// row (fp8_ds_mla: 7 e4m3 tiles, then one tile for the bf16 RoPE channels and the padding byte).
__host__ __device__ constexpr int encode_tile_count(KvRowFormat format, int dims) {
  switch (format) {
    case KvRowFormat::v41_fp8: return dims / kV41Fp8Tile;
    case KvRowFormat::v41_fp4: return dims / kV41Fp4Tile;
    case KvRowFormat::fp8_ds_mla: return kDsMlaTiles + 1;
    case KvRowFormat::index_mxfp4: return dims / kMxfp4Tile;
    case KvRowFormat::index_fp8: return 1;
    case KvRowFormat::bf16:
    case KvRowFormat::fp8_per_tensor: return (dims + kPlainTile - 1) / kPlainTile;
  }
  return 0;
}

// e4m3 codes of one tile with a ue8m0 scale; returns the scale byte.
__device__ __forceinline__ uint8_t encode_fp8_tile(const float* x, int n, uint8_t* codes, Fp8ScaleFloor floor) {
  const uint8_t scale_byte = fp8_ue8m0_scale_byte(abs_max(x, n), floor);
  const float scale = ue8m0_to_float(scale_byte);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e4m3(divide_rn(x[i], scale));
  return scale_byte;
}

// e2m1 codes of one tile (n even), two per byte, even channel in the low nibble.
__device__ __forceinline__ void encode_fp4_tile(const float* x, int n, float scale, uint8_t* packed) {
  for (int i = 0; i < n; i += 2)
    packed[i / 2] = pack_e2m1x2(float_to_e2m1(divide_rn(x[i], scale)), float_to_e2m1(divide_rn(x[i + 1], scale)));
}

// Encodes tile t of the row x [dims] (any memory the thread can read) into `row`.
__device__ inline void encode_tile(const DeviceRows& r, const RowRef& row, const float* x, int t) {
  switch (r.format) {
    case KvRowFormat::bf16:
    case KvRowFormat::fp8_per_tensor: {
      const int end = min(r.dims, (t + 1) * kPlainTile);
      for (int c = t * kPlainTile; c < end; ++c) {
        if (r.format == KvRowFormat::bf16) store_u16_le(row.data + 2 * c, float_to_bf16_bits(x[c]));
        else row.data[c] = float_to_e4m3(divide_rn(x[c], r.tensor_scale));
      }
      return;
    }
    case KvRowFormat::v41_fp8:
      row.scales[t] = encode_fp8_tile(x + t * kV41Fp8Tile, kV41Fp8Tile, row.data + t * kV41Fp8Tile, r.fp8_scale_floor);
      return;
    case KvRowFormat::v41_fp4: {
      const float* tile = x + t * kV41Fp4Tile;
      row.scales[t] = fp4_e4m3_scale_code(abs_max(tile, kV41Fp4Tile));
      encode_fp4_tile(tile, kV41Fp4Tile, e4m3_to_float(row.scales[t]), row.data + t * kV41Fp4Tile / 2);
      return;
    }
    case KvRowFormat::fp8_ds_mla:
      if (t < kDsMlaTiles) {
        row.scales[t] = encode_fp8_tile(x + t * kDsMlaTile, kDsMlaTile, row.data + t * kDsMlaTile, r.fp8_scale_floor);
      } else {
        for (int c = kDsMlaNopeDims; c < r.dims; ++c)
          store_u16_le(row.data + kDsMlaNopeDims + 2 * (c - kDsMlaNopeDims), float_to_bf16_bits(x[c]));
        row.scales[kDsMlaTiles] = 0;
      }
      return;
    case KvRowFormat::index_mxfp4: {
      const float* tile = x + t * kMxfp4Tile;
      row.scales[t] = fp4_ue8m0_scale_byte(abs_max(tile, kMxfp4Tile));
      encode_fp4_tile(tile, kMxfp4Tile, ue8m0_to_float(row.scales[t]), row.data + t * kMxfp4Tile / 2);
      return;
    }
    case KvRowFormat::index_fp8:
      store_f32_le(row.scales, ue8m0_to_float(encode_fp8_tile(x, r.dims, row.data, r.fp8_scale_floor)));
      return;
  }
}

}  // namespace dsv4::cuda

// Device side of paged-cache access: row lookup by slot or by (sequence, row), and the decode and
// encode of rows through the row codec (cache/row_codec.h), the one kv_format.cpp uses too (the
// tests compare device bytes with encode_rows).
#pragma once

#include <cuda_runtime.h>

#include "cache/row_codec.h"
#include "cuda/common/paged_rows.h"

namespace dsv4::cuda {

using row_codec::encode_tile_count;
using row_codec::visit_format;

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

// n / d and n % d for n >= 0, d >= 1; in 32 bits when both fit (a 64-bit division is a long
// subroutine, and row lookups sit in the kernels' key loops).
struct RowSplit {
  int64_t block, row;
};
__device__ __forceinline__ RowSplit split_rows(int64_t n, int64_t d) {
  if (((n | d) >> 31) == 0) {
    const uint32_t q = static_cast<uint32_t>(n) / static_cast<uint32_t>(d);
    return {q, static_cast<uint32_t>(n) - q * static_cast<uint32_t>(d)};
  }
  return {n / d, n % d};
}

__device__ __forceinline__ RowRef row_at_slot(const DeviceRows& r, int64_t slot) {
  if (slot < 0) return {};
  const RowSplit s = split_rows(slot, r.rows_per_page);
  return row_in_page(r, s.block, s.row);
}

// The rows of one sequence, by (logical page, row in page): a kernel that walks a sequence's rows
// in order looks the sequence up once and splits each row itself. A cache without a block table
// is flat (FlashMLA's addressing): the split row is the slot, whatever the sequence.
struct SequenceRows {
  const DeviceRows& r;
  const int32_t* table = nullptr;  // the sequence's block table row
  uint64_t blocks = 0;             // its entries; 0: no such sequence
  int64_t first = 0;               // its first logical page
  __device__ SequenceRows(const DeviceRows& rows, int64_t sequence) : r(rows) {
    if (r.block_table == nullptr || sequence < 0 || sequence >= r.num_sequences) return;
    table = r.block_table + sequence * r.blocks_per_sequence;
    blocks = static_cast<uint64_t>(r.blocks_per_sequence);
    first = r.first_logical_page ? r.first_logical_page[sequence] : 0;
  }
  // The block-table entry of split s's block (-1: none; 0 for a flat cache, which has no table),
  // which a kernel may read a step before it needs the row; the pool page it names; the row.
  // (One unsigned compare checks both ends of the table.)
  __device__ int32_t entry(RowSplit s) const {
    if (r.block_table == nullptr) return 0;
    const uint64_t block = static_cast<uint64_t>(s.block - first);
    return block < blocks ? table[block] : -1;
  }
  __device__ int64_t page(RowSplit s, int32_t entry) const { return r.block_table == nullptr ? s.block : entry; }
  __device__ RowRef at(RowSplit s) const { return row_in_page(r, page(s, entry(s)), s.row); }
};

// A thread's walk over rows `step` apart (the index scans copy a stage's rows in order): split
// once, then each step adds the step's whole pages and leftover rows, with no division or loop.
// Needs rows_per_page <= INT32_MAX.
struct RowWalk {
  RowSplit at;
  int step_pages, step_rows, rows_per_page;
  __device__ RowWalk(int64_t first, int step, int64_t pages_rows)
      : at(split_rows(first, pages_rows)),
        step_pages(step / static_cast<int>(pages_rows)),
        step_rows(step % static_cast<int>(pages_rows)),
        rows_per_page(static_cast<int>(pages_rows)) {}
  __device__ void advance() {
    int row = static_cast<int>(at.row) + step_rows;
    at.block += step_pages;
    if (row >= rows_per_page) row -= rows_per_page, ++at.block;
    at.row = row;
  }
};

// Row `row` (a position or an entry index) of sequence `sequence`, through the block table (flat
// caches: SequenceRows).
__device__ __forceinline__ RowRef row_of_sequence(const DeviceRows& r, int64_t sequence, int64_t row) {
  if (row < 0) return {};
  return SequenceRows(r, sequence).at(split_rows(row, r.rows_per_page));
}

// The exact dequantized value of channel c (code x scale) of a row in format F. f32 channels are
// one 4-byte load: f32 rows are 4-byte aligned (rows of 4·dims bytes, no scales, no page padding).
template <KvRowFormat F>
__device__ __forceinline__ float decode_channel(const DeviceRows& r, const RowRef& row, int c) {
  if constexpr (F == KvRowFormat::f32) return reinterpret_cast<const float*>(row.data)[c];
  else return row_codec::decode_channel<F>(row.data, row.scales, c, r.tensor_scale);
}

// Channels c0 … c0 + 15 (c0 a multiple of 16) of a row in format F, as decode_channel gives them,
// read with 8-byte read-only loads (f32 rows: 4-byte ones) so that a thread keeps several loads in
// flight. Needs 8-byte aligned row data, which every 512-channel layout has (row sizes and page
// strides are multiples of 8); the pages must not change while the kernel runs.
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
  // The 16 channels share their code and scale: every tile is a multiple of 16 channels, and so is
  // fp8_ds_mla's NoPE part. Index-key rows (any width, so not always 8-byte aligned) are decoded
  // channel by channel.
  constexpr bool vector_loads = F == KvRowFormat::bf16 || F == KvRowFormat::fp8_per_tensor ||
                                F == KvRowFormat::v41_fp8 || F == KvRowFormat::v41_fp4 || F == KvRowFormat::fp8_ds_mla;
  if constexpr (F == KvRowFormat::f32) {
    const float* p = reinterpret_cast<const float*>(row.data) + c0;
    for (int i = 0; i < 16; ++i) out[i] = __ldg(p + i);
  } else if constexpr (vector_loads) {
    const uint8_t* p = row.data + row_codec::channel_offset<F>(c0);
    switch (row_codec::channel_code<F>(c0)) {
      case row_codec::ChannelCode::bf16: {
        const uint2 a = load8(p), b = load8(p + 8), c = load8(p + 16), d = load8(p + 24);
        bf16x4_to_float(a, out), bf16x4_to_float(b, out + 4), bf16x4_to_float(c, out + 8), bf16x4_to_float(d, out + 12);
        return;
      }
      case row_codec::ChannelCode::e4m3: {
        const uint2 a = load8(p), b = load8(p + 8);
        const float scale = row_codec::channel_scale<F>(row.scales, c0, r.tensor_scale);
        e4m3x8_to_float(a, scale, out), e4m3x8_to_float(b, scale, out + 8);
        return;
      }
      case row_codec::ChannelCode::e2m1: {
        const uint2 packed = load8(p);
        const float scale = row_codec::channel_scale<F>(row.scales, c0, r.tensor_scale);
        for (int i = 0; i < 16; ++i)
          out[i] = e2m1_to_float(static_cast<uint8_t>((i < 8 ? packed.x : packed.y) >> (4 * (i % 8)))) * scale;
        return;
      }
      case row_codec::ChannelCode::f32: return;  // the branch above
    }
  } else {
    for (int i = 0; i < 16; ++i) out[i] = decode_channel<F>(r, row, c0 + i);
  }
}

// decode_chunk16 of an addressable row, zeros for one that is not (a tile's rows past the end).
template <KvRowFormat F>
__device__ __forceinline__ void decode_chunk16_or_zeros(const DeviceRows& r, const RowRef& row, int c0, float (&out)[16]) {
  if (row.valid()) {
    decode_chunk16<F>(r, row, c0, out);
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = 0.0f;
  }
}

// Encodes tile t (< encode_tile_count) of the row x [dims] (any memory the thread can read) into
// `row`.
__device__ inline void encode_tile(const DeviceRows& r, const RowRef& row, const float* x, int t) {
  row_codec::encode_tile(r.format, r.dims, x, t, row.data, row.scales, r.tensor_scale, r.fp8_scale_floor);
}

}  // namespace dsv4::cuda

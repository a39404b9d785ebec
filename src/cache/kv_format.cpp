// KV-cache row formats: layouts, page geometry and the row encoders / decoders. Every conversion
// goes through dsv4/numeric.h, the one implementation of each number format.
#include "dsv4/kv_format.h"

#include <cmath>

#include "dsv4/error.h"

namespace dsv4 {
namespace {

constexpr int64_t kHeadDim = 512;         // v41_fp8 / v41_fp4 / fp8_ds_mla rows are whole heads
constexpr int64_t kMaxDims = 1 << 20;
constexpr int64_t kMaxRowsPerPage = 1 << 20;

constexpr int kV41Fp8Tile = 32;           // e4m3 values per ue8m0 scale
constexpr int kV41Fp4Tile = 16;           // e2m1 values per e4m3 scale
constexpr int kMxfp4Tile = 32;            // e2m1 values per ue8m0 scale
constexpr int kDsMlaNopeDims = 448;       // fp8_ds_mla: e4m3 NoPE channels, then bf16 RoPE channels
constexpr int kDsMlaTile = 64;
constexpr int kDsMlaTiles = kDsMlaNopeDims / kDsMlaTile;  // 7 scale bytes, then 1 padding byte

struct FormatInfo {
  KvRowFormat format;
  const char* name;
};
constexpr FormatInfo kFormats[] = {
    {KvRowFormat::bf16, "bf16"},
    {KvRowFormat::fp8_per_tensor, "fp8_per_tensor"},
    {KvRowFormat::v41_fp8, "v41_fp8"},
    {KvRowFormat::v41_fp4, "v41_fp4"},
    {KvRowFormat::fp8_ds_mla, "fp8_ds_mla"},
    {KvRowFormat::index_mxfp4, "index_mxfp4"},
    {KvRowFormat::index_fp8, "index_fp8"},
};

const KvFormatSet kFormatSets[] = {
    {"v4.1-native", KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::index_mxfp4},
    {"fp8_ds_mla", KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, KvRowFormat::index_fp8},
    {"bf16", KvRowFormat::bf16, KvRowFormat::bf16, KvRowFormat::bf16},
    {"fp8", KvRowFormat::fp8_per_tensor, KvRowFormat::fp8_per_tensor, KvRowFormat::index_fp8},
};

template <class Table, class Name>
std::string joined_names(const Table& table, Name name) {
  std::string out;
  for (const auto& entry : table) out += (out.empty() ? "" : ", ") + std::string(name(entry));
  return out;
}

void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
void store_f32(uint8_t* p, float f) {
  const uint32_t v = float_bits(f);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
float load_f32(const uint8_t* p) {
  return float_from_bits(uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24);
}

// One tile of e4m3 codes with a ue8m0 scale; returns the scale byte.
uint8_t encode_fp8_tile(const float* x, int n, uint8_t* codes, Fp8ScaleFloor floor) {
  const uint8_t scale_byte = fp8_ue8m0_scale_byte(abs_max(x, n), floor);
  const float scale = ue8m0_to_float(scale_byte);
  for (int i = 0; i < n; ++i) codes[i] = float_to_e4m3(divide_rn(x[i], scale));
  return scale_byte;
}
void decode_fp8_tile(const uint8_t* codes, int n, float scale, float* out) {
  for (int i = 0; i < n; ++i) out[i] = e4m3_to_float(codes[i]) * scale;
}

// One tile of e2m1 codes, two per byte (even channel low); n is even.
void encode_fp4_tile(const float* x, int n, float scale, uint8_t* packed) {
  for (int i = 0; i < n; i += 2)
    packed[i / 2] = pack_e2m1x2(float_to_e2m1(divide_rn(x[i], scale)), float_to_e2m1(divide_rn(x[i + 1], scale)));
}
void decode_fp4_tile(const uint8_t* packed, int n, float scale, float* out) {
  for (int i = 0; i < n; ++i) out[i] = e2m1_to_float(unpack_e2m1(packed, i)) * scale;
}

void encode_row(KvRowFormat format, int dims, const float* x, uint8_t* data, uint8_t* scales,
                float tensor_scale, const EncodeOptions& options) {
  switch (format) {
    case KvRowFormat::bf16:
      for (int i = 0; i < dims; ++i) store_u16(data + 2 * i, float_to_bf16_bits(x[i]));
      return;
    case KvRowFormat::fp8_per_tensor:
      for (int i = 0; i < dims; ++i) data[i] = float_to_e4m3(divide_rn(x[i], tensor_scale));
      return;
    case KvRowFormat::v41_fp8:
      for (int t = 0; t < dims / kV41Fp8Tile; ++t)
        scales[t] = encode_fp8_tile(x + t * kV41Fp8Tile, kV41Fp8Tile, data + t * kV41Fp8Tile, options.fp8_scale_floor);
      return;
    case KvRowFormat::v41_fp4:
      for (int t = 0; t < dims / kV41Fp4Tile; ++t) {
        const float* tile = x + t * kV41Fp4Tile;
        scales[t] = fp4_e4m3_scale_code(abs_max(tile, kV41Fp4Tile));
        encode_fp4_tile(tile, kV41Fp4Tile, e4m3_to_float(scales[t]), data + t * kV41Fp4Tile / 2);
      }
      return;
    case KvRowFormat::fp8_ds_mla:
      for (int t = 0; t < kDsMlaTiles; ++t)
        scales[t] = encode_fp8_tile(x + t * kDsMlaTile, kDsMlaTile, data + t * kDsMlaTile, options.fp8_scale_floor);
      scales[kDsMlaTiles] = 0;
      for (int i = kDsMlaNopeDims; i < dims; ++i) store_u16(data + kDsMlaNopeDims + 2 * (i - kDsMlaNopeDims), float_to_bf16_bits(x[i]));
      return;
    case KvRowFormat::index_mxfp4:
      for (int t = 0; t < dims / kMxfp4Tile; ++t) {
        const float* tile = x + t * kMxfp4Tile;
        scales[t] = fp4_ue8m0_scale_byte(abs_max(tile, kMxfp4Tile));
        encode_fp4_tile(tile, kMxfp4Tile, ue8m0_to_float(scales[t]), data + t * kMxfp4Tile / 2);
      }
      return;
    case KvRowFormat::index_fp8:
      // One scale over the whole row, stored as the fp32 value of the power of two.
      store_f32(scales, ue8m0_to_float(encode_fp8_tile(x, dims, data, options.fp8_scale_floor)));
      return;
  }
}

void decode_row(KvRowFormat format, int dims, const uint8_t* data, const uint8_t* scales,
                float tensor_scale, float* out) {
  switch (format) {
    case KvRowFormat::bf16:
      for (int i = 0; i < dims; ++i) out[i] = bf16_bits_to_float(load_u16(data + 2 * i));
      return;
    case KvRowFormat::fp8_per_tensor:
      decode_fp8_tile(data, dims, tensor_scale, out);
      return;
    case KvRowFormat::v41_fp8:
      for (int t = 0; t < dims / kV41Fp8Tile; ++t)
        decode_fp8_tile(data + t * kV41Fp8Tile, kV41Fp8Tile, ue8m0_to_float(scales[t]), out + t * kV41Fp8Tile);
      return;
    case KvRowFormat::v41_fp4:
      for (int t = 0; t < dims / kV41Fp4Tile; ++t)
        decode_fp4_tile(data + t * kV41Fp4Tile / 2, kV41Fp4Tile, e4m3_to_float(scales[t]), out + t * kV41Fp4Tile);
      return;
    case KvRowFormat::fp8_ds_mla:
      for (int t = 0; t < kDsMlaTiles; ++t)
        decode_fp8_tile(data + t * kDsMlaTile, kDsMlaTile, ue8m0_to_float(scales[t]), out + t * kDsMlaTile);
      for (int i = kDsMlaNopeDims; i < dims; ++i) out[i] = bf16_bits_to_float(load_u16(data + kDsMlaNopeDims + 2 * (i - kDsMlaNopeDims)));
      return;
    case KvRowFormat::index_mxfp4:
      for (int t = 0; t < dims / kMxfp4Tile; ++t)
        decode_fp4_tile(data + t * kMxfp4Tile / 2, kMxfp4Tile, ue8m0_to_float(scales[t]), out + t * kMxfp4Tile);
      return;
    case KvRowFormat::index_fp8:
      decode_fp8_tile(data, dims, load_f32(scales), out);
      return;
  }
}

// Checks everything encode_rows / decode_rows need before a byte is touched. `page_count` < 0:
// the buffer size is unknown (raw-pointer overloads).
void check_rows_call(const char* operation, const PageGeometry& g, const void* rows, const int64_t* slots,
                     int64_t n, const void* pages, int64_t page_count, float tensor_scale) {
  const PageGeometry expected = page_geometry(g.format, g.row.dims, g.rows_per_page, g.placement);
  DSV4_CHECK(g.row.data_bytes == expected.row.data_bytes && g.row.scale_bytes == expected.row.scale_bytes &&
                 g.row.alignment == expected.row.alignment && g.page_stride == expected.page_stride,
             "kv_format: ", operation, ": the geometry of ", kv_row_format_name(g.format), " with dims ",
             g.row.dims, " and ", g.rows_per_page, " rows per page has page stride ", g.page_stride,
             ", expected ", expected.page_stride, " (build it with page_geometry())");
  DSV4_CHECK(n >= 0, "kv_format: ", operation, ": row count ", n, ", expected >= 0");
  if (n == 0) return;
  DSV4_CHECK(rows != nullptr && slots != nullptr, "kv_format: ", operation, ": null rows or slots pointer for ", n, " rows");
  DSV4_CHECK(g.format != KvRowFormat::fp8_per_tensor || (std::isfinite(tensor_scale) && tensor_scale > 0.0f),
             "kv_format: ", operation, ": fp8_per_tensor tensor_scale is ", tensor_scale, ", expected finite and > 0");
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    DSV4_CHECK(pages != nullptr, "kv_format: ", operation, ": null pages pointer for slot ", slots[i], " of row ", i);
    DSV4_CHECK(page_count < 0 || slots[i] < page_count * g.rows_per_page, "kv_format: ", operation, ": slot ",
               slots[i], " of row ", i, " is outside the buffer of ", page_count, " pages x ", g.rows_per_page,
               " rows (page stride ", g.page_stride, " bytes)");
  }
}

int64_t pages_in(size_t bytes, const PageGeometry& g) {
  return g.page_stride > 0 ? static_cast<int64_t>(bytes) / g.page_stride : 0;
}

void encode_checked_rows(const PageGeometry& g, const float* x, int64_t n, const int64_t* slots, std::byte* pages,
                         int64_t page_count, float tensor_scale, const EncodeOptions& options) {
  check_rows_call("encode_rows", g, x, slots, n, pages, page_count, tensor_scale);
  const int dims = static_cast<int>(g.row.dims);
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    uint8_t* page = reinterpret_cast<uint8_t*>(pages) + (slots[i] / g.rows_per_page) * g.page_stride;
    const int64_t row = slots[i] % g.rows_per_page;
    encode_row(g.format, dims, x + i * g.row.dims, page + g.data_offset(row), page + g.scale_offset(row),
               tensor_scale, options);
  }
}

void decode_checked_rows(const PageGeometry& g, const std::byte* pages, int64_t page_count, const int64_t* slots,
                         int64_t n, float* out, float tensor_scale) {
  check_rows_call("decode_rows", g, out, slots, n, pages, page_count, tensor_scale);
  const int dims = static_cast<int>(g.row.dims);
  // Rows are independent and nothing below throws.
#pragma omp parallel for schedule(static) if (n >= 64)
  for (int64_t i = 0; i < n; ++i) {
    float* row_out = out + i * g.row.dims;
    if (slots[i] < 0) {
      for (int c = 0; c < dims; ++c) row_out[c] = 0.0f;
      continue;
    }
    const uint8_t* page = reinterpret_cast<const uint8_t*>(pages) + (slots[i] / g.rows_per_page) * g.page_stride;
    const int64_t row = slots[i] % g.rows_per_page;
    decode_row(g.format, dims, page + g.data_offset(row), page + g.scale_offset(row), tensor_scale, row_out);
  }
}

}  // namespace

const char* kv_row_format_name(KvRowFormat f) {
  for (const auto& info : kFormats)
    if (info.format == f) return info.name;
  return "unknown";
}

KvRowFormat parse_kv_row_format(const std::string& name) {
  for (const auto& info : kFormats)
    if (name == info.name) return info.format;
  fail("kv_format: unknown row format '", name, "', expected one of ",
       joined_names(kFormats, [](const FormatInfo& i) { return i.name; }));
}

RowLayout row_layout(KvRowFormat f, int64_t dims) {
  const char* name = kv_row_format_name(f);
  DSV4_CHECK(std::string(name) != "unknown", "kv_format: row_layout: unknown row format value ", static_cast<int>(f));
  const bool whole_head = f == KvRowFormat::v41_fp8 || f == KvRowFormat::v41_fp4 || f == KvRowFormat::fp8_ds_mla;
  if (whole_head) {
    DSV4_CHECK(dims == kHeadDim, "kv_format: ", name, " rows have ", kHeadDim, " channels, got dims ", dims);
  } else {
    DSV4_CHECK(dims >= 1 && dims <= kMaxDims, "kv_format: ", name, " rows: dims is ", dims, ", expected 1 ... ", kMaxDims);
  }
  RowLayout layout;
  layout.dims = dims;
  switch (f) {
    case KvRowFormat::bf16:
      layout.data_bytes = 2 * dims;
      break;
    case KvRowFormat::fp8_per_tensor:
      layout.data_bytes = dims;
      break;
    case KvRowFormat::v41_fp8:
      layout.data_bytes = dims;
      layout.scale_bytes = dims / kV41Fp8Tile;
      layout.alignment = 512;
      break;
    case KvRowFormat::v41_fp4:
      layout.data_bytes = dims / 2;
      layout.scale_bytes = dims / kV41Fp4Tile;
      layout.alignment = 256;
      break;
    case KvRowFormat::fp8_ds_mla:
      layout.data_bytes = kDsMlaNopeDims + 2 * (dims - kDsMlaNopeDims);
      layout.scale_bytes = kDsMlaTiles + 1;
      layout.alignment = 576;
      break;
    case KvRowFormat::index_mxfp4:
      DSV4_CHECK(dims % kMxfp4Tile == 0, "kv_format: index_mxfp4 rows: dims is ", dims,
                 ", expected a multiple of ", kMxfp4Tile);
      layout.data_bytes = dims / 2;
      layout.scale_bytes = dims / kMxfp4Tile;
      layout.alignment = 512;
      break;
    case KvRowFormat::index_fp8:
      layout.data_bytes = dims;
      layout.scale_bytes = 4;
      layout.alignment = 576;  // vLLM's allocator pairs this cache with fp8_ds_mla pages
      break;
  }
  return layout;
}

int64_t PageGeometry::data_offset(int64_t row_in_page) const {
  return row_in_page * (placement == PagePlacement::interleaved ? row.row_bytes() : row.data_bytes);
}

int64_t PageGeometry::scale_offset(int64_t row_in_page) const {
  if (placement == PagePlacement::interleaved) return row_in_page * row.row_bytes() + row.data_bytes;
  return rows_per_page * row.data_bytes + row_in_page * row.scale_bytes;
}

PageGeometry page_geometry(KvRowFormat f, int64_t dims, int64_t rows_per_page, PagePlacement placement) {
  DSV4_CHECK(rows_per_page >= 1 && rows_per_page <= kMaxRowsPerPage, "kv_format: page_geometry: rows_per_page is ",
             rows_per_page, ", expected 1 ... ", kMaxRowsPerPage);
  DSV4_CHECK(placement == PagePlacement::segregated || placement == PagePlacement::interleaved,
             "kv_format: page_geometry: unknown placement value ", static_cast<int>(placement));
  PageGeometry g;
  g.format = f;
  g.placement = placement;
  g.row = row_layout(f, dims);
  g.rows_per_page = rows_per_page;
  const int64_t content = rows_per_page * g.row.row_bytes();
  const int64_t alignment = placement == PagePlacement::segregated ? g.row.alignment : 1;
  g.page_stride = (content + alignment - 1) / alignment * alignment;
  return g;
}

int64_t default_rows_per_page(KvRowFormat f) { return f == KvRowFormat::v41_fp8 ? 32 : 64; }

void encode_rows(const PageGeometry& g, const float* x, int64_t n, const int64_t* slots, std::byte* pages,
                 float tensor_scale, const EncodeOptions& options) {
  encode_checked_rows(g, x, n, slots, pages, -1, tensor_scale, options);
}

void encode_rows(const PageGeometry& g, const float* x, int64_t n, const int64_t* slots, std::span<std::byte> pages,
                 float tensor_scale, const EncodeOptions& options) {
  encode_checked_rows(g, x, n, slots, pages.data(), pages_in(pages.size(), g), tensor_scale, options);
}

void decode_rows(const PageGeometry& g, const std::byte* pages, const int64_t* slots, int64_t n, float* out,
                 float tensor_scale) {
  decode_checked_rows(g, pages, -1, slots, n, out, tensor_scale);
}

void decode_rows(const PageGeometry& g, std::span<const std::byte> pages, const int64_t* slots, int64_t n,
                 float* out, float tensor_scale) {
  decode_checked_rows(g, pages.data(), pages_in(pages.size(), g), slots, n, out, tensor_scale);
}

KvFormatSet kv_format_set(const std::string& name) {
  for (const auto& set : kFormatSets)
    if (set.name == name) return set;
  fail("kv_format: unknown KV format set '", name, "', expected one of ",
       joined_names(kFormatSets, [](const KvFormatSet& s) { return s.name; }));
}

std::vector<std::string> kv_format_set_names() {
  std::vector<std::string> names;
  for (const auto& set : kFormatSets) names.push_back(set.name);
  return names;
}

}  // namespace dsv4

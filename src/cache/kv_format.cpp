// KV-cache row formats: layouts, page geometry and the checked row encoders / decoders. The bytes
// of each format are row_codec.h's, the one codec the CUDA kernels use too.
#include "dsv4/kv_format.h"

#include <cmath>

#include "cache/row_codec.h"
#include "dsv4/error.h"

namespace dsv4 {
namespace {

constexpr int64_t kMaxDims = 1 << 20;
constexpr int64_t kMaxRowsPerPage = 1 << 20;

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
    {KvRowFormat::f32, "f32"},
};

const KvFormatSet kFormatSets[] = {
    {"v4.1-native", KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::index_mxfp4},
    {"fp8_ds_mla", KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, KvRowFormat::index_fp8},
    {"bf16", KvRowFormat::bf16, KvRowFormat::bf16, KvRowFormat::bf16},
    {"fp8", KvRowFormat::fp8_per_tensor, KvRowFormat::fp8_per_tensor, KvRowFormat::index_fp8},
    {"f32", KvRowFormat::f32, KvRowFormat::f32, KvRowFormat::f32},
};

template <class Table, class Name>
std::string joined_names(const Table& table, Name name) {
  std::string out;
  for (const auto& entry : table) out += (out.empty() ? "" : ", ") + std::string(name(entry));
  return out;
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
    row_codec::encode_row(g.format, dims, x + i * g.row.dims, page + g.data_offset(row), page + g.scale_offset(row),
                          tensor_scale, options.fp8_scale_floor);
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
    row_codec::decode_row(g.format, dims, page + g.data_offset(row), page + g.scale_offset(row), tensor_scale, row_out);
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
    DSV4_CHECK(dims == row_codec::kHeadDim, "kv_format: ", name, " rows have ", row_codec::kHeadDim,
               " channels, got dims ", dims);
  } else {
    DSV4_CHECK(dims >= 1 && dims <= kMaxDims, "kv_format: ", name, " rows: dims is ", dims, ", expected 1 ... ", kMaxDims);
  }
  DSV4_CHECK(f != KvRowFormat::index_mxfp4 || dims % row_codec::kMxfp4Tile == 0,
             "kv_format: index_mxfp4 rows: dims is ", dims, ", expected a multiple of ", row_codec::kMxfp4Tile);
  RowLayout layout;
  layout.dims = dims;
  layout.data_bytes = row_codec::data_bytes(f, dims);
  layout.scale_bytes = row_codec::scale_bytes(f, dims);
  // Page alignment is vLLM's allocation of each cache (none for the unscaled formats); index_fp8
  // pages are paired with fp8_ds_mla pages.
  switch (f) {
    case KvRowFormat::bf16:
    case KvRowFormat::fp8_per_tensor:
    case KvRowFormat::f32: layout.alignment = 1; break;
    case KvRowFormat::v41_fp8:
    case KvRowFormat::index_mxfp4: layout.alignment = 512; break;
    case KvRowFormat::v41_fp4: layout.alignment = 256; break;
    case KvRowFormat::fp8_ds_mla:
    case KvRowFormat::index_fp8: layout.alignment = 576; break;
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

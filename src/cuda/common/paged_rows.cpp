#include "cuda/common/paged_rows.h"

#include <cmath>

namespace dsv4::cuda {

DeviceRows device_rows(const PagedCache& cache) {
  const PageGeometry& g = cache.geometry;
  DeviceRows r;
  r.pages = cache.pages.ptr<uint8_t>();
  r.num_pages = cache.pages.rank == 2 ? cache.pages.shape[0] : 0;
  r.page_stride = g.page_stride;
  r.rows_per_page = g.rows_per_page;
  r.data_row_stride = g.data_offset(1) - g.data_offset(0);
  r.scale_base = g.scale_offset(0);
  r.scale_row_stride = g.scale_offset(1) - g.scale_offset(0);
  r.format = g.format;
  r.dims = static_cast<int>(g.row.dims);
  r.tensor_scale = cache.tensor_scale;
  r.fp8_scale_floor = cache.fp8_scale_floor;
  if (is_present(cache.block_table)) {
    r.block_table = cache.block_table.ptr<const int32_t>();
    r.num_sequences = cache.block_table.shape[0];
    r.blocks_per_sequence = cache.block_table.shape[1];
  }
  if (is_present(cache.first_logical_page)) r.first_logical_page = cache.first_logical_page.ptr<const int32_t>();
  return r;
}

std::vector<TensorSpec> paged_cache_specs(const std::string& name, const PagedCache& cache, bool reader,
                                          int64_t num_sequences) {
  std::vector<TensorSpec> specs = {{name + ".pages", &cache.pages, {kAnyDim, cache.geometry.page_stride}, {DType::u8}}};
  if (reader) {
    specs.push_back({name + ".block_table", &cache.block_table, {num_sequences, kAnyDim}, {DType::i32}, true});
    specs.push_back({name + ".first_logical_page", &cache.first_logical_page,
                     {num_sequences == kAnyDim ? cache.block_table.shape[0] : num_sequences}, {DType::i32}, true});
  }
  return specs;
}

void check_paged_cache(const char* op, const std::string& name, const PagedCache& cache, int64_t dims,
                       const std::vector<KvRowFormat>& formats) {
  const PageGeometry& g = cache.geometry;
  bool accepted = false;
  std::string names;
  for (KvRowFormat f : formats) {
    accepted = accepted || f == g.format;
    names += (names.empty() ? "" : ", ") + std::string(kv_row_format_name(f));
  }
  DSV4_CHECK(accepted, op, ": cache '", name, "' has format ", kv_row_format_name(g.format), ", expected one of ", names);
  DSV4_CHECK(g.row.dims == dims, op, ": cache '", name, "' holds rows of ", g.row.dims, " channels, expected ", dims);
  PageGeometry expected;
  try {
    expected = page_geometry(g.format, g.row.dims, g.rows_per_page, g.placement);
  } catch (const Error& e) {
    fail(op, ": cache '", name, "' has an invalid geometry: ", e.what());
  }
  DSV4_CHECK(g.row.data_bytes == expected.row.data_bytes && g.row.scale_bytes == expected.row.scale_bytes &&
                 g.page_stride == expected.page_stride,
             op, ": cache '", name, "' has page stride ", g.page_stride, " with ", g.row.data_bytes, "+",
             g.row.scale_bytes, " bytes per row, expected ", expected.page_stride, " with ", expected.row.data_bytes,
             "+", expected.row.scale_bytes, " (build the geometry with page_geometry())");
  DSV4_CHECK(g.format != KvRowFormat::fp8_per_tensor || (std::isfinite(cache.tensor_scale) && cache.tensor_scale > 0.0f),
             op, ": cache '", name, "' has fp8_per_tensor scale ", cache.tensor_scale, ", expected finite and > 0");
  // The kernels read f32 channels as 4-byte words (paged_rows.cuh); rows and page strides
  // are multiples of 4 bytes, so the pages' start decides.
  DSV4_CHECK(g.format != KvRowFormat::f32 || reinterpret_cast<uintptr_t>(cache.pages.data) % 4 == 0, op, ": cache '",
             name, "' has f32 pages that are not 4-byte aligned");
}

}  // namespace dsv4::cuda

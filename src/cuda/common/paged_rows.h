// Host side of paged-cache access: the plain description kernels receive (DeviceRows) and the
// validation of a PagedCache argument.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/common/check_args.h"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

// Everything a kernel needs to find and convert rows of one cache; built from a validated
// PagedCache. Offsets come from PageGeometry::data_offset / scale_offset (affine in the row).
struct DeviceRows {
  uint8_t* pages = nullptr;
  int64_t num_pages = 0;
  int64_t page_stride = 0;
  int64_t rows_per_page = 1;
  int64_t data_row_stride = 0;   // data_offset(r) = r * data_row_stride
  int64_t scale_base = 0;        // scale_offset(r) = scale_base + r * scale_row_stride
  int64_t scale_row_stride = 0;
  KvRowFormat format = KvRowFormat::bf16;
  int dims = 0;
  float tensor_scale = 1.0f;
  Fp8ScaleFloor fp8_scale_floor = Fp8ScaleFloor::amax;
  const int32_t* block_table = nullptr;         // readers only
  int64_t blocks_per_sequence = 0;
  int64_t num_sequences = 0;
  const int32_t* first_logical_page = nullptr;  // may be null
};

DeviceRows device_rows(const PagedCache& cache);

// Specs of the cache's tensors for check_tensors, named "<name>.pages" etc. `num_sequences`
// (kAnyDim when unknown) is the expected first dimension of the tables; readers need the block
// table, writers do not look at it.
std::vector<TensorSpec> paged_cache_specs(const std::string& name, const PagedCache& cache, bool reader,
                                          int64_t num_sequences);

// Cross-tensor invariants of a cache argument: its geometry is what page_geometry() gives for its
// format, dims and rows per page; the format is one of `formats`; the row has `dims` channels; an
// fp8_per_tensor scale is finite and positive.
void check_paged_cache(const char* op, const std::string& name, const PagedCache& cache, int64_t dims,
                       const std::vector<KvRowFormat>& formats);

}  // namespace dsv4::cuda

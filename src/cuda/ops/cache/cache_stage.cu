// run_cache_stage: a warp per staged row, each lane decoding 16 channels exactly to bf16 with the
// attention kernels' row decode (row_decode.cuh) and writing them as one 32-byte piece of the row.
#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common/check_args.h"
#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/attention/row_decode.cuh"
#include "dsv4/cuda/cache.h"

namespace dsv4::cuda {
namespace {

constexpr int64_t kDims = row_decode::kRowChannels;  // 32 lanes x 16 channels
constexpr int kWarpsPerBlock = 8;
const std::vector<KvRowFormat> kSourceFormats = {KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::fp8_ds_mla,
                                                 KvRowFormat::bf16};

template <KvRowFormat F>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) cache_stage_kernel(DeviceRows source, const int32_t* pages,
                                                                           DeviceRows staged, int64_t rows) {
  const int64_t row = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const RowSplit at = split_rows(row, staged.rows_per_page);
  const RowRef from = row_in_page(source, pages[at.block], at.row), to = row_in_page(staged, at.block, at.row);
  uint4 first = make_uint4(0, 0, 0, 0), second = first;
  if (from.valid()) row_decode::decode16<F>(from.data, from.scales, 16 * lane, 0, first, second);
  uint4* const out = reinterpret_cast<uint4*>(to.data + 32 * lane);
  out[0] = first;
  out[1] = second;
}

}  // namespace

PageGeometry staged_page_geometry(const PageGeometry& source) {
  return page_geometry(KvRowFormat::bf16, source.row.dims, source.rows_per_page);
}

void validate_cache_stage(const CacheStageParams& p) {
  constexpr const char* op = "cache_stage";
  std::vector<TensorSpec> specs = paged_cache_specs("source", p.source, false, kAnyDim);
  specs.push_back({"pages", &p.pages, {kAnyDim}, {DType::i32}});
  for (TensorSpec& s : paged_cache_specs("staged", p.staged, false, kAnyDim)) specs.push_back(std::move(s));
  check_tensors(op, specs);
  check_paged_cache(op, "source", p.source, kDims, kSourceFormats);
  // The source's geometry is valid (checked above), so this does not throw.
  const PageGeometry expected = staged_page_geometry(p.source.geometry);
  check_paged_cache(op, "staged", p.staged, expected.row.dims, {expected.format});
  DSV4_CHECK(p.staged.geometry.rows_per_page == expected.rows_per_page, op, ": cache 'staged' has ",
             p.staged.geometry.rows_per_page, " rows per page, expected the source's ", expected.rows_per_page);
  DSV4_CHECK(p.staged.pages.shape[0] >= p.pages.shape[0], op, ": cache 'staged' has ", p.staged.pages.shape[0],
             " pages, expected at least ", p.pages.shape[0], " (one per entry of 'pages')");
  // A row's data is read up to 16 bytes at a time (its scales byte by byte) and written in 16-byte pieces.
  for (const auto& [name, cache] : {std::pair{"source", &p.source}, std::pair{"staged", &p.staged}}) {
    const PageGeometry& g = cache->geometry;
    DSV4_CHECK(reinterpret_cast<uintptr_t>(cache->pages.data) % 16 == 0 && g.page_stride % 16 == 0 &&
                   g.data_offset(0) % 16 == 0 && g.data_offset(1) % 16 == 0,
               op, ": cache '", name, "' has row data that is not 16-byte aligned");
  }
}

void run_cache_stage(const CacheStageParams& p, cudaStream_t stream) {
  validate_cache_stage(p);
  const DeviceRows source = device_rows(p.source), staged = device_rows(p.staged);
  const int64_t rows = p.pages.shape[0] * staged.rows_per_page;
  if (rows == 0) return;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  DSV4_CHECK(blocks <= INT_MAX, "cache_stage: ", rows, " rows are too many for one launch");
  row_decode::visit_decoded_format(source.format, [&](auto format) {  // validated: one of kSourceFormats
    cache_stage_kernel<decltype(format)::value><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
        source, p.pages.ptr<const int32_t>(), staged, rows);
  });
  check_launch("cache_stage");
}

}  // namespace dsv4::cuda

// run_cache_decode: one thread per channel of an output row, through the shared row codec.
#include "cuda/common/check_args.h"
#include "cuda/common/paged_rows.cuh"
#include "dsv4/cuda/cache.h"

namespace dsv4::cuda {
namespace {

template <KvRowFormat F>
__global__ void cache_decode_kernel(DeviceRows rows, const int64_t* slots, int64_t n, float* out) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= n * rows.dims) return;
  const int64_t row = i / rows.dims;
  const int c = static_cast<int>(i % rows.dims);
  const RowRef ref = row_at_slot(rows, slots[row]);
  out[i] = ref.valid() ? decode_channel<F>(rows, ref, c) : 0.0f;
}

}  // namespace

void validate_cache_decode(const CacheDecodeParams& p) {
  constexpr const char* op = "cache_decode";
  const int64_t rows = p.slots.shape[0], dims = p.cache.geometry.row.dims;
  std::vector<TensorSpec> specs = paged_cache_specs("cache", p.cache, false, kAnyDim);
  specs.push_back({"slots", &p.slots, {kAnyDim}, {DType::i64}});
  specs.push_back({"out", &p.out, {rows, dims}, {DType::f32}});
  check_tensors(op, specs);
  check_paged_cache(op, "cache", p.cache, dims, kEveryKvRowFormat);
}

void run_cache_decode(const CacheDecodeParams& p, cudaStream_t stream) {
  validate_cache_decode(p);
  const DeviceRows rows = device_rows(p.cache);
  const int64_t n = p.slots.shape[0], threads = n * rows.dims;
  if (threads == 0) return;
  constexpr int kBlock = 256;
  visit_format(rows.format, [&](auto format) {
    cache_decode_kernel<decltype(format)::value><<<static_cast<unsigned>((threads + kBlock - 1) / kBlock), kBlock, 0,
                                                   stream>>>(rows, p.slots.ptr<const int64_t>(), n, p.out.ptr<float>());
  });
  check_launch("cache_decode");
}

}  // namespace dsv4::cuda

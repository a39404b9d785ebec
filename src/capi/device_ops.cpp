// The C API's CUDA operations (device_ops.h): DLTensors become views, the op's params are filled
// and its run function is queued on the caller's stream, on the tensors' device.
#include "capi/device_ops.h"

#include <string>

#include "capi/dlpack_view.h"

#ifdef DSV4_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/cache.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/qkv.h"
#endif

namespace dsv4::capi {

bool on_cuda(const DLTensor* t) {
  return t && (t->device.device_type == kDLCUDA || t->device.device_type == kDLCUDAManaged);
}

#ifdef DSV4_WITH_CUDA
using cuda::PagedCache;

namespace {

// Runs the op on the device of `anchor` and restores the caller's current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(const DLTensor* anchor) {
    DSV4_CUDA_CHECK(cudaGetDevice(&previous_));
    if (anchor->device.device_id != previous_) DSV4_CUDA_CHECK(cudaSetDevice(anchor->device.device_id));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

TensorView cuda_view(const char* op, const char* arg, const DLTensor* t, DType dtype,
                     std::initializer_list<int64_t> shape) {
  return checked_view(op, arg, t, dtype, shape, kDLCUDA);
}

// An optional [n] tensor; absent when t is NULL.
TensorView optional_vector(const char* op, const char* arg, const DLTensor* t, DType dtype, int64_t n) {
  return t ? cuda_view(op, arg, t, dtype, {n}) : TensorView{};
}

// The pages argument of a codec or attention call: [num_pages, page_stride] u8.
PagedCache paged_cache(const char* op, const PageGeometry& g, const DLTensor* pages, float tensor_scale) {
  check_dltensor(op, "pages", pages);
  if (pages->ndim != 2) throw_shape(op, "pages", pages, "[num_pages, " + std::to_string(g.page_stride) + "]");
  PagedCache cache;
  cache.pages = cuda_view(op, "pages", pages, DType::u8, {pages->shape[0], g.page_stride});
  cache.geometry = g;
  cache.tensor_scale = tensor_scale;
  return cache;
}

}  // namespace

void cuda_kv_encode(const PageGeometry& g, const DLTensor* x, const DLTensor* slots, const DLTensor* pages,
                    float tensor_scale, Fp8ScaleFloor floor, void* stream) {
  constexpr const char* op = "kv_encode";
  DeviceGuard guard(x);
  const int64_t n = x->shape[0];
  cuda::CacheInsertParams p;
  p.rows = cuda_view(op, "x", x, DType::f32, {n, g.row.dims});
  p.slots = cuda_view(op, "slots", slots, DType::i64, {n});
  p.cache = paged_cache(op, g, pages, tensor_scale);
  p.cache.fp8_scale_floor = floor;
  p.bf16_rounding = false;  // the row is encoded as given
  cuda::run_cache_insert(p, as_stream(stream));
}

void cuda_kv_decode(const PageGeometry& g, const DLTensor* pages, const DLTensor* slots, const DLTensor* out,
                    float tensor_scale, void* stream) {
  constexpr const char* op = "kv_decode";
  DeviceGuard guard(out);
  const int64_t n = out->shape[0];
  cuda::CacheDecodeParams p;
  p.cache = paged_cache(op, g, pages, tensor_scale);
  p.slots = cuda_view(op, "slots", slots, DType::i64, {n});
  p.out = cuda_view(op, "out", out, DType::f32, {n, g.row.dims});
  cuda::run_cache_decode(p, as_stream(stream));
}

void cuda_sparse_attention(const char* op, const DLTensor* q, const AttentionRows& rows, const DLTensor* indices,
                           const DLTensor* topk_length, const DLTensor* sink, float scale, bool bf16,
                           const DLTensor* out, const DLTensor* lse, void* stream) {
  DeviceGuard guard(q);
  const int64_t T = q->shape[0], H = q->shape[1], D = q->shape[2], K = indices->shape[1];
  cuda::SparseAttentionParams p;
  p.q = cuda_view(op, "q", q, DType::bf16, {T, H, D});
  p.window_size = 0;  // the indices alone, as flat slots of a cache without a block table
  if (rows.rows_as_pages) {
    const int64_t n = rows.pages->shape[0];
    p.compressed.pages = cuda_view(op, "kv", rows.pages, DType::bf16, {n, D});
    p.compressed.pages = TensorView::contiguous(p.compressed.pages.data, DType::u8, {n, rows.geometry.page_stride},
                                                Device::cuda, p.compressed.pages.device_index);
    p.compressed.geometry = rows.geometry;
  } else {
    p.compressed = paged_cache(op, rows.geometry, rows.pages, rows.tensor_scale);
  }
  p.picks = cuda_view(op, "indices", indices, DType::i32, {T, K});
  p.pick_count = optional_vector(op, "topk_length", topk_length, DType::i32, T);
  p.compress_ratio = 0;
  p.sink = optional_vector(op, "sink", sink, DType::f32, H);
  p.scale = scale;
  p.bf16_rounding = bf16;
  p.out = cuda_view(op, "out", out, DType::f32, {T, H, D});
  if (lse) p.lse = cuda_view(op, "lse", lse, DType::f32, {T, H});
  cuda::run_sparse_attention(p, as_stream(stream));
}

void cuda_index_scores(const DLTensor* q, const DLTensor* weights, const DLTensor* keys,
                       const DLTensor* token_position, int32_t compress_ratio, bool bf16, const DLTensor* scores,
                       void* stream) {
  constexpr const char* op = "index_scores";
  DeviceGuard guard(q);
  const int64_t T = q->shape[0], H = q->shape[1], D = q->shape[2], N = keys->shape[0];
  cuda::IndexScoresParams p;
  p.q = cuda_view(op, "q", q, DType::bf16, {T, H, D});
  p.weights = cuda_view(op, "weights", weights, DType::f32, {T, H});
  // The keys, flat bf16 rows: pages of one row each.
  const PageGeometry g = page_geometry(KvRowFormat::bf16, D, 1);
  const TensorView k = cuda_view(op, "keys", keys, DType::bf16, {N, D});
  p.keys.pages = TensorView::contiguous(k.data, DType::u8, {N, g.page_stride}, Device::cuda, k.device_index);
  p.keys.geometry = g;
  p.token_position = cuda_view(op, "token_position", token_position, DType::i32, {T});
  p.compress_ratio = compress_ratio;
  p.scores = cuda_view(op, "scores", scores, DType::f32, {T, N});
  p.bf16_rounding = bf16;
  cuda::run_index_scores(p, as_stream(stream));
}

void cuda_topk(const DLTensor* scores, const DLTensor* token_position, int32_t compress_ratio, const DLTensor* picks,
               void* stream) {
  constexpr const char* op = "topk";
  DeviceGuard guard(scores);
  const int64_t T = scores->shape[0], N = scores->shape[1], K = picks->shape[1];
  cuda::TopkParams p;
  p.scores = cuda_view(op, "scores", scores, DType::f32, {T, N});
  if (token_position) {
    p.token_position = cuda_view(op, "token_position", token_position, DType::i32, {T});
    p.compress_ratio = compress_ratio;
  }
  p.picks = cuda_view(op, "picks", picks, DType::i32, {T, K});
  cuda::run_topk(p, as_stream(stream));
}

#else  // built without CUDA

namespace {
[[noreturn]] void no_cuda(const char* op) {
  throw ApiError(DSV4_ERROR_UNSUPPORTED,
                 std::string("dsv4: ") + op + ": the tensors are on a CUDA device, but this dsv4 was built without CUDA");
}
}  // namespace

void cuda_kv_encode(const PageGeometry&, const DLTensor*, const DLTensor*, const DLTensor*, float, Fp8ScaleFloor,
                    void*) {
  no_cuda("kv_encode");
}
void cuda_kv_decode(const PageGeometry&, const DLTensor*, const DLTensor*, const DLTensor*, float, void*) {
  no_cuda("kv_decode");
}
void cuda_sparse_attention(const char* op, const DLTensor*, const AttentionRows&, const DLTensor*, const DLTensor*,
                           const DLTensor*, float, bool, const DLTensor*, const DLTensor*, void*) {
  no_cuda(op);
}
void cuda_index_scores(const DLTensor*, const DLTensor*, const DLTensor*, const DLTensor*, int32_t, bool,
                       const DLTensor*, void*) {
  no_cuda("index_scores");
}
void cuda_topk(const DLTensor*, const DLTensor*, int32_t, const DLTensor*, void*) { no_cuda("topk"); }

#endif

}  // namespace dsv4::capi

#include "dsv4/backend_util.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include "dsv4/config.h"
#include "dsv4/error.h"
#include "dsv4/weights.h"

#ifdef DSV4_WITH_CUDA
#include <cuda_runtime.h>

#include "dsv4/cuda/runtime.h"
#endif

namespace dsv4::cli {

#ifdef DSV4_WITH_CUDA
namespace {
void check_cuda(cudaError_t status, const char* what) {
  DSV4_CHECK(status == cudaSuccess, "cuda: ", what, " failed: ", cudaGetErrorString(status));
}
}  // namespace
#endif

bool built_with_cuda() {
#ifdef DSV4_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_backend_usable(std::string* why) {
#ifdef DSV4_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    *why = "no CUDA device is present";
    return false;
  }
  // The backend may be compiled in but not implemented for every configuration: a small engine
  // tells for sure before a large model is loaded for it.
  try {
    const ModelConfig probe_config = preset_config("tiny-v4.1");
    const ModelTopology topology = resolve_topology(probe_config);
    auto weights = std::make_shared<const ModelWeights>(random_weights(probe_config, topology, 0, false));
    EngineOptions options;
    options.backend = Backend::cuda;
    options.max_sequences = 1;
    options.max_tokens_per_step = 16;
    options.max_context = 16;
    Engine::create(probe_config, weights, options);
  } catch (const Error& e) {
    *why = std::string("the CUDA backend could not create an engine: ") + e.what();
    return false;
  }
  return true;
#else
  *why = "this binary was built without the CUDA backend (configure with -DDSV4_CUDA=ON)";
  return false;
#endif
}

Backend usable_backend(Backend requested, const std::string& command) {
  if (requested != Backend::cuda) return requested;
  std::string why;
  if (cuda_backend_usable(&why)) return Backend::cuda;
  std::fprintf(stderr, "dsv4: %s: backend cuda is not usable: %s; falling back to cpu\n", command.c_str(), why.c_str());
  return Backend::cpu;
}

void apply_kv_format_flag(EngineOptions& options, const std::string& flag) {
  options.cache_storage = flag == "float" ? CacheStorage::float_rows : CacheStorage::paged;
  options.kv_format = flag == "float" ? "" : flag;
}

std::string cache_storage_label(const EngineOptions& options) {
  if (options.cache_storage == CacheStorage::float_rows) return "float";
  return options.kv_format.empty() ? "default" : options.kv_format;
}

void wait_for_engine(const Engine& engine) {
#ifdef DSV4_WITH_CUDA
  if (engine.cuda_stream() != nullptr)
    check_cuda(cudaStreamSynchronize(engine.cuda_stream()), "cudaStreamSynchronize");
#else
  (void)engine;
#endif
}

void fill_device_allocations(uint8_t byte) {
#ifdef DSV4_WITH_CUDA
  cuda::set_allocation_fill(byte);
#else
  (void)byte;
#endif
}

int64_t device_memory_in_use(Backend backend) {
  if (backend != Backend::cuda) return 0;
#ifdef DSV4_WITH_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  check_cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return static_cast<int64_t>(total_bytes - free_bytes);
#else
  return 0;
#endif
}

DeviceRows::DeviceRows(const Engine& engine, int64_t capacity_rows, int64_t cols)
    : stream_(engine.cuda_stream()), capacity_rows_(capacity_rows), cols_(cols) {
  DSV4_CHECK(capacity_rows >= 0 && cols >= 1, "device rows: shape [", capacity_rows, ", ", cols,
             "] is invalid, expected rows >= 0 and cols >= 1");
  const size_t bytes = static_cast<size_t>(capacity_rows * cols) * sizeof(float);
  if (stream_ != nullptr) {
#ifdef DSV4_WITH_CUDA
    // The rows live on the current device (a tensor-parallel rank's own GPU); the views say which.
    check_cuda(cudaGetDevice(&device_index_), "cudaGetDevice");
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&data_), bytes), "cudaMalloc");
#else
    fail("device rows: backend cuda is not built into this binary");
#endif
  } else {
    data_ = new float[bytes / sizeof(float)];
  }
}

DeviceRows::~DeviceRows() {
#ifdef DSV4_WITH_CUDA
  if (stream_ != nullptr) {
    cudaFree(data_);
    return;
  }
#endif
  delete[] data_;
}

void DeviceRows::check_rows(int64_t rows, const char* what) const {
  DSV4_CHECK(rows >= 0 && rows <= capacity_rows_, "device rows: ", what, " of ", rows, " rows, capacity is ",
             capacity_rows_);
}

TensorView DeviceRows::view(int64_t rows) const {
  check_rows(rows, "view");
  return TensorView::contiguous(data_, DType::f32, {rows, cols_},
                                stream_ != nullptr ? Device::cuda : Device::cpu, device_index_);
}

void DeviceRows::upload(const float* host, int64_t rows) {
  check_rows(rows, "upload");
  const size_t bytes = static_cast<size_t>(rows * cols_) * sizeof(float);
#ifdef DSV4_WITH_CUDA
  if (stream_ != nullptr) {
    // Ordered after the engine's reads of the previous rows.
    cuda::copy_to_device(data_, host, bytes, stream_);
    return;
  }
#endif
  std::memcpy(data_, host, bytes);
}

void DeviceRows::download(float* host, int64_t rows) const {
  check_rows(rows, "download");
  const size_t bytes = static_cast<size_t>(rows * cols_) * sizeof(float);
#ifdef DSV4_WITH_CUDA
  if (stream_ != nullptr) {
    check_cuda(cudaMemcpyAsync(host, data_, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync to the host");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    return;
  }
#endif
  std::memcpy(host, data_, bytes);
}

void DeviceRows::copy_rows_from(const DeviceRows& source, int64_t source_row, int64_t row, int64_t rows,
                                int64_t col) {
  DSV4_CHECK(rows >= 0 && source_row >= 0 && source_row + rows <= source.capacity_rows_ && row >= 0 &&
                 row + rows <= capacity_rows_ && col >= 0 && col + source.cols_ <= cols_ &&
                 (stream_ == nullptr) == (source.stream_ == nullptr),
             "device rows: copy of rows [", source_row, ", ", source_row + rows, ") of ", source.cols_,
             " columns to rows [", row, ", ", row + rows, ") at column ", col, " of [", capacity_rows_, ", ", cols_,
             "] does not fit or crosses devices");
  const float* from = source.data_ + source_row * source.cols_;
  float* to = data_ + row * cols_ + col;
  const size_t row_bytes = static_cast<size_t>(source.cols_) * sizeof(float);
#ifdef DSV4_WITH_CUDA
  if (stream_ != nullptr) {
    if (rows > 0)
      check_cuda(cudaMemcpy2DAsync(to, static_cast<size_t>(cols_) * sizeof(float), from, row_bytes, row_bytes,
                                   static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpy2DAsync between device rows");
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) std::memcpy(to + r * cols_, from + r * source.cols_, row_bytes);
}

}  // namespace dsv4::cli

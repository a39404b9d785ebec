// CUDA runtime plumbing shared by the kernels, the engine and the tests: error checks that throw
// dsv4::Error, an owning device buffer, a stream and a cuBLASLt handle (RAII wrappers), and the
// paged-cache description every cache-reading or cache-writing operation takes.
//
// The run_<op> functions of include/dsv4/cuda/*.h never allocate device memory and never
// synchronize, so a sequence of them can be captured into a CUDA graph. Their scratch memory is a
// caller-owned workspace of <op>_workspace_bytes(params) bytes (256-byte aligned).
#pragma once

#include <cuda_runtime_api.h>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "dsv4/error.h"
#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"
#include "dsv4/tensor.h"

struct cublasLtContext;  // cublasLt.h: typedef struct cublasLtContext* cublasLtHandle_t

namespace dsv4::cuda {

// Throws "dsv4: cuda: <expression> failed at <file>:<line>: <error name>: <error string>".
void check_status(cudaError_t status, const char* expression, const char* file, int line);

// Number of usable CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();

// Throws "dsv4: <op>: kernel launch failed: ..." when the last launch on this thread failed
// (bad configuration, too much shared memory). Does not synchronize.
void check_launch(const char* op);

// Copies host memory (pageable or pinned) to the device, queued on `stream` (ordered with its other
// work), and returns when the bytes are there, so the host memory may go. cudaMemcpy alone is not
// enough: from pageable memory it may return before its DMA has landed, and it is not ordered with
// a non-blocking stream. Waits for `stream` only, never for the whole device.
void copy_to_device(void* device, const void* host, size_t bytes, cudaStream_t stream);

// Diagnostics: from now on every new DeviceBuffer is filled with `byte` (nullopt, the default:
// new memory is left as cudaMalloc returns it, whatever an earlier allocation left there). Two
// runs with different bytes agree unless something reads device memory nothing wrote.
void set_allocation_fill(std::optional<uint8_t> byte);

// Owning device memory (cudaMalloc / cudaFree). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // A contiguous cuda view of the buffer; the shape's bytes must fit in the buffer.
  TensorView view(DType dtype, const std::vector<int64_t>& shape) const;

  // Copies of the first `bytes` bytes, queued on `stream` and finished on return (copy_to_device).
  void upload(const void* host, size_t bytes, cudaStream_t stream = nullptr);
  // cudaMemcpy on the default stream: not ordered after work on a non-blocking stream, so
  // synchronize the stream that wrote the buffer first.
  void download(void* host, size_t bytes) const;
  // Sets every byte and returns when they are set, so that work queued afterwards on any stream
  // comes after the fill; tests poison outputs with 0xff (a NaN in every float format).
  void fill_bytes(uint8_t value);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

// A device copy of a host tensor, and the host copy of a device view (synchronous).
DeviceBuffer to_device(const HostTensor& host);
HostTensor to_host(const TensorView& device_view);

// An owning non-blocking stream.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  // Waits for the stream; throws the first asynchronous error with `op` in the message.
  void synchronize(const char* op = "stream") const;

 private:
  cudaStream_t stream_ = nullptr;
};

// What a cuBLASLt matmul's algorithm choice depends on: its sizes, dtypes and layout (the callers
// name their layout; run_linear has one, row-major x · weightᵀ).
struct BlasLtMatmulKey {
  int layout = 0;
  int64_t rows = 0, groups = 0, in = 0, out = 0;
  DType input = DType::bf16, output = DType::bf16;
  auto operator<=>(const BlasLtMatmulKey&) const = default;
};

// The bytes of a cublasLtMatmulAlgo_t (cublasLt.h: uint64_t data[8]).
struct BlasLtAlgorithm {
  uint64_t data[8] = {};
};

// An owning cuBLASLt handle for the current device, the workspace its matmuls use, and the
// algorithms chosen so far. The workspace belongs to cuBLASLt alone (its split-K reductions keep
// partial sums and counters there; nothing else should write it), and one BlasLt serves one
// stream at a time (an engine and its stream). The algorithm cache is guarded by a mutex, so
// BlasLts may also be shared for their choices, but the workspace may not.
class BlasLt {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper

  BlasLt();
  ~BlasLt();
  BlasLt(const BlasLt&) = delete;
  BlasLt& operator=(const BlasLt&) = delete;
  cublasLtContext* get() const { return handle_; }
  void* workspace() const { return workspace_.data(); }

  // The algorithm chosen for `key`, or `choose()`'s answer, remembered: the cuBLASLt heuristic is
  // asked once per shape, and every later call of the shape runs the same algorithm (so the same
  // bits).
  template <class Choose>
  BlasLtAlgorithm algorithm(const BlasLtMatmulKey& key, Choose&& choose) const {
    std::lock_guard<std::mutex> lock(algorithms_->mutex);
    auto it = algorithms_->chosen.find(key);
    if (it == algorithms_->chosen.end()) it = algorithms_->chosen.emplace(key, choose()).first;
    return it->second;
  }
  // How many shapes have an algorithm (tests, diagnostics).
  size_t cached_algorithms() const {
    std::lock_guard<std::mutex> lock(algorithms_->mutex);
    return algorithms_->chosen.size();
  }

 private:
  struct Algorithms {
    std::mutex mutex;
    std::map<BlasLtMatmulKey, BlasLtAlgorithm> chosen;
  };
  cublasLtContext* handle_ = nullptr;
  DeviceBuffer workspace_;
  std::unique_ptr<Algorithms> algorithms_ = std::make_unique<Algorithms>();
};

// A paged KV cache as the kernels see it (SPEC §7, kv_format.h, kv_cache.h). Rows are addressed
// two ways:
//  * writers take a slot per row: page = slot / rows_per_page, row in page = slot % rows_per_page
//    (KvCacheManager::step_slots); a negative slot is skipped;
//  * readers look rows up per sequence: row i of sequence s is in page
//    block_table[s][i / rows_per_page - first_logical_page[s]] (KvCacheManager::block_table);
//    a reader without a block table is flat: row i of every sequence is slot i (FlashMLA's flat
//    indices into its pages).
// Kernels skip rows whose page lies outside the table or outside `pages` (never read or write out
// of bounds); such rows do not take part in attention or scoring.
struct PagedCache {
  TensorView pages;               // [num_pages, geometry.page_stride] u8
  TensorView block_table;         // readers, optional: [num_sequences, blocks_per_sequence] i32 page ids
  TensorView first_logical_page;  // readers, optional: [num_sequences] i32 (absent: all 0)
  PageGeometry geometry;          // format, placement, row layout, rows per page, page stride
  float tensor_scale = 1.0f;      // fp8_per_tensor only: stored value = e4m3(x / tensor_scale)
  Fp8ScaleFloor fp8_scale_floor = Fp8ScaleFloor::amax;  // writers: as EncodeOptions::fp8_scale_floor
};

// Optional tensors of a params struct are absent when left as a default TensorView{}.
inline bool is_present(const TensorView& v) { return v.rank > 0 || v.data != nullptr; }

// Workspace carving: 256-byte aligned sub-ranges of one caller-owned buffer.
inline constexpr size_t kWorkspaceAlignment = 256;
inline constexpr size_t align_workspace(size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Throws "dsv4: <op>: the workspace is null" or "... is not 256-byte aligned".
void check_workspace(const char* op, const void* workspace);

}  // namespace dsv4::cuda

// DSV4_CUDA_CHECK(cudaMemsetAsync(...)); throws dsv4::Error on failure.
#define DSV4_CUDA_CHECK(expression) ::dsv4::cuda::check_status((expression), #expression, __FILE__, __LINE__)

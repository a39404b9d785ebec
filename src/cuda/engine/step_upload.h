// The per-step metadata upload of the CUDA engine: arrays built on the host at begin_step
// (positions, block tables, slot mappings) are packed into one pinned staging buffer and copied
// to the device with a single asynchronous copy; kernels read them through views of the device
// copy. Capacity is fixed when the engine is created.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

class StepUpload {
 public:
  explicit StepUpload(size_t capacity_bytes);
  ~StepUpload();
  StepUpload(const StepUpload&) = delete;
  StepUpload& operator=(const StepUpload&) = delete;

  // Starts a new packing; waits until the previous upload has left the staging buffer.
  void begin();
  // Appends an array (256-byte aligned) and returns its device view [shape] of `dtype`, valid
  // after upload(). Throws when the packed bytes would exceed the capacity.
  // With `reserve_bytes`, the array takes at least that much room, so that the arrays after it
  // keep their offsets whatever its size.
  TensorView append(const void* data, size_t bytes, DType dtype, const std::vector<int64_t>& shape,
                    size_t reserve_bytes = 0);
  template <class T>
  TensorView append(std::span<const T> values, DType dtype, const std::vector<int64_t>& shape,
                    size_t reserve_bytes = 0) {
    return append(values.data(), values.size_bytes(), dtype, shape, reserve_bytes);
  }
  // Queues the copy of everything appended since begin() on `stream`.
  void upload(cudaStream_t stream);

  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::byte* host_ = nullptr;  // pinned
  DeviceBuffer device_;
  size_t used_ = 0;
  cudaEvent_t uploaded_ = nullptr;
  bool pending_ = false;
};

}  // namespace dsv4::cuda

#include "cuda/engine/step_upload.h"

#include <algorithm>
#include <cstring>

namespace dsv4::cuda {

StepUpload::StepUpload(size_t capacity_bytes) : capacity_(align_workspace(capacity_bytes)), device_(capacity_) {
  void* host = nullptr;
  DSV4_CUDA_CHECK(cudaMallocHost(&host, capacity_));
  host_ = static_cast<std::byte*>(host);
  const cudaError_t status = cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming);
  if (status != cudaSuccess) {
    cudaFreeHost(host_);
    check_status(status, "cudaEventCreateWithFlags", __FILE__, __LINE__);
  }
}

StepUpload::~StepUpload() {
  // A copy may still read the staging buffer.
  if (pending_) cudaEventSynchronize(uploaded_);
  cudaEventDestroy(uploaded_);
  cudaFreeHost(host_);
}

void StepUpload::begin() {
  if (pending_) DSV4_CUDA_CHECK(cudaEventSynchronize(uploaded_));
  pending_ = false;
  used_ = 0;
}

TensorView StepUpload::append(const void* data, size_t bytes, DType dtype, const std::vector<int64_t>& shape,
                              size_t reserve_bytes) {
  const size_t offset = used_;
  TensorView v = TensorView::contiguous(static_cast<std::byte*>(device_.data()) + offset, dtype, shape, Device::cuda);
  DSV4_CHECK(static_cast<size_t>(v.numel()) * dtype_size(dtype) == bytes, "engine: begin_step: metadata array of ",
             bytes, " bytes does not match its shape ", v.shape_string());
  DSV4_CHECK(bytes <= capacity_ - offset && reserve_bytes <= capacity_ - offset,
             "engine: begin_step: the step's metadata needs more than the ", capacity_, " bytes planned at create");
  if (bytes > 0) std::memcpy(host_ + offset, data, bytes);
  // Both offset and capacity are multiples of the alignment, so this stays within the capacity.
  used_ = offset + align_workspace(std::max(bytes, reserve_bytes));
  DSV4_CUDA_CHECK(cudaGetDevice(&v.device_index));
  return v;
}

void StepUpload::upload(cudaStream_t stream) {
  if (used_ == 0) return;
  DSV4_CUDA_CHECK(cudaMemcpyAsync(device_.data(), host_, used_, cudaMemcpyHostToDevice, stream));
  DSV4_CUDA_CHECK(cudaEventRecord(uploaded_, stream));
  pending_ = true;
}

}  // namespace dsv4::cuda

#include "dsv4/cuda/runtime.h"

#include <cublasLt.h>

#include <atomic>
#include <utility>

namespace dsv4::cuda {

void check_status(cudaError_t status, const char* expression, const char* file, int line) {
  if (status == cudaSuccess) return;
  fail("cuda: ", expression, " failed at ", file, ":", line, ": ", cudaGetErrorName(status), ": ",
       cudaGetErrorString(status));
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return count;
}

void check_launch(const char* op) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    fail(op, ": kernel launch failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status));
}

void check_workspace(const char* op, const void* workspace) {
  DSV4_CHECK(workspace != nullptr, op, ": the workspace is null (size it with ", op, "_workspace_bytes)");
  DSV4_CHECK(reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment == 0, op, ": the workspace is not ",
             kWorkspaceAlignment, "-byte aligned");
}

void copy_to_device(void* device, const void* host, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  DSV4_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));  // the DMA from the staging buffer has landed
}

namespace {
std::atomic<int> allocation_fill{-1};  // -1: none
}  // namespace

void set_allocation_fill(std::optional<uint8_t> byte) { allocation_fill = byte ? int{*byte} : -1; }

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  DSV4_CUDA_CHECK(cudaGetDevice(&device_));
  if (bytes == 0) return;
  DSV4_CUDA_CHECK(cudaMalloc(&data_, bytes));
  if (const int fill = allocation_fill; fill >= 0) fill_bytes(static_cast<uint8_t>(fill));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);  // errors cannot be reported from a destructor
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), device_(other.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

TensorView DeviceBuffer::view(DType dtype, const std::vector<int64_t>& shape) const {
  TensorView v = TensorView::contiguous(data_, dtype, shape, Device::cuda, device_);
  const size_t needed = dtype == DType::e2m1x2 ? static_cast<size_t>(v.numel())
                                               : static_cast<size_t>(v.numel()) * dtype_size(dtype);
  DSV4_CHECK(needed <= bytes_, "cuda: a view of shape ", v.shape_string(), " ", dtype_name(dtype), " needs ",
             needed, " bytes, the device buffer holds ", bytes_);
  return v;
}

void DeviceBuffer::upload(const void* host, size_t bytes, cudaStream_t stream) {
  DSV4_CHECK(bytes <= bytes_, "cuda: upload of ", bytes, " bytes into a device buffer of ", bytes_);
  copy_to_device(data_, host, bytes, stream);
}

void DeviceBuffer::download(void* host, size_t bytes) const {
  DSV4_CHECK(bytes <= bytes_, "cuda: download of ", bytes, " bytes from a device buffer of ", bytes_);
  if (bytes > 0) DSV4_CUDA_CHECK(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill_bytes(uint8_t value) {
  if (bytes_ == 0) return;
  // cudaMemset is queued on the default stream, which the engines' non-blocking streams are not
  // ordered with: unwaited, a fill that the GPU runs late (another process holding it) lands on
  // top of what a copy or kernel on another stream wrote since (determinism_cuda_test).
  DSV4_CUDA_CHECK(cudaMemsetAsync(data_, value, bytes_, nullptr));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

DeviceBuffer to_device(const HostTensor& host) {
  DeviceBuffer buffer(host.nbytes());
  buffer.upload(host.data(), host.nbytes());
  return buffer;
}

HostTensor to_host(const TensorView& device_view) {
  DSV4_CHECK(device_view.device == Device::cuda, "cuda: to_host expects a cuda view, got ",
             device_name(device_view.device));
  DSV4_CHECK(device_view.is_contiguous(), "cuda: to_host expects a contiguous view, got shape ",
             device_view.shape_string());
  HostTensor host(device_view.dtype,
                  std::vector<int64_t>(device_view.shape.begin(), device_view.shape.begin() + device_view.rank));
  if (host.nbytes() > 0)
    DSV4_CUDA_CHECK(cudaMemcpy(host.data(), device_view.data, host.nbytes(), cudaMemcpyDeviceToHost));
  return host;
}

Stream::Stream() { DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);
}

void Stream::synchronize(const char* op) const {
  const cudaError_t status = cudaStreamSynchronize(stream_);
  if (status != cudaSuccess)
    fail(op, ": asynchronous CUDA error: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status));
}

BlasLt::BlasLt() : workspace_(kWorkspaceBytes) {
  // Zeroed once, so that no bytes of an earlier allocation reach cuBLASLt.
  workspace_.fill_bytes(0);  // returns when the bytes are set (fill_bytes), before any stream uses it
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t status = cublasLtCreate(&handle);
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuda: cublasLtCreate failed: ", cublasLtGetStatusName(status), ": ", cublasLtGetStatusString(status));
  handle_ = handle;
}

BlasLt::~BlasLt() {
  if (handle_) cublasLtDestroy(handle_);
}

}  // namespace dsv4::cuda

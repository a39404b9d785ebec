#include "cuda/common/dispatch.h"

#include <array>
#include <mutex>

#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

const DeviceInfo& device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> infos;
  static std::array<std::once_flag, kMaxDevices> queried;
  int device = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  DSV4_CHECK(device >= 0 && device < kMaxDevices, "cuda: device ", device, " is beyond the ", kMaxDevices,
             " devices dispatch knows");
  std::call_once(queried[static_cast<size_t>(device)], [&] {
    int major = 0, minor = 0;
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    DeviceInfo& info = infos[static_cast<size_t>(device)];
    info.ordinal = device;
    info.compute_capability = major * 10 + minor;
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_shared_bytes_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_shared_bytes_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  });
  return infos[static_cast<size_t>(device)];
}

namespace {

std::string capability_string(int capability) {
  return std::to_string(capability / 10) + "." + std::to_string(capability % 10);
}

}  // namespace

std::string needs_compute_capability(int needed, const DeviceInfo& device) {
  if (device.compute_capability == needed) return "";
  return "needs compute capability " + capability_string(needed) + ", the device has " +
         capability_string(device.compute_capability);
}

std::string needs_compute_capability_at_least(int needed, const DeviceInfo& device) {
  if (device.compute_capability >= needed) return "";
  return "needs compute capability >= " + capability_string(needed) + ", the device has " +
         capability_string(device.compute_capability);
}

std::string needs_value(const char* what, long long needed, long long given) {
  if (needed == given) return "";
  return std::string(what) + " " + std::to_string(given) + ", supports " + std::to_string(needed);
}

std::string needs_shared_memory(long long bytes, const DeviceInfo& device) {
  if (device.max_shared_bytes_per_block >= bytes) return "";
  return "needs " + std::to_string(bytes) + " bytes of shared memory per block, the device has " +
         std::to_string(device.max_shared_bytes_per_block);
}

}  // namespace dsv4::cuda

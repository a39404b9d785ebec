#include "cuda/late_writer.h"

#include "cuda/common/dependent_launch.cuh"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda::testing {
namespace {

__device__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__global__ void copy_late_kernel(uint8_t* to, const uint8_t* from, size_t bytes, int64_t delay_ns) {
  allow_dependent_launch();
  const uint64_t start = global_time_ns();
  while (global_time_ns() - start < static_cast<uint64_t>(delay_ns)) __nanosleep(1000);
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) to[i] = from[i];
}

}  // namespace

void copy_late(void* to, const void* from, size_t bytes, int64_t delay_ns, cudaStream_t stream) {
  copy_late_kernel<<<1, 256, 0, stream>>>(static_cast<uint8_t*>(to), static_cast<const uint8_t*>(from), bytes, delay_ns);
  check_launch("copy_late");
}

}  // namespace dsv4::cuda::testing

// A preceding kernel that writes late, for the kernels that are dependent launches
// (src/cuda/common/dependent_launch.cuh): it lets the next kernel in the stream be scheduled at once
// and copies `bytes` from `from` to `to` only after about `delay_ns`, so that a dependent kernel
// that read its inputs before waiting for the preceding grids would read the old bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dsv4::cuda::testing {

void copy_late(void* to, const void* from, size_t bytes, int64_t delay_ns, cudaStream_t stream);

}  // namespace dsv4::cuda::testing

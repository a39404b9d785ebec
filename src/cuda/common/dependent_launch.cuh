// Programmatic dependent launch (sm_90): a kernel launched with the attribute below may start
// while the kernel before it in the stream (or graph) is still running, so that its launch and
// block scheduling overlap that kernel's tail instead of following it. Such a kernel must call
// wait_for_preceding_grids() before it reads or writes any global memory: that waits until the
// preceding grids have completed and their writes are visible, whoever they are. Without the
// attribute (or before sm_90) both calls are no-ops.
#pragma once

#include <cuda_runtime.h>

namespace dsv4::cuda {

__device__ __forceinline__ void wait_for_preceding_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream, if launched with the attribute, be scheduled now; it still
// waits for this grid's completion before it touches memory.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The launch attribute for cudaLaunchKernelEx.
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

}  // namespace dsv4::cuda

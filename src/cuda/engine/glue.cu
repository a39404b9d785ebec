#include "cuda/common/device_math.cuh"
#include "cuda/engine/glue.h"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void f32_to_bf16_kernel(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = float_to_bf16_bits(in[i]);
}

__global__ void scale_to_f32_kernel(const void* in, DType in_dtype, float scale, bool round_bf16, float* out,
                                    int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = load_float(in, in_dtype, i) * scale;
    out[i] = round_bf16 ? round_to_bf16(v) : v;
  }
}

__global__ void fill_entry_picks_kernel(int32_t* picks, int64_t entries, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    picks[i] = static_cast<int32_t>(i % entries);
}

}  // namespace

void launch_f32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  f32_to_bf16_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(in, out, n);
  check_launch("engine: f32_to_bf16");
}

void launch_scale_to_f32(const void* in, DType in_dtype, float scale, bool round_bf16, float* out, int64_t n,
                         cudaStream_t stream) {
  if (n == 0) return;
  scale_to_f32_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(in, in_dtype, scale, round_bf16, out, n);
  check_launch("engine: scale_to_f32");
}

void launch_fill_entry_picks(int32_t* picks, int64_t tokens, int64_t entries, cudaStream_t stream) {
  const int64_t n = tokens * entries;
  if (n == 0) return;
  fill_entry_picks_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(picks, entries, n);
  check_launch("engine: fill_entry_picks");
}

}  // namespace dsv4::cuda

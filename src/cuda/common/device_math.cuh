// Device helpers shared by the kernels: typed loads/stores through numeric.h's conversions, warp
// reductions, and a format-dispatch helper for the dtypes a tensor may have at run time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/numeric.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

// Element i of a bf16 or f32 array as float.
__device__ __forceinline__ float load_float(const void* data, DType dtype, int64_t i) {
  return dtype == DType::bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(data)[i])
                              : static_cast<const float*>(data)[i];
}

// Stores v into element i of a bf16 (rounded to nearest even) or f32 array.
__device__ __forceinline__ void store_float(void* data, DType dtype, int64_t i, float v) {
  if (dtype == DType::bf16) static_cast<uint16_t*>(data)[i] = float_to_bf16_bits(v);
  else static_cast<float*>(data)[i] = v;
}

// Stores 4 consecutive values into a bf16 (Out = uint16_t, one 8-byte store) or f32 (Out = float,
// one 16-byte store) array; dst is aligned to the store's size.
template <class Out>
__device__ __forceinline__ void store4(Out* dst, const float (&v)[4]) {
  if constexpr (sizeof(Out) == 2) {
    *reinterpret_cast<uint2*>(dst) = uint2{float_to_bf16_bits(v[0]) | (uint32_t{float_to_bf16_bits(v[1])} << 16),
                                           float_to_bf16_bits(v[2]) | (uint32_t{float_to_bf16_bits(v[3])} << 16)};
  } else {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Grid-stride loop bounds for 1-D element-wise kernels.
inline unsigned elementwise_blocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

}  // namespace dsv4::cuda

#pragma once

#include <cstdint>

namespace dsv4::cuda {

// Compressed entries visible to a query at `position` (SPEC §4.4).
__device__ __forceinline__ int64_t visible_entries(int64_t position, int ratio) {
  return position >= 0 ? (position + 1) / ratio : 0;
}

}  // namespace dsv4::cuda

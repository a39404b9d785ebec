#pragma once

#include <cstdint>

namespace dsv4::cuda {

// Compressed entries visible to a query at `position` (SPEC §4.4).
__device__ __forceinline__ int64_t visible_entries(int64_t position, int ratio) {
  return position >= 0 ? (position + 1) / ratio : 0;
}

// Whether `block` is in the ascending, -1-padded list (the padding sorts as +inf).
__device__ __forceinline__ bool contains_block(const int32_t* list, int64_t n, int64_t block) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t v = list[mid];
    if (v >= 0 && v < block) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && list[lo] == block;
}

}  // namespace dsv4::cuda

// The device side of the synthetic residual stream (synthetic_inputs.h): the same bits as the host
// loops of synthetic_inputs.cpp.
#include <cuda_runtime.h>

#include "dsv4/cuda/runtime.h"
#include "dsv4/synthetic_inputs.h"

namespace dsv4::cli {
namespace {

constexpr int kThreads = 256;

// One thread per value: out [rows, hidden].
__global__ void fill_token_inputs_kernel(uint64_t seed, const TokenKey* keys, int64_t rows, float* out,
                                         int64_t hidden, UniformScale u) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * hidden) return;
  const int64_t r = i / hidden, h = i % hidden;
  out[i] = token_value(token_state(seed, keys[r]), h, u);
}

// One warp per row. Lane j sums the squares of columns j, j + 32, ... in order; the butterfly then
// leaves in lane 0 the sums in the host's pairwise order (every lane holds the same bits, as
// a + b == b + a), which lane 0 hands to all.
__global__ void chain_residual_kernel(float* hidden, const float* attn_out, int64_t rows, int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;  // the whole warp leaves together
  float* h = hidden + row * cols;
  const float* a = attn_out + row * cols;
  double sum_sq = 0.0;
  for (int64_t c = lane; c < cols; c += kNormLanes) {
    const float x = __fadd_rn(h[c], a[c]);
    h[c] = x;
    sum_sq = __dadd_rn(sum_sq, __dmul_rn(static_cast<double>(x), static_cast<double>(x)));
  }
  for (int width = kNormLanes / 2; width >= 1; width /= 2)
    sum_sq = __dadd_rn(sum_sq, __shfl_xor_sync(0xffffffffu, sum_sq, width));
  const float inv_rms = inverse_rms(__shfl_sync(0xffffffffu, sum_sq, 0), cols);
  for (int64_t c = lane; c < cols; c += kNormLanes) h[c] = __fmul_rn(h[c], inv_rms);
}

__global__ void copy_span_rows_kernel(const float* source, float* dest, int64_t cols, const int64_t* span,
                                      const int64_t* map) {
  const int64_t t = blockIdx.x;
  if (t >= span[2]) return;
  const int64_t row = map ? map[span[1] + t] : span[1] + t;
  if (row < 0) return;
  const float* from = source + (span[0] + t) * cols;
  float* to = dest + row * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) to[c] = from[c];
}

}  // namespace

void launch_copy_span_rows(const float* source, float* dest, int64_t cols, const int64_t* span, const int64_t* map,
                           int64_t max_rows, CUstream_st* stream) {
  if (max_rows == 0) return;
  copy_span_rows_kernel<<<static_cast<unsigned>(max_rows), kThreads, 0, stream>>>(source, dest, cols, span, map);
  cuda::check_launch("run: copy_span_rows");
}

void launch_fill_token_inputs(uint64_t seed, const TokenKey* keys, int64_t rows, float* out, int64_t hidden,
                              CUstream_st* stream) {
  const int64_t n = rows * hidden;
  if (n == 0) return;
  fill_token_inputs_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      seed, keys, rows, out, hidden, UniformScale{});
  cuda::check_launch("run: fill_token_inputs");
}

void launch_chain_residual(float* hidden, const float* attn_out, int64_t rows, int64_t cols, CUstream_st* stream) {
  if (rows == 0) return;
  constexpr int kRowsPerBlock = kThreads / 32;
  chain_residual_kernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0, stream>>>(
      hidden, attn_out, rows, cols);
  cuda::check_launch("run: chain_residual");
}

}  // namespace dsv4::cli

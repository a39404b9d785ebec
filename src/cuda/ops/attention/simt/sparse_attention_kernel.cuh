// The SIMT sparse MQA attention kernel (see include/dsv4/cuda/attention.h): fp32 on CUDA cores,
// runs on every supported device (sm_90a code and compute_80 PTX).
//
// One block per (token, group of 16 heads); 8 warps, 2 heads per warp. The token's rows (window
// rows, then picks) are processed in tiles of 32: the block decodes a tile into shared memory as
// fp32 (every cache format decodes exactly; 16-channel work items with 8-byte loads), then each
// warp scores its 2 heads against the 32 rows (lane-split dot products, summed per row through
// shared memory so that lane j holds row j's score), updates its online softmax and accumulates
// P·V from the same shared rows (K = V). A lane owns 4 consecutive channels of every 128-channel
// chunk of the head, for q, the rows and the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"
#include "cuda/ops/attention/sparse_attention_launch.cuh"
#include "cuda/ops/attention/split_merge.cuh"

namespace dsv4::cuda {

inline constexpr int kAttentionWarps = 8;
inline constexpr int kAttentionHeadsPerWarp = 2;
inline constexpr int kAttentionHeadsPerBlock = kAttentionWarps * kAttentionHeadsPerWarp;
inline constexpr int kAttentionTileRows = kWarpSize;

// Per warp and head: the lane-partial dot products of the tile's rows, [row][lane] with a padded
// stride so that both the row-wise stores and the lane-wise sums are free of bank conflicts.
inline constexpr int kPartialStride = kWarpSize + 1;
inline constexpr size_t kPartialFloats = size_t{kAttentionWarps} * kAttentionHeadsPerWarp * kAttentionTileRows * kPartialStride;

template <int kHeadDim>
constexpr size_t sparse_attention_shared_bytes() {
  return (size_t{kAttentionTileRows} * kHeadDim + kPartialFloats) * sizeof(float);
}

template <int kHeadDim, class Out>
__global__ void __launch_bounds__(kAttentionWarps * kWarpSize, 1) sparse_attention_kernel(SparseAttentionLaunch a) {
  static_assert(kHeadDim % 128 == 0, "a lane owns 4 channels of every 128-channel chunk");
  constexpr int kChunks = kHeadDim / 128;
  constexpr int kThreads = kAttentionWarps * kWarpSize;
  extern __shared__ float4 shared_rows4[];  // [kAttentionTileRows][kHeadDim / 4], then the partials
  float* partials = reinterpret_cast<float*>(shared_rows4 + kAttentionTileRows * kHeadDim / 4) +
                    size_t{threadIdx.x / kWarpSize} * kAttentionHeadsPerWarp * kAttentionTileRows * kPartialStride;
  __shared__ RowRef refs[kAttentionTileRows];

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const TokenRows rows(a, t);

  int head[kAttentionHeadsPerWarp];
  float q[kAttentionHeadsPerWarp][kChunks][4], acc[kAttentionHeadsPerWarp][kChunks][4];
  float running_max[kAttentionHeadsPerWarp], running_sum[kAttentionHeadsPerWarp];
#pragma unroll
  for (int h = 0; h < kAttentionHeadsPerWarp; ++h) {
    head[h] = blockIdx.y * kAttentionHeadsPerBlock + warp * kAttentionHeadsPerWarp + h;
    const bool active = head[h] < a.heads;
    const int64_t q_offset = (t * a.heads + head[h]) * kHeadDim;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t at = q_offset + c * 128 + lane * 4;
      if (a.q_f32) {
        const float4 v = active ? *reinterpret_cast<const float4*>(a.q_f32 + at) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        q[h][c][0] = v.x, q[h][c][1] = v.y, q[h][c][2] = v.z, q[h][c][3] = v.w;
      } else {
        const uint2 bits = active ? *reinterpret_cast<const uint2*>(a.q + at) : uint2{0, 0};
        q[h][c][0] = bf16_bits_to_float(static_cast<uint16_t>(bits.x));
        q[h][c][1] = bf16_bits_to_float(static_cast<uint16_t>(bits.x >> 16));
        q[h][c][2] = bf16_bits_to_float(static_cast<uint16_t>(bits.y));
        q[h][c][3] = bf16_bits_to_float(static_cast<uint16_t>(bits.y >> 16));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][c][i] = 0.0f;
    }
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;
  }

  const TokenRows::BlockRows block = rows.block_rows(a, kAttentionTileRows);
  const int64_t first_row = block.first, end_row = block.end;
  for (int64_t base = first_row; base < end_row; base += kAttentionTileRows) {
    __syncthreads();  // the previous tile is consumed
    if (threadIdx.x < kAttentionTileRows) refs[threadIdx.x] = rows.row(a, t, base + threadIdx.x, end_row);
    __syncthreads();
    // Decode: tile rows [0, split) are window rows, [split, 32) compressed entries.
    const int split = rows.window_rows_in_tile(base, kAttentionTileRows);
    // Work items of 16 channels; consecutive threads take consecutive chunks of a row.
    auto decode_rows = [&](const DeviceRows& cache, int first, int last) {
      if (first >= last) return;
      visit_format(cache.format, [&](auto format) {
        constexpr int kChunksPerRow = kHeadDim / 16;
#pragma unroll 4
        for (int item = first * kChunksPerRow + threadIdx.x; item < last * kChunksPerRow; item += kThreads) {
          const int r = item / kChunksPerRow, c0 = (item % kChunksPerRow) * 16;
          float v[16];
          decode_chunk16_or_zeros<decltype(format)::value>(cache, refs[r], c0, v);
          float4* dst = shared_rows4 + r * (kHeadDim / 4) + c0 / 4;
#pragma unroll
          for (int i = 0; i < 4; ++i) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        }
      });
    };
    decode_rows(a.window, 0, split);
    decode_rows(a.compressed, split, kAttentionTileRows);
    __syncthreads();

    // Scores of the warp's heads for the 32 rows: each lane's partial dot products over its
    // channels go to shared memory, then lane j sums row j's partials.
#pragma unroll 4
    for (int j = 0; j < kAttentionTileRows; ++j) {
      float dot[kAttentionHeadsPerWarp] = {};
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const float4 r = shared_rows4[j * (kHeadDim / 4) + c * kWarpSize + lane];
#pragma unroll
        for (int h = 0; h < kAttentionHeadsPerWarp; ++h)
          dot[h] += q[h][c][0] * r.x + q[h][c][1] * r.y + q[h][c][2] * r.z + q[h][c][3] * r.w;
      }
#pragma unroll
      for (int h = 0; h < kAttentionHeadsPerWarp; ++h)
        partials[(h * kAttentionTileRows + j) * kPartialStride + lane] = dot[h];
    }
    __syncwarp();
    float probability[kAttentionHeadsPerWarp];
    const bool row_valid = refs[lane].valid();
#pragma unroll
    for (int h = 0; h < kAttentionHeadsPerWarp; ++h) {
      float total = 0.0f;
#pragma unroll 8
      for (int l = 0; l < kWarpSize; ++l) total += partials[(h * kAttentionTileRows + lane) * kPartialStride + l];
      const float score = row_valid ? total * a.scale : -INFINITY;
      const float new_max = fmaxf(running_max[h], warp_max(score));
      if (new_max == -INFINITY) {  // no valid row yet
        probability[h] = 0.0f;
        continue;
      }
      const float correction = expf(running_max[h] - new_max);  // 0 while running_max is -inf
      probability[h] = row_valid ? expf(score - new_max) : 0.0f;
      running_sum[h] = running_sum[h] * correction + warp_sum(probability[h]);
      if (a.bf16_rounding) probability[h] = round_to_bf16(probability[h]);
      running_max[h] = new_max;
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[h][c][i] *= correction;
    }
    // P·V with the same rows.
#pragma unroll 4
    for (int j = 0; j < kWarpSize; ++j) {
      float p[kAttentionHeadsPerWarp];
#pragma unroll
      for (int h = 0; h < kAttentionHeadsPerWarp; ++h) p[h] = __shfl_sync(kFullMask, probability[h], j);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const float4 r = shared_rows4[j * (kHeadDim / 4) + c * kWarpSize + lane];
#pragma unroll
        for (int h = 0; h < kAttentionHeadsPerWarp; ++h) {
          acc[h][c][0] += p[h] * r.x;
          acc[h][c][1] += p[h] * r.y;
          acc[h][c][2] += p[h] * r.z;
          acc[h][c][3] += p[h] * r.w;
        }
      }
    }
  }

#pragma unroll
  for (int h = 0; h < kAttentionHeadsPerWarp; ++h) {
    if (head[h] >= a.heads) continue;
    if (a.splits > 1) {
      const int64_t index = (int64_t{blockIdx.z} * a.tokens + t) * a.heads + head[h];
      float* partial = a.partials.out + index * kHeadDim;
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        *reinterpret_cast<float4*>(partial + c * 128 + lane * 4) =
            make_float4(acc[h][c][0], acc[h][c][1], acc[h][c][2], acc[h][c][3]);
      // The combine's units: the running max in log2 units (split_merge.cuh).
      if (lane == 0) a.partials.stats[index] = make_float2(running_max[h] * kLog2e, running_sum[h]);
      continue;
    }
    const bool any = running_max[h] != -INFINITY;
    if (a.lse && lane == 0) a.lse[t * a.heads + head[h]] = any ? running_max[h] + logf(running_sum[h]) : -INFINITY;
    const float inverse = any ? 1.0f / (running_sum[h] + (a.sink ? expf(a.sink[head[h]] - running_max[h]) : 0.0f)) : 0.0f;
    Out* out = static_cast<Out*>(a.out) + (t * a.heads + head[h]) * kHeadDim;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const float v[4] = {acc[h][c][0] * inverse, acc[h][c][1] * inverse, acc[h][c][2] * inverse, acc[h][c][3] * inverse};
      store4(out + c * 128 + lane * 4, v);
    }
  }
}

// Out: uint16_t (bf16 bits) or float. With splits > 1 the caller runs the combine afterwards.
template <int kHeadDim, class Out>
void launch_sparse_attention(const SparseAttentionLaunch& a, cudaStream_t stream) {
  constexpr size_t shared = sparse_attention_shared_bytes<kHeadDim>();
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_kernel<kHeadDim, Out>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.heads + kAttentionHeadsPerBlock - 1) / kAttentionHeadsPerBlock),
                  static_cast<unsigned>(a.splits));
  sparse_attention_kernel<kHeadDim, Out><<<grid, kAttentionWarps * kWarpSize, shared, stream>>>(a);
}

}  // namespace dsv4::cuda

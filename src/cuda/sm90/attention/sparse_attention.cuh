// Sparse MQA attention kernel (see include/dsv4/cuda/attention.h).
//
// One block per (token, group of 16 heads); 8 warps, 2 heads per warp. The token's rows (window
// rows, then picks) are processed in tiles of 32: the block decodes a tile into shared memory as
// fp32 (every cache format decodes exactly), then each warp scores its 2 heads against the 32
// rows (lane-split dot products, reduce-scattered so that lane j holds row j's score), updates
// its online softmax and accumulates P·V from the same shared rows (K = V). A lane owns 4
// consecutive channels of every 128-channel chunk of the head, for q, the rows and the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"

namespace dsv4::cuda {

struct SparseAttentionLaunch {
  const uint16_t* q = nullptr;  // [tokens, heads, head_dim] bf16
  const int32_t* token_sequence = nullptr;
  const int32_t* token_position = nullptr;
  DeviceRows window;
  int64_t window_size = 0;
  DeviceRows compressed;
  const int32_t* picks = nullptr;  // [tokens, num_picks]; null: window only
  int64_t num_picks = 0;
  int compress_ratio = 0;
  const float* sink = nullptr;
  float scale = 0.0f;
  void* out = nullptr;
  int64_t tokens = 0;
  int heads = 0;
};

inline constexpr int kAttentionWarps = 8;
inline constexpr int kAttentionHeadsPerWarp = 2;
inline constexpr int kAttentionHeadsPerBlock = kAttentionWarps * kAttentionHeadsPerWarp;
inline constexpr int kAttentionTileRows = kWarpSize;

template <int kHeadDim>
constexpr size_t sparse_attention_shared_bytes() {
  return size_t{kAttentionTileRows} * kHeadDim * sizeof(float);
}

// v[i] of every lane -> the lane returns Σ_lanes v[lane] (row `lane`'s total), 31 shuffles.
__device__ __forceinline__ float reduce_scatter_rows(float (&v)[kWarpSize], int lane) {
#pragma unroll
  for (int s = kWarpSize / 2; s >= 1; s /= 2) {
    const bool upper = (lane & s) != 0;
#pragma unroll
    for (int i = 0; i < s; ++i) {
      const float send = upper ? v[i] : v[i + s];
      const float keep = upper ? v[i + s] : v[i];
      v[i] = keep + __shfl_xor_sync(kFullMask, send, s);
    }
  }
  return v[0];
}

template <int kHeadDim, class Out>
__global__ void __launch_bounds__(kAttentionWarps * kWarpSize, 1) sparse_attention_kernel(SparseAttentionLaunch a) {
  static_assert(kHeadDim % 128 == 0, "a lane owns 4 channels of every 128-channel chunk");
  constexpr int kChunks = kHeadDim / 128;
  constexpr int kThreads = kAttentionWarps * kWarpSize;
  extern __shared__ float4 shared_rows4[];  // [kAttentionTileRows][kHeadDim / 4]
  float* shared_rows = reinterpret_cast<float*>(shared_rows4);
  __shared__ RowRef refs[kAttentionTileRows];

  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t sequence = a.token_sequence[t];
  const int64_t position = a.token_position[t];
  const int64_t window_first = position - a.window_size + 1 > 0 ? position - a.window_size + 1 : 0;
  const int64_t n_window = position >= 0 ? position - window_first + 1 : 0;
  const int64_t n_rows = n_window + (a.picks ? a.num_picks : 0);
  const int64_t n_visible = a.compress_ratio > 0 ? (position + 1) / a.compress_ratio : INT64_MAX;

  int head[kAttentionHeadsPerWarp];
  float q[kAttentionHeadsPerWarp][kChunks][4], acc[kAttentionHeadsPerWarp][kChunks][4];
  float running_max[kAttentionHeadsPerWarp], running_sum[kAttentionHeadsPerWarp];
#pragma unroll
  for (int h = 0; h < kAttentionHeadsPerWarp; ++h) {
    head[h] = blockIdx.y * kAttentionHeadsPerBlock + warp * kAttentionHeadsPerWarp + h;
    const bool active = head[h] < a.heads;
    const uint16_t* qh = a.q + (t * a.heads + head[h]) * kHeadDim;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint2 bits = active ? *reinterpret_cast<const uint2*>(qh + c * 128 + lane * 4) : uint2{0, 0};
      q[h][c][0] = bf16_bits_to_float(static_cast<uint16_t>(bits.x));
      q[h][c][1] = bf16_bits_to_float(static_cast<uint16_t>(bits.x >> 16));
      q[h][c][2] = bf16_bits_to_float(static_cast<uint16_t>(bits.y));
      q[h][c][3] = bf16_bits_to_float(static_cast<uint16_t>(bits.y >> 16));
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][c][i] = 0.0f;
    }
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;
  }

  for (int64_t base = 0; base < n_rows; base += kAttentionTileRows) {
    __syncthreads();  // the previous tile is consumed
    if (threadIdx.x < kAttentionTileRows) {
      const int64_t i = base + threadIdx.x;
      RowRef ref;
      if (i < n_window) {
        ref = row_of_sequence(a.window, sequence, window_first + i);
      } else if (i < n_rows) {
        const int64_t entry = a.picks[t * a.num_picks + (i - n_window)];
        if (entry >= 0 && entry < n_visible) ref = row_of_sequence(a.compressed, sequence, entry);
      }
      refs[threadIdx.x] = ref;
    }
    __syncthreads();
    // Decode: tile rows [0, split) are window rows, [split, 32) compressed entries.
    const int split = static_cast<int>(n_window - base < 0 ? 0 : (n_window - base > kAttentionTileRows ? kAttentionTileRows : n_window - base));
    auto decode_rows = [&](const DeviceRows& rows, int first, int last) {
      if (first >= last) return;
      visit_format(rows.format, [&](auto format) {
        for (int e = first * kHeadDim + threadIdx.x; e < last * kHeadDim; e += kThreads) {
          const RowRef ref = refs[e / kHeadDim];
          shared_rows[e] = ref.valid() ? decode_channel<decltype(format)::value>(rows, ref, e % kHeadDim) : 0.0f;
        }
      });
    };
    decode_rows(a.window, 0, split);
    decode_rows(a.compressed, split, kAttentionTileRows);
    __syncthreads();

    // Scores of the warp's heads for the 32 rows: lane j ends with row j.
    float probability[kAttentionHeadsPerWarp];
    const bool row_valid = refs[lane].valid();
#pragma unroll
    for (int h = 0; h < kAttentionHeadsPerWarp; ++h) {
      float partial[kWarpSize];
#pragma unroll
      for (int j = 0; j < kWarpSize; ++j) {
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const float4 r = shared_rows4[j * (kHeadDim / 4) + c * kWarpSize + lane];
          dot += q[h][c][0] * r.x + q[h][c][1] * r.y + q[h][c][2] * r.z + q[h][c][3] * r.w;
        }
        partial[j] = dot;
      }
      const float total = reduce_scatter_rows(partial, lane);  // every lane takes part in the shuffles
      const float score = row_valid ? total * a.scale : -INFINITY;
      const float new_max = fmaxf(running_max[h], warp_max(score));
      if (new_max == -INFINITY) {  // no valid row yet
        probability[h] = 0.0f;
        continue;
      }
      const float correction = expf(running_max[h] - new_max);  // 0 while running_max is -inf
      probability[h] = row_valid ? expf(score - new_max) : 0.0f;
      running_sum[h] = running_sum[h] * correction + warp_sum(probability[h]);
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
    const bool any = running_max[h] != -INFINITY;
    const float inverse = any ? 1.0f / (running_sum[h] + expf(a.sink[head[h]] - running_max[h])) : 0.0f;
    Out* out = static_cast<Out*>(a.out) + (t * a.heads + head[h]) * kHeadDim;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const float v[4] = {acc[h][c][0] * inverse, acc[h][c][1] * inverse, acc[h][c][2] * inverse, acc[h][c][3] * inverse};
      Out* dst = out + c * 128 + lane * 4;
      if constexpr (sizeof(Out) == 2) {
        *reinterpret_cast<uint2*>(dst) = uint2{float_to_bf16_bits(v[0]) | (uint32_t{float_to_bf16_bits(v[1])} << 16),
                                               float_to_bf16_bits(v[2]) | (uint32_t{float_to_bf16_bits(v[3])} << 16)};
      } else {
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
      }
    }
  }
}

// Out: uint16_t (bf16 bits) or float.
template <int kHeadDim, class Out>
void launch_sparse_attention(const SparseAttentionLaunch& a, cudaStream_t stream) {
  constexpr size_t shared = sparse_attention_shared_bytes<kHeadDim>();
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_kernel<kHeadDim, Out>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  const dim3 grid(static_cast<unsigned>(a.tokens),
                  static_cast<unsigned>((a.heads + kAttentionHeadsPerBlock - 1) / kAttentionHeadsPerBlock));
  sparse_attention_kernel<kHeadDim, Out><<<grid, kAttentionWarps * kWarpSize, shared, stream>>>(a);
}

}  // namespace dsv4::cuda

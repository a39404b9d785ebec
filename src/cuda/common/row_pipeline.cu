#include "cuda/common/row_pipeline.h"

#include <cub/block/block_reduce.cuh>

#include <cmath>

#include "cuda/common/device_math.cuh"
#include "cuda/common/paged_rows.cuh"

namespace dsv4::cuda {

int quant_tile(RowQuantizer quant) {
  switch (quant) {
    case RowQuantizer::fp8_e4m3_32: case RowQuantizer::fp4_ue8m0_32: return 32;
    case RowQuantizer::fp8_e4m3_nope_64: return 64;
    case RowQuantizer::fp4_e4m3_16: return 16;
    case RowQuantizer::none: break;
  }
  return 1;
}

int quantized_channels(RowQuantizer quant, int dims, int rope_dim) {
  if (quant == RowQuantizer::none) return 0;
  return quant == RowQuantizer::fp8_e4m3_nope_64 ? dims - rope_dim : dims;
}

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float maybe_round(float v, bool bf16) { return bf16 ? round_to_bf16(v) : v; }

// hadamard_scale > 0: the rows are rotated by the Hadamard transform with that scale.
__global__ void __launch_bounds__(kThreads) row_pipeline_kernel(RowPipelineLaunch a, int quant_channels, int tile,
                                                                float hadamard_scale) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ float shared_inverse_rms;
  extern __shared__ float row[];  // [dims]
  const int64_t r = blockIdx.x;
  const int64_t t = r / a.heads;
  const int dims = a.dims;
  for (int c = threadIdx.x; c < dims; c += kThreads) row[c] = load_float(a.in, a.in_dtype, r * dims + c);
  __syncthreads();

  if (a.normalize) {
    double squares = 0.0;
    for (int c = threadIdx.x; c < dims; c += kThreads) squares += static_cast<double>(row[c]) * row[c];
    squares = Reduce(reduce).Sum(squares);
    if (threadIdx.x == 0) {
      const float mean = static_cast<float>(squares / static_cast<double>(dims));
      shared_inverse_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, a.eps)));
    }
    __syncthreads();
    const float inverse_rms = shared_inverse_rms;
    for (int c = threadIdx.x; c < dims; c += kThreads) {
      const float normalized = __fmul_rn(row[c], inverse_rms);
      const float weighted = a.norm_weight ? __fmul_rn(load_float(a.norm_weight, a.norm_weight_dtype, c), normalized)
                                           : normalized;
      row[c] = maybe_round(weighted, a.bf16_rounding);
    }
    __syncthreads();
  }

  const int64_t position = a.token_position ? a.token_position[t] + a.position_offset : 0;
  const bool position_valid = position >= 0 && position < a.rope_positions;
  if (a.rope_table) {
    const int pairs = a.rope_dim / 2;
    for (int i = threadIdx.x; i < pairs; i += kThreads) {
      float* pair = row + dims - a.rope_dim + 2 * i;
      if (!position_valid) {
        pair[0] = pair[1] = NAN;
        continue;
      }
      const float cosine = a.rope_table[position * a.rope_dim + i];
      const float sine = a.inverse_rope ? -a.rope_table[position * a.rope_dim + pairs + i]
                                        : a.rope_table[position * a.rope_dim + pairs + i];
      const float x = pair[0], y = pair[1];
      pair[0] = maybe_round(__fsub_rn(__fmul_rn(x, cosine), __fmul_rn(y, sine)), a.bf16_rounding);
      pair[1] = maybe_round(__fadd_rn(__fmul_rn(x, sine), __fmul_rn(y, cosine)), a.bf16_rounding);
    }
    __syncthreads();
  }

  if (hadamard_scale > 0.0f) {
    // In-place butterflies over the shared row: at stride `half`, pair p joins channels i and
    // i + half of its block of 2·half; every pair belongs to one thread within a stage.
    for (int half = 1; half < dims; half *= 2) {
      for (int p = threadIdx.x; p < dims / 2; p += kThreads) {
        const int i = (p / half) * 2 * half + p % half;
        const float x = row[i], y = row[i + half];
        row[i] = __fadd_rn(x, y);
        row[i + half] = __fsub_rn(x, y);
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < dims; c += kThreads) row[c] = maybe_round(__fmul_rn(row[c], hadamard_scale), a.bf16_rounding);
    __syncthreads();
  }

  if (a.quant != RowQuantizer::none) {
    for (int first = threadIdx.x * tile; first < quant_channels; first += kThreads * tile) {
      float* x = row + first;
      const int n = min(tile, quant_channels - first);
      switch (a.quant) {
        case RowQuantizer::fp8_e4m3_32: case RowQuantizer::fp8_e4m3_nope_64: fake_quant_fp8_ue8m0(x, x, n); break;
        case RowQuantizer::fp4_ue8m0_32: fake_quant_fp4_ue8m0(x, x, n); break;
        case RowQuantizer::fp4_e4m3_16: fake_quant_fp4_e4m3(x, x, n); break;
        case RowQuantizer::none: break;
      }
    }
    __syncthreads();
  }

  if (a.out)
    for (int c = threadIdx.x; c < dims; c += kThreads) store_float(a.out, a.out_dtype, r * dims + c, row[c]);
  if (a.slots && (position_valid || !a.rope_table)) {
    const RowRef ref = row_at_slot(a.cache, a.slots[t]);
    if (ref.valid())
      for (int i = threadIdx.x; i < encode_tile_count(a.cache.format, dims); i += kThreads) encode_tile(a.cache, ref, row, i);
  }
}

}  // namespace

void launch_row_pipeline(const RowPipelineLaunch& a, cudaStream_t stream, const char* op) {
  const int64_t rows = a.tokens * a.heads;
  if (rows == 0 || a.dims == 0) return;
  const size_t shared = static_cast<size_t>(a.dims) * sizeof(float);
  DSV4_CUDA_CHECK(cudaFuncSetAttribute(row_pipeline_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)));
  // dims^-1/2 in fp32, as the official kernel takes its scale.
  const float hadamard_scale = a.hadamard ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.dims))) : 0.0f;
  row_pipeline_kernel<<<static_cast<unsigned>(rows), kThreads, shared, stream>>>(
      a, quantized_channels(a.quant, a.dims, a.rope_dim), quant_tile(a.quant), hadamard_scale);
  check_launch(op);
}

}  // namespace dsv4::cuda

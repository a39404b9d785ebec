// What the run_linear implementations share: activation preparation (dtype conversion, optional
// fp8 act_quant) and e4m3 weight dequantization.
#include <cstdint>

#include "cuda/common/device_math.cuh"
#include "cuda/ops/projection/linear_implementations.h"

namespace dsv4::cuda {
namespace {

// x (bf16 | f32) -> the product's input dtype; with `tile` > 1 each run of `tile` channels is
// fake-quantized to fp8 (one thread per tile).
__global__ void prepare_activation_kernel(const void* x, DType x_dtype, void* out, DType out_dtype,
                                          int64_t num_tiles, int tile, bool quantize) {
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < num_tiles; t += int64_t{gridDim.x} * blockDim.x) {
    const int64_t base = t * tile;
    float values[kMaxActivationBlock];
    for (int i = 0; i < tile; ++i) values[i] = load_float(x, x_dtype, base + i);
    if (quantize) fake_quant_fp8_ue8m0(values, values, tile);
    for (int i = 0; i < tile; ++i) store_float(out, out_dtype, base + i, values[i]);
  }
}

// act_quant of tiles of a multiple of 32 channels: one warp per tile, lane l holding channels l,
// l + 32, ... (coalesced; a thread per tile reads its channels one after another, which at decode
// sizes is a chain of dependent-latency loads). The tile's amax is a max: any order gives its bits.
__global__ void quantize_activation_warp_kernel(const void* x, DType x_dtype, void* out, DType out_dtype,
                                                int64_t num_tiles, int tile) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32; t < num_tiles; t += warps) {
    const int64_t base = t * tile;
    float amax = 0.0f;
    for (int i = lane; i < tile; i += 32) {
      const float a = fabsf(load_float(x, x_dtype, base + i));
      if (a > amax) amax = a;  // NaN is ignored, as abs_max does
    }
    amax = warp_max(amax);
    const float scale = ue8m0_to_float(fp8_ue8m0_scale_byte(amax));
    for (int i = lane; i < tile; i += 32) {
      const float v = load_float(x, x_dtype, base + i);
      store_float(out, out_dtype, base + i, e4m3_to_float(float_to_e4m3(divide_rn(v, scale))) * scale);
    }
  }
}

// One block per weight row (of all groups), threads across the columns: coalesced, and the
// block-scale row is found once per row. bf16 out rounds the f32 product.
__global__ void dequantize_weight_kernel(const uint8_t* weight, const void* scale, bool ue8m0_scale,
                                         ScaleRows scale_rows, void* out, DType out_dtype, int64_t groups,
                                         int64_t rows, int cols, int block_cols) {
  const int scale_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t row = blockIdx.x; row < groups * rows; row += gridDim.x) {
    const int64_t scale_row = scale_rows.row(row / rows, row % rows) * scale_cols;
    const uint8_t* codes = weight + row * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const int64_t s = scale_row + c / block_cols;
      const float block_scale = ue8m0_scale ? ue8m0_to_float(static_cast<const uint8_t*>(scale)[s])
                                            : static_cast<const float*>(scale)[s];
      store_float(out, out_dtype, row * cols + c, e4m3_to_float(codes[c]) * block_scale);
    }
  }
}

}  // namespace

void launch_prepare_activation(const LinearParams& p, DType dtype, void* out, cudaStream_t stream) {
  const int tile = p.activation_block > 0 ? p.activation_block : 1;
  const int64_t num_tiles = p.x.numel() / tile;
  if (num_tiles == 0) return;
  constexpr int kThreads = 128;
  if (p.activation_block > 0 && tile % 32 == 0) {
    quantize_activation_warp_kernel<<<elementwise_blocks(num_tiles, kThreads / 32), kThreads, 0, stream>>>(
        p.x.data, p.x.dtype, out, dtype, num_tiles, tile);
  } else {
    prepare_activation_kernel<<<elementwise_blocks(num_tiles, kThreads), kThreads, 0, stream>>>(
        p.x.data, p.x.dtype, out, dtype, num_tiles, tile, p.activation_block > 0);
  }
  check_launch("linear");
}

void launch_convert(const void* in, DType in_dtype, void* out, DType out_dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  prepare_activation_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(in, in_dtype, out, out_dtype, n, 1,
                                                                                       false);
  check_launch("linear");
}

void launch_dequantize(const TensorView& weight, const TensorView& scale, int block_out, int block_in, void* out,
                       DType out_dtype, cudaStream_t stream, const char* op) {
  const int r = weight.rank;
  const int64_t groups = r == 3 ? weight.shape[0] : 1;
  const int64_t rows = weight.shape[r - 2];
  if (weight.numel() == 0) return;
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  const unsigned blocks = static_cast<unsigned>(groups * rows < kMaxBlocks ? groups * rows : kMaxBlocks);
  dequantize_weight_kernel<<<blocks, kThreads, 0, stream>>>(
      weight.ptr<const uint8_t>(), scale.data, scale.dtype == DType::ue8m0, scale_rows(weight, scale, block_out), out,
      out_dtype, groups, rows, static_cast<int>(weight.shape[r - 1]), block_in);
  check_launch(op);
}

}  // namespace dsv4::cuda

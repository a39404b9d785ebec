// Projections (SPEC §2.1, §6): y = x · Wᵀ with cuBLASLt, fp32 accumulation.
//
// Weights are bf16, f32, or fp8 e4m3 with block scales (V4.0: 128×128 blocks, V4.1: 32×32). FP8
// weights are dequantized on the fly to bf16 in the workspace and multiplied by a bf16 GEMM; with
// power-of-two (ue8m0) scales every dequantized weight is exact in bf16, so this equals the
// reference block-scaled fp8 GEMM up to the fp32 summation order. (Non-power-of-two f32 scales are
// rounded to bf16 in the dequantized weight.) run_dequantize_weight does the same conversion once,
// ahead of time, for engines that keep bf16 copies.
//
// The reference "fp8 GEMM" also quantizes the activation: x is fake-quantized per row in tiles of
// `activation_block` input channels to e4m3 with a ue8m0 scale (SPEC §8.2 act_quant, amax floor
// 1e-4); the fake-quantized values are exact in bf16.
#pragma once

#include <cstddef>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

// Plain: x [rows, in], weight [out, in], y [rows, out]. Grouped (the output projection wo_a):
// x [rows, groups, in], weight [groups, out, in], y [rows, groups, out]; group g of every row is
// multiplied by weight[g].
struct LinearParams {
  TensorView x;             // [rows, in] | [rows, groups, in] bf16 | f32
  TensorView weight;        // [out, in] | [groups, out, in] bf16 | f32 | e4m3
  TensorView weight_scale;  // e4m3 weights only: [ceil(out/block_out), ceil(in/block_in)] (grouped: leading [groups]) ue8m0 | f32
  int block_out = 128;      // rows of one weight-scale block
  int block_in = 128;       // columns of one weight-scale block
  int activation_block = 0; // > 0: fp8 fake-quantize x in tiles of this many input channels (divides in)
  TensorView y;             // [rows, out] | [rows, groups, out] bf16 | f32
  const BlasLt* blas = nullptr;  // cuBLASLt handle and workspace of the stream run_linear is given
};
// Compute precision: a f32 weight gives a f32 GEMM (x converted to f32); bf16 and e4m3 weights a
// bf16 GEMM (x rounded to bf16). y is written in its own dtype.

void validate_linear(const LinearParams& p);
// The activation copy and dequantized weight run_linear stages (0 for bf16 x and weights); cuBLASLt's
// own workspace is the BlasLt's.
size_t linear_workspace_bytes(const LinearParams& p);
void run_linear(const LinearParams& p, void* workspace, cudaStream_t stream);

// e4m3 weight + block scales -> bf16 weight (exact for power-of-two scales).
struct DequantizeWeightParams {
  TensorView weight;        // [out, in] | [groups, out, in] e4m3
  TensorView weight_scale;  // [ceil(out/block_out), ceil(in/block_in)] (grouped: leading [groups]) ue8m0 | f32
  int block_out = 128;
  int block_in = 128;
  TensorView out;           // like weight, bf16
};

void validate_dequantize_weight(const DequantizeWeightParams& p);
void run_dequantize_weight(const DequantizeWeightParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda

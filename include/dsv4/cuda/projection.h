// Projections (SPEC §2.1, §6): y = x · Wᵀ with fp32 accumulation.
//
// Weights are bf16, f32, or fp8 e4m3 with block scales (V4.0: 128×128 blocks, V4.1: 32×32), kept
// as they are: fp8 weights are never copied to bf16 ahead of time. Two implementations multiply
// them (the dispatch seam, src/cuda/ops/projection/linear_implementations.h):
//  * "fp8_decode", for up to kLinearFp8DecodeMaxRows rows (decode steps): a tensor-core GEMM that
//    streams the e4m3 tiles and converts them to bf16 in registers with their block scale (exact
//    for power-of-two scales; a non-power-of-two f32 scale's product is rounded to bf16), so each
//    weight byte is read once per call;
//  * "cublaslt", every call: e4m3 weights are dequantized into the workspace (to bf16, or f32 for
//    an f32 product) and multiplied by a cuBLASLt GEMM; bf16 and f32 weights directly.
// Either equals the reference block-scaled fp8 GEMM up to the fp32 summation order.
// run_dequantize_weight does the bf16 conversion once, ahead of time, for callers that want it.
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
  // e4m3 weights only: [ceil(out/block_out), ceil(in/block_in)] ue8m0 | f32. Grouped weights:
  // [groups, ceil(out/block_out), ceil(in/block_in)] (blocks per group), or the checkpoint's
  // [ceil(groups·out/block_out), ceil(in/block_in)] (blocks over the groups' rows as one matrix).
  TensorView weight_scale;
  int block_out = 128;      // rows of one weight-scale block
  int block_in = 128;       // columns of one weight-scale block
  int activation_block = 0; // > 0: fp8 fake-quantize x in tiles of this many input channels (divides in)
  // e4m3 weights: dequantize to f32 and multiply in fp32, x kept in f32 (Precision::fp32).
  bool f32_product = false;
  TensorView y;             // [rows, out] | [rows, groups, out] bf16 | f32
  const BlasLt* blas = nullptr;  // cuBLASLt handle and workspace of the stream run_linear is given
};
// Compute precision: a f32 weight, or an e4m3 weight with f32_product, gives a f32 GEMM (x
// converted to f32); bf16 and other e4m3 weights a bf16 GEMM (x rounded to bf16). y is written in
// its own dtype.

// The most rows the fp8_decode implementation takes. At 64 rows a weight byte carries 64
// multiply-adds: at the HBM rate (4.2 TB/s) that is about 540 TFLOP/s, where mma.sync's bf16 rate
// (about 2/3 of wgmma's) runs out; beyond it the call is compute-bound and the fallback's cuBLASLt
// (wgmma) GEMM wins despite its dequantization pass (5 bytes moved per weight instead of 1).
// To be confirmed by `dsv4 bench --op linear-decode` against `--op linear` at 65 rows.
inline constexpr int64_t kLinearFp8DecodeMaxRows = 64;

void validate_linear(const LinearParams& p);
// What any implementation stages for the call (the activation copy, a dequantized weight, split-K
// partial sums; 0 for bf16 x and weights), so the size needs no device. cuBLASLt's own workspace
// is the BlasLt's.
size_t linear_workspace_bytes(const LinearParams& p);
void run_linear(const LinearParams& p, void* workspace, cudaStream_t stream);
// The name of the implementation run_linear picks for this call on the current device.
const char* linear_implementation(const LinearParams& p);

// e4m3 weight + block scales -> bf16 weight (exact for power-of-two scales).
struct DequantizeWeightParams {
  TensorView weight;        // [out, in] | [groups, out, in] e4m3
  TensorView weight_scale;  // as LinearParams::weight_scale
  int block_out = 128;
  int block_in = 128;
  TensorView out;           // like weight, bf16
};

void validate_dequantize_weight(const DequantizeWeightParams& p);
void run_dequantize_weight(const DequantizeWeightParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda

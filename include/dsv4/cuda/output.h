// The output path's first half (SPEC §6.1-6.2): inverse RoPE of the attention output at the
// query position, then the grouped low-rank projection wo_a (group g = heads g·H/G … (g+1)·H/G − 1,
// contiguous). The second half, wo_b, is a plain run_linear on y viewed as [tokens, groups·rank].
#pragma once

#include <cstddef>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

struct OutputProjectionParams {
  TensorView o;               // [tokens, heads, head_dim] bf16 | f32 (attention output)
  TensorView token_position;  // [tokens] i32
  TensorView rope_table;      // [max_positions, rope_dim] f32 (the layer's table)
  TensorView wo_a;            // [groups, rank, heads / groups · head_dim] bf16 | f32 | e4m3
  // e4m3 only: [groups, ceil(rank / block_out), ceil(in / block_in)], or the checkpoint's
  // [ceil(groups · rank / block_out), ceil(in / block_in)] (LinearParams::weight_scale) ue8m0 | f32
  TensorView wo_a_scale;
  int block_out = 128;
  int block_in = 128;
  bool f32_product = false;   // e4m3 wo_a: multiplied in fp32 (LinearParams::f32_product)
  TensorView y;               // [tokens, groups, rank] bf16 | f32
  const BlasLt* blas = nullptr;
};
// The un-rotated o is kept in bf16 when y is bf16 (the reference rounds it), else in f32.

void validate_output_projection(const OutputProjectionParams& p);
size_t output_projection_workspace_bytes(const OutputProjectionParams& p);
void run_output_projection(const OutputProjectionParams& p, void* workspace, cudaStream_t stream);

}  // namespace dsv4::cuda

// Inverse RoPE (row pipeline) into the workspace, then the grouped run_linear.
#include "cuda/common/check_args.h"
#include "cuda/common/row_pipeline.h"
#include "dsv4/cuda/output.h"
#include "dsv4/cuda/projection.h"

namespace dsv4::cuda {
namespace {

DType rotated_dtype(const OutputProjectionParams& p) { return p.y.dtype == DType::bf16 ? DType::bf16 : DType::f32; }

size_t rotated_bytes(const OutputProjectionParams& p) {
  return align_workspace(static_cast<size_t>(p.o.numel()) * dtype_size(rotated_dtype(p)));
}

// The grouped projection on the rotated o stored at `rotated`.
LinearParams grouped_projection(const OutputProjectionParams& p, void* rotated) {
  const int64_t tokens = p.o.shape[0], groups = p.wo_a.shape[0];
  const int64_t in = groups > 0 ? p.o.shape[1] / groups * p.o.shape[2] : 0;
  return {.x = TensorView::contiguous(rotated, rotated_dtype(p), {tokens, groups, in}, Device::cuda, p.o.device_index),
          .weight = p.wo_a, .weight_scale = p.wo_a_scale, .block_out = p.block_out, .block_in = p.block_in,
          .f32_product = p.f32_product, .y = p.y, .blas = p.blas};
}

}  // namespace

void validate_output_projection(const OutputProjectionParams& p) {
  constexpr const char* op = "output_projection";
  const int64_t tokens = p.o.shape[0], heads = p.o.shape[1], dims = p.o.shape[2];
  const int64_t groups = p.wo_a.shape[0], rank = p.wo_a.shape[1];
  check_tensors(op, {
      {"o", &p.o, {kAnyDim, kAnyDim, kAnyDim}, {DType::bf16, DType::f32}},
      {"token_position", &p.token_position, {tokens}, {DType::i32}},
      {"rope_table", &p.rope_table, {kAnyDim, kAnyDim}, {DType::f32}},
      {"wo_a", &p.wo_a, {kAnyDim, kAnyDim, groups > 0 ? heads / groups * dims : kAnyDim},
       {DType::bf16, DType::f32, DType::e4m3}},
      {"y", &p.y, {tokens, groups, rank}, {DType::bf16, DType::f32}},
  });
  DSV4_CHECK(groups >= 1 && heads % groups == 0, op, ": ", heads, " heads do not split into ", groups,
             " groups (wo_a has shape ", p.wo_a.shape_string(), ")");
  DSV4_CHECK(p.rope_table.shape[1] % 2 == 0 && p.rope_table.shape[1] <= dims, op, ": argument 'rope_table' has ",
             p.rope_table.shape[1], " columns, expected an even rope_dim <= ", dims);
  validate_linear(grouped_projection(p, p.o.data));
}

size_t output_projection_workspace_bytes(const OutputProjectionParams& p) {
  validate_output_projection(p);
  return rotated_bytes(p) + linear_workspace_bytes(grouped_projection(p, p.o.data));
}

void run_output_projection(const OutputProjectionParams& p, void* workspace, cudaStream_t stream) {
  validate_output_projection(p);
  check_workspace("output_projection", workspace);
  RowPipelineLaunch a;
  a.set_input(p.o);
  a.set_rope(p.rope_table, p.token_position);
  a.inverse_rope = true;
  a.bf16_rounding = rotated_dtype(p) == DType::bf16;
  a.out = workspace;
  a.out_dtype = rotated_dtype(p);
  launch_row_pipeline(a, stream, "output_projection");
  run_linear(grouped_projection(p, workspace), static_cast<std::byte*>(workspace) + rotated_bytes(p), stream);
}

}  // namespace dsv4::cuda

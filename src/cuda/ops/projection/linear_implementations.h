// The implementations of run_linear and their chooser (the dispatch seam, dispatch.h), plus what
// they share: the call's sizes, the activation preparation (dtype conversion, act_quant) and the
// e4m3 weight dequantization. Adding an implementation: a folder next to cublaslt/ that defines a
// LinearImplementation, declared below and listed in linear.cpp ahead of the ones it should win over.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "cuda/common/dispatch.h"
#include "dsv4/cuda/projection.h"

namespace dsv4::cuda {

struct LinearImplementation {
  const char* name;
  // "" when the implementation runs this (validated) call on `device`, else why not.
  std::string (*supports)(const LinearParams& p, const DeviceInfo& device);
  // Workspace the call needs (0: none); callable for any validated call, no device needed.
  size_t (*workspace_bytes)(const LinearParams& p);
  // A validated call with rows, groups, out and in all > 0; workspace: workspace_bytes(p) bytes,
  // 256-aligned (null when 0).
  void (*run)(const LinearParams& p, void* workspace, cudaStream_t stream);
};

// fp8 e4m3 weights at up to kLinearFp8DecodeMaxRows rows: tensor cores (mma.sync bf16, sm_80+),
// weight tiles converted in registers (fp8_decode/).
extern const LinearImplementation kLinearFp8Decode;
// Every call: cuBLASLt, e4m3 weights dequantized into the workspace first (cublaslt/).
extern const LinearImplementation kLinearCublasLt;

// In order of preference; the chooser takes the first that supports the call.
std::span<const LinearImplementation* const> linear_implementations();
const LinearImplementation& choose_linear(const LinearParams& p, const DeviceInfo& device);

// Sizes of a plain or grouped projection, read from validated params.
struct LinearShape {
  bool grouped;
  int64_t rows, groups, in, out;
};
LinearShape linear_shape(const LinearParams& p);

// The dtype the product's inputs are in: f32 for an f32 weight or an f32 product, else bf16.
DType linear_product_dtype(const LinearParams& p);

// The largest activation_block (the preparation keeps one tile in registers).
inline constexpr int kMaxActivationBlock = 128;

// Whether x must be staged (converted to `dtype`, fake-quantized when activation_block > 0)
// before the product reads it, and the bytes of the staged copy (0 when not).
bool needs_activation_copy(const LinearParams& p, DType dtype);
size_t activation_copy_bytes(const LinearParams& p, DType dtype);
// x -> `out` [rows, groups, in] in `dtype`, fake-quantized in activation_block tiles when > 0.
void launch_prepare_activation(const LinearParams& p, DType dtype, void* out, cudaStream_t stream);

// n values in_dtype -> out_dtype (bf16 rounds to nearest even).
void launch_convert(const void* in, DType in_dtype, void* out, DType out_dtype, int64_t n, cudaStream_t stream);

// e4m3 weight [groups?, out, in] with its block scales (LinearParams::weight_scale's layouts) ->
// `out` in bf16 (the product rounded) or f32.
void launch_dequantize(const TensorView& weight, const TensorView& scale, int block_out, int block_in, void* out,
                       DType out_dtype, cudaStream_t stream, const char* op);

// Where the block scale of weight row (group g, row o) starts: scales are
// scale[scale_row(g, o) * scale_cols + c / block_in].
struct ScaleRows {
  bool per_group = true;  // [groups, scale_rows_per_group, cols] rather than the flat checkpoint layout
  int64_t rows_per_group = 0;
  int64_t out = 0;
  int block_out = 1;
  DSV4_HD int64_t row(int64_t g, int64_t o) const {
    return per_group ? g * rows_per_group + o / block_out : (g * out + o) / block_out;
  }
};
ScaleRows scale_rows(const TensorView& weight, const TensorView& scale, int block_out);

}  // namespace dsv4::cuda

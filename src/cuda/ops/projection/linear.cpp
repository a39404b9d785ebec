// run_linear: validation, then the chooser picks an implementation (linear_implementations.h).
#include <algorithm>
#include <vector>

#include "cuda/common/check_args.h"
#include "cuda/ops/projection/linear_implementations.h"

namespace dsv4::cuda {
namespace {

// Implementations in order of preference; the cuBLASLt fallback last.
constexpr const LinearImplementation* kImplementations[] = {&kLinearFp8Decode, &kLinearCublasLt};

void check_weight_scale_args(const char* op, const TensorView& weight, const TensorView& scale, int block_out,
                             int block_in) {
  if (weight.dtype == DType::e4m3) {
    DSV4_CHECK(is_present(scale), op, ": argument 'weight_scale' is missing; an e4m3 weight needs its block scales");
    DSV4_CHECK(block_out > 0 && block_in > 0, op, ": block_out ", block_out, " and block_in ", block_in,
               " must be positive for an e4m3 weight");
  } else {
    DSV4_CHECK(!is_present(scale), op, ": argument 'weight_scale' is given for a ", dtype_name(weight.dtype),
               " weight; only e4m3 weights have block scales");
  }
}

// The expected scale shape: per group for a rank-3 scale of a grouped weight, else the flat
// [ceil(rows/block_out), ceil(in/block_in)] over all the weight's rows.
std::vector<int64_t> scale_shape(const TensorView& weight, const TensorView& scale, int block_out, int block_in) {
  const int r = weight.rank;
  if (r < 2) return {kAnyDim, kAnyDim};  // the weight's own rank check reports this first
  const int64_t out = weight.shape[r - 2], in = weight.shape[r - 1];
  const bool per_group = r == 3 && scale.rank == 3;
  const int64_t rows = r == 3 && !per_group ? weight.shape[0] * out : out;
  std::vector<int64_t> shape;
  if (per_group) shape.push_back(weight.shape[0]);
  shape.push_back(block_out > 0 ? (rows + block_out - 1) / block_out : kAnyDim);
  shape.push_back(block_in > 0 ? (in + block_in - 1) / block_in : kAnyDim);
  return shape;
}

}  // namespace

LinearShape linear_shape(const LinearParams& p) {
  const bool grouped = p.x.rank == 3;
  return {grouped, p.x.shape[0], grouped ? p.x.shape[1] : 1, p.x.shape[p.x.rank - 1],
          p.weight.shape[p.weight.rank - 2]};
}

DType linear_product_dtype(const LinearParams& p) {
  return p.weight.dtype == DType::f32 || p.f32_product ? DType::f32 : DType::bf16;
}

bool needs_activation_copy(const LinearParams& p, DType dtype) {
  return p.activation_block > 0 || p.x.dtype != dtype;
}

size_t activation_copy_bytes(const LinearParams& p, DType dtype) {
  return needs_activation_copy(p, dtype) ? align_workspace(static_cast<size_t>(p.x.numel()) * dtype_size(dtype)) : 0;
}

ScaleRows scale_rows(const TensorView& weight, const TensorView& scale, int block_out) {
  const int r = weight.rank;
  const bool per_group = r != 3 || scale.rank == 3;
  return {per_group, per_group ? scale.shape[scale.rank - 2] : 0, weight.shape[r - 2], block_out};
}

void validate_linear(const LinearParams& p) {
  constexpr const char* op = "linear";
  DSV4_CHECK(p.x.rank == 2 || p.x.rank == 3, op, ": argument 'x' has rank ", p.x.rank,
             ", expected 2 ([rows, in]) or 3 ([rows, groups, in])");
  check_weight_scale_args(op, p.weight, p.weight_scale, p.block_out, p.block_in);
  const bool grouped = p.x.rank == 3;
  const int64_t rows = p.x.shape[0], in = p.x.shape[p.x.rank - 1];
  const int64_t groups = grouped ? p.x.shape[1] : 1;
  const int64_t out = p.weight.shape[grouped ? 1 : 0];
  auto with_groups = [&](std::vector<int64_t> tail) {
    if (grouped) tail.insert(tail.begin(), groups);
    return tail;
  };
  std::vector<int64_t> y_shape = with_groups({out});
  y_shape.insert(y_shape.begin(), rows);
  check_tensors(op, {
      {"x", &p.x, std::vector<int64_t>(p.x.rank, kAnyDim), {DType::bf16, DType::f32}},
      {"weight", &p.weight, with_groups({kAnyDim, in}), {DType::bf16, DType::f32, DType::e4m3}},
      {"weight_scale", &p.weight_scale, scale_shape(p.weight, p.weight_scale, p.block_out, p.block_in),
       {DType::ue8m0, DType::f32}, true},
      {"y", &p.y, y_shape, {DType::bf16, DType::f32}},
  });
  DSV4_CHECK(p.activation_block >= 0 && p.activation_block <= kMaxActivationBlock, op, ": activation_block ",
             p.activation_block, " is outside [0, ", kMaxActivationBlock, "]");
  DSV4_CHECK(p.activation_block == 0 || in % p.activation_block == 0, op, ": activation_block ", p.activation_block,
             " does not divide the input size ", in);
  DSV4_CHECK(!p.f32_product || p.weight.dtype != DType::bf16, op,
             ": f32_product is set for a BF16 weight; give the weight as F32 for an fp32 product");
  DSV4_CHECK(in <= INT32_MAX, op, ": ", in, " input channels exceed the supported ", INT32_MAX);
  DSV4_CHECK(p.blas != nullptr, op, ": argument 'blas' is null (pass the BlasLt of the stream)");
}

std::span<const LinearImplementation* const> linear_implementations() { return kImplementations; }

const LinearImplementation& choose_linear(const LinearParams& p, const DeviceInfo& device) {
  return choose_implementation("linear", linear_implementations(), p, device);
}

const char* linear_implementation(const LinearParams& p) {
  validate_linear(p);
  return choose_linear(p, device_info()).name;
}

// The workspace covers whichever implementation the device picks, so its size needs no device.
size_t linear_workspace_bytes(const LinearParams& p) {
  validate_linear(p);
  size_t most = 0;
  for (const LinearImplementation* implementation : linear_implementations())
    most = std::max(most, implementation->workspace_bytes(p));
  return most;
}

void run_linear(const LinearParams& p, void* workspace, cudaStream_t stream) {
  validate_linear(p);
  const LinearShape s = linear_shape(p);
  if (s.rows == 0 || s.out == 0 || s.groups == 0) return;
  if (s.in == 0) {
    DSV4_CUDA_CHECK(cudaMemsetAsync(p.y.data, 0, static_cast<size_t>(p.y.numel()) * dtype_size(p.y.dtype), stream));
    return;
  }
  const LinearImplementation& implementation = choose_linear(p, device_info());
  if (implementation.workspace_bytes(p) > 0) check_workspace("linear", workspace);
  implementation.run(p, workspace, stream);
}

void validate_dequantize_weight(const DequantizeWeightParams& p) {
  constexpr const char* op = "dequantize_weight";
  DSV4_CHECK(p.weight.rank == 2 || p.weight.rank == 3, op, ": argument 'weight' has rank ", p.weight.rank,
             ", expected 2 ([out, in]) or 3 ([groups, out, in])");
  DSV4_CHECK(p.block_out > 0 && p.block_in > 0, op, ": block_out ", p.block_out, " and block_in ", p.block_in,
             " must be positive");
  check_tensors(op, {
      {"weight", &p.weight, std::vector<int64_t>(p.weight.rank, kAnyDim), {DType::e4m3}},
      {"weight_scale", &p.weight_scale, scale_shape(p.weight, p.weight_scale, p.block_out, p.block_in),
       {DType::ue8m0, DType::f32}},
      {"out", &p.out, std::vector<int64_t>(p.weight.shape.begin(), p.weight.shape.begin() + p.weight.rank), {DType::bf16}},
  });
  DSV4_CHECK(p.weight.shape[p.weight.rank - 1] <= INT32_MAX, op, ": ", p.weight.shape[p.weight.rank - 1],
             " input channels exceed the supported ", INT32_MAX);
}

void run_dequantize_weight(const DequantizeWeightParams& p, cudaStream_t stream) {
  validate_dequantize_weight(p);
  launch_dequantize(p.weight, p.weight_scale, p.block_out, p.block_in, p.out.data, DType::bf16, stream,
                    "dequantize_weight");
}

}  // namespace dsv4::cuda

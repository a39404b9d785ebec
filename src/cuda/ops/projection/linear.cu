// Projections: activation preparation (dtype conversion, optional fp8 act_quant), fp8 weight
// dequantization, and the (grouped) cuBLASLt GEMM.
#include <cublasLt.h>

#include <cstdint>
#include <memory>

#include "cuda/common/check_args.h"
#include "cuda/common/device_math.cuh"
#include "dsv4/cuda/projection.h"

namespace dsv4::cuda {
namespace {

constexpr int kMaxActivationBlock = 128;

// x (bf16 | f32) -> the GEMM's input dtype; with `tile` > 1 each run of `tile` channels is
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

// One block per weight row (of all groups), threads across the columns: coalesced, and the
// block-scale row is found once per row.
__global__ void dequantize_weight_kernel(const uint8_t* weight, const void* scale, bool ue8m0_scale,
                                         uint16_t* out, int64_t groups, int64_t rows, int cols,
                                         int block_rows, int block_cols) {
  const int64_t scale_rows = (rows + block_rows - 1) / block_rows;
  const int scale_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t row = blockIdx.x; row < groups * rows; row += gridDim.x) {
    const int64_t scale_row = ((row / rows) * scale_rows + (row % rows) / block_rows) * scale_cols;
    const uint8_t* codes = weight + row * cols;
    uint16_t* values = out + row * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const int64_t s = scale_row + c / block_cols;
      const float block_scale = ue8m0_scale ? ue8m0_to_float(static_cast<const uint8_t*>(scale)[s])
                                            : static_cast<const float*>(scale)[s];
      values[c] = float_to_bf16_bits(e4m3_to_float(codes[c]) * block_scale);
    }
  }
}

// Sizes of a plain or grouped projection, read from validated params.
struct LinearShape {
  bool grouped;
  int64_t rows, groups, in, out;
};

LinearShape linear_shape(const LinearParams& p) {
  const bool grouped = p.x.rank == 3;
  return {grouped, p.x.shape[0], grouped ? p.x.shape[1] : 1, p.x.shape[p.x.rank - 1],
          p.weight.shape[p.weight.rank - 2]};
}

DType gemm_input_dtype(const LinearParams& p) { return p.weight.dtype == DType::f32 ? DType::f32 : DType::bf16; }

bool needs_activation_copy(const LinearParams& p) {
  return p.activation_block > 0 || p.x.dtype != gemm_input_dtype(p);
}

size_t activation_copy_bytes(const LinearParams& p, const LinearShape& s) {
  return needs_activation_copy(p) ? align_workspace(static_cast<size_t>(s.rows * s.groups * s.in) * dtype_size(gemm_input_dtype(p))) : 0;
}

size_t dequantized_weight_bytes(const LinearParams& p, const LinearShape& s) {
  return p.weight.dtype == DType::e4m3 ? align_workspace(static_cast<size_t>(s.groups * s.out * s.in) * 2) : 0;
}

cudaDataType_t cuda_data_type(DType t) { return t == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("linear: ", what, " failed: ", cublasLtGetStatusName(status), ": ", cublasLtGetStatusString(status));
}

struct MatmulDescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using LayoutPtr = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, LayoutDeleter>;

// A column-major rows x cols layout with leading dimension ld, repeated `batch` times every
// `batch_stride` elements.
LayoutPtr make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  check_blas(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
             "cublasLtMatrixLayoutCreate");
  LayoutPtr owned(layout);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    check_blas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
               "setting the batch count");
    check_blas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
                                                sizeof(batch_stride)),
               "setting the batch stride");
  }
  return owned;
}

// Row-major y[rows, groups, out] = x[rows, groups, in] · w[groups, out, in]ᵀ, as the column-major
// product yᵀ = op(w)·xᵀ per group: A = w (transposed), B = x, D = y with the group interleaving in
// the leading dimensions.
void gemm(const LinearParams& p, const LinearShape& s, const void* x, const void* w, DType input_dtype,
          cudaStream_t stream) {
  cublasLtMatmulDesc_t desc_raw = nullptr;
  check_blas(cublasLtMatmulDescCreate(&desc_raw, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter> desc(desc_raw);
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  check_blas(cublasLtMatmulDescSetAttribute(desc_raw, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
             "setting TRANSA");
  check_blas(cublasLtMatmulDescSetAttribute(desc_raw, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "setting TRANSB");

  const cudaDataType_t in_type = cuda_data_type(input_dtype), out_type = cuda_data_type(p.y.dtype);
  LayoutPtr a = make_layout(in_type, s.in, s.out, s.in, s.groups, s.out * s.in);
  LayoutPtr b = make_layout(in_type, s.in, s.rows, s.groups * s.in, s.groups, s.in);
  LayoutPtr d = make_layout(out_type, s.out, s.rows, s.groups * s.out, s.groups, s.out);

  cublasLtMatmulPreference_t pref_raw = nullptr;
  check_blas(cublasLtMatmulPreferenceCreate(&pref_raw), "cublasLtMatmulPreferenceCreate");
  std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter> pref(pref_raw);
  const uint64_t max_workspace = BlasLt::kWorkspaceBytes;
  check_blas(cublasLtMatmulPreferenceSetAttribute(pref_raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                                  sizeof(max_workspace)),
             "setting the workspace limit");
  // The heuristic's first choice, split-K included: cuBLASLt reduces the splits in a fixed order
  // (cublasLt.h: in place with counters "to guarantee the sequentiality", or in a separate step),
  // and projection_cuda_test repeats the decode-shaped GEMMs to hold it to that. Excluding split-K
  // cost 1.7-2x in a decode layer step (bench/RESULTS.md).
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  check_blas(cublasLtMatmulAlgoGetHeuristic(p.blas->get(), desc_raw, a.get(), b.get(), d.get(), d.get(), pref_raw, 1,
                                            &heuristic, &found),
             "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0)
    fail("linear: cuBLASLt has no algorithm for rows ", s.rows, ", groups ", s.groups, ", in ", s.in, ", out ", s.out,
         " (", dtype_name(input_dtype), " -> ", dtype_name(p.y.dtype), ")");
  const float alpha = 1.0f, beta = 0.0f;
  check_blas(cublasLtMatmul(p.blas->get(), desc_raw, &alpha, w, a.get(), x, b.get(), &beta, p.y.data, d.get(), p.y.data,
                            d.get(), &heuristic.algo, p.blas->workspace(), BlasLt::kWorkspaceBytes, stream),
             "cublasLtMatmul");
}

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

std::vector<int64_t> scale_shape(const TensorView& weight, int block_out, int block_in) {
  const int r = weight.rank;
  if (r < 2) return {kAnyDim, kAnyDim};  // the weight's own rank check reports this first
  const int64_t out = weight.shape[r - 2], in = weight.shape[r - 1];
  std::vector<int64_t> shape;
  if (r == 3) shape.push_back(weight.shape[0]);
  shape.push_back(block_out > 0 ? (out + block_out - 1) / block_out : kAnyDim);
  shape.push_back(block_in > 0 ? (in + block_in - 1) / block_in : kAnyDim);
  return shape;
}

void launch_dequantize(const TensorView& weight, const TensorView& scale, int block_out, int block_in, void* out,
                       cudaStream_t stream, const char* op) {
  const int r = weight.rank;
  const int64_t groups = r == 3 ? weight.shape[0] : 1;
  const int64_t rows = weight.shape[r - 2];
  if (weight.numel() == 0) return;
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  const unsigned blocks = static_cast<unsigned>(groups * rows < kMaxBlocks ? groups * rows : kMaxBlocks);
  dequantize_weight_kernel<<<blocks, kThreads, 0, stream>>>(
      weight.ptr<const uint8_t>(), scale.data, scale.dtype == DType::ue8m0, static_cast<uint16_t*>(out), groups,
      rows, static_cast<int>(weight.shape[r - 1]), block_out, block_in);
  check_launch(op);
}

}  // namespace

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
      {"weight_scale", &p.weight_scale, scale_shape(p.weight, p.block_out, p.block_in), {DType::ue8m0, DType::f32}, true},
      {"y", &p.y, y_shape, {DType::bf16, DType::f32}},
  });
  DSV4_CHECK(p.activation_block >= 0 && p.activation_block <= kMaxActivationBlock, op, ": activation_block ",
             p.activation_block, " is outside [0, ", kMaxActivationBlock, "]");
  DSV4_CHECK(p.activation_block == 0 || in % p.activation_block == 0, op, ": activation_block ", p.activation_block,
             " does not divide the input size ", in);
  DSV4_CHECK(in <= INT32_MAX, op, ": ", in, " input channels exceed the supported ", INT32_MAX);
  DSV4_CHECK(p.blas != nullptr, op, ": argument 'blas' is null (pass the BlasLt of the stream)");
}

size_t linear_workspace_bytes(const LinearParams& p) {
  validate_linear(p);
  const LinearShape s = linear_shape(p);
  return activation_copy_bytes(p, s) + dequantized_weight_bytes(p, s);
}

void run_linear(const LinearParams& p, void* workspace, cudaStream_t stream) {
  validate_linear(p);
  const LinearShape s = linear_shape(p);
  if (s.rows == 0 || s.out == 0 || s.groups == 0) return;
  const size_t y_bytes = static_cast<size_t>(p.y.numel()) * dtype_size(p.y.dtype);
  if (s.in == 0) {
    DSV4_CUDA_CHECK(cudaMemsetAsync(p.y.data, 0, y_bytes, stream));
    return;
  }
  if (activation_copy_bytes(p, s) + dequantized_weight_bytes(p, s) > 0) check_workspace("linear", workspace);
  auto* cursor = static_cast<std::byte*>(workspace);
  const DType input_dtype = gemm_input_dtype(p);

  const void* x = p.x.data;
  if (needs_activation_copy(p)) {
    const int tile = p.activation_block > 0 ? p.activation_block : 1;
    const int64_t num_tiles = s.rows * s.groups * s.in / tile;
    constexpr int kThreads = 128;
    prepare_activation_kernel<<<elementwise_blocks(num_tiles, kThreads), kThreads, 0, stream>>>(
        p.x.data, p.x.dtype, cursor, input_dtype, num_tiles, tile, p.activation_block > 0);
    check_launch("linear");
    x = cursor;
    cursor += activation_copy_bytes(p, s);
  }
  const void* w = p.weight.data;
  if (p.weight.dtype == DType::e4m3) {
    launch_dequantize(p.weight, p.weight_scale, p.block_out, p.block_in, cursor, stream, "linear");
    w = cursor;
    cursor += dequantized_weight_bytes(p, s);
  }
  gemm(p, s, x, w, input_dtype, stream);
}

void validate_dequantize_weight(const DequantizeWeightParams& p) {
  constexpr const char* op = "dequantize_weight";
  DSV4_CHECK(p.weight.rank == 2 || p.weight.rank == 3, op, ": argument 'weight' has rank ", p.weight.rank,
             ", expected 2 ([out, in]) or 3 ([groups, out, in])");
  DSV4_CHECK(p.block_out > 0 && p.block_in > 0, op, ": block_out ", p.block_out, " and block_in ", p.block_in,
             " must be positive");
  check_tensors(op, {
      {"weight", &p.weight, std::vector<int64_t>(p.weight.rank, kAnyDim), {DType::e4m3}},
      {"weight_scale", &p.weight_scale, scale_shape(p.weight, p.block_out, p.block_in), {DType::ue8m0, DType::f32}},
      {"out", &p.out, std::vector<int64_t>(p.weight.shape.begin(), p.weight.shape.begin() + p.weight.rank), {DType::bf16}},
  });
  DSV4_CHECK(p.weight.shape[p.weight.rank - 1] <= INT32_MAX, op, ": ", p.weight.shape[p.weight.rank - 1],
             " input channels exceed the supported ", INT32_MAX);
}

void run_dequantize_weight(const DequantizeWeightParams& p, cudaStream_t stream) {
  validate_dequantize_weight(p);
  launch_dequantize(p.weight, p.weight_scale, p.block_out, p.block_in, p.out.data, stream, "dequantize_weight");
}

}  // namespace dsv4::cuda

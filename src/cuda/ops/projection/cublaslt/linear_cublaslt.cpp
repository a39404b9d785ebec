// The cuBLASLt implementation of run_linear ("cublaslt"): x staged in the product's dtype when it
// must be (conversion, act_quant), e4m3 weights dequantized into the workspace, then one (grouped)
// cuBLASLt GEMM with fp32 accumulation; the algorithm is chosen once per shape (BlasLt).
#include <cublasLt.h>

#include <cstring>
#include <memory>

#include "cuda/ops/projection/linear_implementations.h"

namespace dsv4::cuda {
namespace {

static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(BlasLtAlgorithm), "BlasLtAlgorithm holds a cublasLtMatmulAlgo_t");

constexpr int kLinearLayout = 1;  // BlasLtMatmulKey::layout of run_linear's row-major x · weightᵀ

size_t dequantized_weight_bytes(const LinearParams& p) {
  return p.weight.dtype == DType::e4m3
             ? align_workspace(static_cast<size_t>(p.weight.numel()) * dtype_size(linear_product_dtype(p)))
             : 0;
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
// the leading dimensions. CUBLAS_COMPUTE_32F is true fp32 for f32 inputs (no TF32: that would be
// CUBLAS_COMPUTE_32F_FAST_TF32).
void gemm(const LinearParams& p, const LinearShape& s, const void* x, const void* w, DType input_dtype, void* y,
          DType y_dtype, cudaStream_t stream) {
  cublasLtMatmulDesc_t desc_raw = nullptr;
  check_blas(cublasLtMatmulDescCreate(&desc_raw, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  std::unique_ptr<cublasLtMatmulDescOpaque_t, MatmulDescDeleter> desc(desc_raw);
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  check_blas(cublasLtMatmulDescSetAttribute(desc_raw, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
             "setting TRANSA");
  check_blas(cublasLtMatmulDescSetAttribute(desc_raw, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "setting TRANSB");

  const cudaDataType_t in_type = cuda_data_type(input_dtype), out_type = cuda_data_type(y_dtype);
  LayoutPtr a = make_layout(in_type, s.in, s.out, s.in, s.groups, s.out * s.in);
  LayoutPtr b = make_layout(in_type, s.in, s.rows, s.groups * s.in, s.groups, s.in);
  LayoutPtr d = make_layout(out_type, s.out, s.rows, s.groups * s.out, s.groups, s.out);

  // The heuristic's first choice, split-K included: cuBLASLt reduces the splits in a fixed order
  // (cublasLt.h: in place with counters "to guarantee the sequentiality", or in a separate step),
  // and projection_cuda_test repeats the decode-shaped GEMMs to hold it to that. Excluding split-K
  // cost 1.7-2x in a decode layer step (bench/RESULTS.md). Asked once per shape.
  const BlasLtMatmulKey key{kLinearLayout, s.rows, s.groups, s.in, s.out, input_dtype, y_dtype};
  const BlasLtAlgorithm chosen = p.blas->algorithm(key, [&] {
    cublasLtMatmulPreference_t pref_raw = nullptr;
    check_blas(cublasLtMatmulPreferenceCreate(&pref_raw), "cublasLtMatmulPreferenceCreate");
    std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter> pref(pref_raw);
    const uint64_t max_workspace = BlasLt::kWorkspaceBytes;
    check_blas(cublasLtMatmulPreferenceSetAttribute(pref_raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                                    sizeof(max_workspace)),
               "setting the workspace limit");
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    check_blas(cublasLtMatmulAlgoGetHeuristic(p.blas->get(), desc_raw, a.get(), b.get(), d.get(), d.get(), pref_raw, 1,
                                              &heuristic, &found),
               "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0)
      fail("linear: cuBLASLt has no algorithm for rows ", s.rows, ", groups ", s.groups, ", in ", s.in, ", out ",
           s.out, " (", dtype_name(input_dtype), " -> ", dtype_name(y_dtype), ")");
    BlasLtAlgorithm algorithm;
    std::memcpy(algorithm.data, &heuristic.algo, sizeof(algorithm.data));
    return algorithm;
  });
  cublasLtMatmulAlgo_t algo;
  std::memcpy(&algo, chosen.data, sizeof(algo));
  const float alpha = 1.0f, beta = 0.0f;
  check_blas(cublasLtMatmul(p.blas->get(), desc_raw, &alpha, w, a.get(), x, b.get(), &beta, y, d.get(), y, d.get(), &algo,
                            p.blas->workspace(), BlasLt::kWorkspaceBytes, stream),
             "cublasLtMatmul");
}

std::string supports(const LinearParams&, const DeviceInfo&) { return ""; }

// cuBLASLt has no f32 x f32 -> bf16 product: an f32 product with a bf16 y (Precision::fp32's
// q projections, whose consumers read bf16) is written in f32 to the workspace and rounded.
size_t staged_output_bytes(const LinearParams& p) {
  return linear_product_dtype(p) == DType::f32 && p.y.dtype != DType::f32
             ? align_workspace(static_cast<size_t>(p.y.numel()) * sizeof(float))
             : 0;
}

size_t workspace_bytes(const LinearParams& p) {
  return activation_copy_bytes(p, linear_product_dtype(p)) + dequantized_weight_bytes(p) + staged_output_bytes(p);
}

void run(const LinearParams& p, void* workspace, cudaStream_t stream) {
  const LinearShape s = linear_shape(p);
  const DType input_dtype = linear_product_dtype(p);
  auto* cursor = static_cast<std::byte*>(workspace);
  const void* x = p.x.data;
  if (needs_activation_copy(p, input_dtype)) {
    launch_prepare_activation(p, input_dtype, cursor, stream);
    x = cursor;
    cursor += activation_copy_bytes(p, input_dtype);
  }
  const void* w = p.weight.data;
  if (p.weight.dtype == DType::e4m3) {
    launch_dequantize(p.weight, p.weight_scale, p.block_out, p.block_in, cursor, input_dtype, stream, "linear");
    w = cursor;
  }
  if (staged_output_bytes(p) == 0) {
    gemm(p, s, x, w, input_dtype, p.y.data, p.y.dtype, stream);
    return;
  }
  cursor += dequantized_weight_bytes(p);
  gemm(p, s, x, w, input_dtype, cursor, DType::f32, stream);
  launch_convert(cursor, DType::f32, p.y.data, p.y.dtype, p.y.numel(), stream);
}

}  // namespace

const LinearImplementation kLinearCublasLt = {"cublaslt", &supports, &workspace_bytes, &run};

}  // namespace dsv4::cuda

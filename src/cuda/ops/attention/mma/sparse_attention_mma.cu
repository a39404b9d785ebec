// The tensor-core implementation of run_sparse_attention ("mma_bf16"): one block per (token, 64
// heads), rows split over blocks with split_kv when a workspace is given and the step is small.
// The kernels are instantiated in src/cuda/instantiations/sparse_attention_mma_bf16_*.cu.
#include <string>

#include "cuda/ops/attention/mma/sparse_attention_mma_kernel.cuh"
#include "cuda/ops/attention/sparse_attention_implementations.h"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

extern template void launch_sparse_attention_mma<uint16_t>(const SparseAttentionLaunch&, cudaStream_t);
extern template void launch_sparse_attention_mma<float>(const SparseAttentionLaunch&, cudaStream_t);

namespace {

constexpr AttentionBlocking kBlocking{.heads_per_block = kMmaHeadsPerBlock, .tile_rows = kMmaTileRows,
                                      .head_dim = kMmaHeadDim};

// The rows go to the tensor cores as bf16: formats whose decoded values are exact in bf16 (bf16;
// e4m3 codes times ue8m0 scales; e2m1 codes times e4m3 scales), not fp8_per_tensor (any f32 scale).
// bf16 rows are copied with 16-byte cp.async, so their pages must be 16-byte aligned.
std::string cache_supported(const char* name, const PagedCache& cache) {
  const KvRowFormat f = cache.geometry.format;
  if (f != KvRowFormat::bf16 && f != KvRowFormat::v41_fp8 && f != KvRowFormat::v41_fp4 && f != KvRowFormat::fp8_ds_mla)
    return std::string("cache '") + name + "' has format " + kv_row_format_name(f) + ", whose values need not be exact in bf16";
  if (f == KvRowFormat::bf16 &&
      (reinterpret_cast<uintptr_t>(cache.pages.data) % 16 != 0 || cache.geometry.page_stride % 16 != 0))
    return std::string("cache '") + name + "' has bf16 pages that are not 16-byte aligned";
  return "";
}

std::string supports(const SparseAttentionParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_shared_memory(static_cast<long long>(kMmaSharedBytes), device); !why_not.empty())
    return why_not;
  if (std::string why_not = needs_value("head_dim", kMmaHeadDim, p.q.shape[2]); !why_not.empty()) return why_not;
  if (!p.bf16_rounding) return "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the tensor cores read q as bf16)";
  if (std::string why_not = cache_supported("window", p.window); !why_not.empty()) return why_not;
  if (is_present(p.compressed.pages)) return cache_supported("compressed", p.compressed);
  return "";  // any head count, bf16 | f32 out
}

void run(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.q.shape[0] == 0 || p.q.shape[1] == 0) return;
  const SparseAttentionLaunch a =
      make_sparse_attention_launch(p, kSparseAttentionMmaBf16.plan(p, workspace != nullptr), workspace, kMmaHeadDim);
  if (p.out.dtype == DType::bf16) launch_sparse_attention_mma<uint16_t>(a, stream);
  else launch_sparse_attention_mma<float>(a, stream);
  check_launch("sparse_attention (mma_bf16)");
  if (a.splits > 1) combine_sparse_attention_splits(a, p.out.dtype, kMmaHeadDim, stream);
}

}  // namespace

const SparseAttentionImplementation kSparseAttentionMmaBf16 = {"mma_bf16", &supports, kBlocking, &run};

}  // namespace dsv4::cuda

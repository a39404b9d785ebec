// The SIMT implementation of run_sparse_attention: one block per (token, 16 heads), rows split
// over blocks with split_kv when a workspace is given and the step is small. The kernels are
// instantiated in src/cuda/instantiations/sparse_attention_simt_*.cu.
#include "cuda/ops/attention/simt/sparse_attention_kernel.cuh"
#include "cuda/ops/attention/sparse_attention_implementations.h"

namespace dsv4::cuda {

extern template void launch_sparse_attention<512, uint16_t>(const SparseAttentionLaunch&, cudaStream_t);
extern template void launch_sparse_attention<512, float>(const SparseAttentionLaunch&, cudaStream_t);

namespace {

constexpr int64_t kHeadDim = 512;  // the head size the kernels are instantiated for

constexpr AttentionBlocking kBlocking{.heads_per_block = kAttentionHeadsPerBlock, .tile_rows = kAttentionTileRows,
                                      .head_dim = kHeadDim};

std::string supports(const SparseAttentionParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  return needs_value("head_dim", kHeadDim, p.q.shape[2]);  // every cache format, bf16 | f32 q and out, any head count
}

void run(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.q.shape[0] == 0 || p.q.shape[1] == 0) return;
  const SparseAttentionLaunch a =
      make_sparse_attention_launch(p, kSparseAttentionSimt.plan(p, workspace != nullptr), workspace, kHeadDim);
  if (p.out.dtype == DType::bf16) launch_sparse_attention<kHeadDim, uint16_t>(a, stream);
  else launch_sparse_attention<kHeadDim, float>(a, stream);
  check_launch("sparse_attention");
  if (a.splits > 1) combine_sparse_attention_splits(a, p.out.dtype, kHeadDim, stream);
}

}  // namespace

const SparseAttentionImplementation kSparseAttentionSimt = {"simt", &supports, kBlocking, &run};

}  // namespace dsv4::cuda

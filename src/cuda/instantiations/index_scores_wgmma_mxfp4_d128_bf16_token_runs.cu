// fp8 warpgroup-MMA index scores (wgmma), index_mxfp4 keys, index_dim 128, bf16-rounded scores,
// CTAs scoring runs of tokens (prefill).
#include "cuda/ops/indexer/wgmma/index_scores_wgmma_kernel.cuh"

namespace dsv4::cuda::index_wgmma {
template void launch_index_scores_wgmma<4, true, true>(const IndexScoresWgmmaLaunch&, cudaStream_t);
}  // namespace dsv4::cuda::index_wgmma

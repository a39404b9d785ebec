// fp8 warpgroup-MMA index scores (wgmma), index_mxfp4 keys, index_dim 128, fp32 scores,
// one token per CTA (decode).
#include "cuda/ops/indexer/wgmma/index_scores_wgmma_kernel.cuh"

namespace dsv4::cuda::index_wgmma {
template void launch_index_scores_wgmma<4, false, false>(const IndexScoresWgmmaLaunch&, cudaStream_t);
}  // namespace dsv4::cuda::index_wgmma

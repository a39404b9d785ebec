// Tensor-core index scores (mma_f16), index_fp8 keys, index_dim 64.
#include "cuda/ops/indexer/mma/index_scores_mma_kernel.cuh"

namespace dsv4::cuda::index_mma {
template void launch_index_scores_mma<2, true>(const IndexScoresRangeLaunch&, cudaStream_t);
}  // namespace dsv4::cuda::index_mma

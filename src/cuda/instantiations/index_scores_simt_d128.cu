// SIMT index scores, index_dim 128.
#include "cuda/ops/indexer/simt/index_scores_kernel.cuh"

namespace dsv4::cuda {
template void launch_index_scores<128>(const IndexScoresSimtLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

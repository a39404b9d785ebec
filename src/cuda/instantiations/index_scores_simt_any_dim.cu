// SIMT index scores, any index_dim that is a multiple of 32 (the key decoded 32 channels at a time).
#include "cuda/ops/indexer/simt/index_scores_kernel.cuh"

namespace dsv4::cuda {
template void launch_index_scores<0>(const IndexScoresSimtLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

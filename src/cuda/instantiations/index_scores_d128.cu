// Index scores, index_dim 128.
#include "cuda/sm90/indexer/index_scores.cuh"

namespace dsv4::cuda {
template void launch_index_scores<128>(const IndexScoresLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

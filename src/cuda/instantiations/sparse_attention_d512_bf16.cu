// Sparse attention, head_dim 512, bf16 output.
#include "cuda/sm90/attention/sparse_attention.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention<512, uint16_t>(const SparseAttentionLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

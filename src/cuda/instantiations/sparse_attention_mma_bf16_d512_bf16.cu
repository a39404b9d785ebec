// Tensor-core (mma_bf16) sparse attention, head_dim 512, bf16 output.
#include "cuda/ops/attention/mma/sparse_attention_mma_kernel.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention_mma<uint16_t>(const SparseAttentionLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

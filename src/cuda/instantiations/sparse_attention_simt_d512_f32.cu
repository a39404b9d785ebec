// SIMT sparse attention, head_dim 512, f32 output.
#include "cuda/ops/attention/simt/sparse_attention_kernel.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention<512, float>(const SparseAttentionLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

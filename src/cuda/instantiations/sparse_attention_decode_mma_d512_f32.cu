// Warp-specialized tensor-core (decode_mma) sparse attention, head_dim 512, f32 output.
#include "cuda/ops/attention/mma/sparse_attention_decode_kernel.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention_decode<float>(const SparseAttentionLaunch&, cudaStream_t);
}  // namespace dsv4::cuda

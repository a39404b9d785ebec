// Warpgroup-MMA (wgmma, sm_90a) sparse attention, head_dim 512, window v41_fp8 + compressed v41_fp4 rows, f32 output.
#include "cuda/ops/attention/wgmma/sparse_attention_wgmma_kernel.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention_wgmma<float, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>(SparseAttentionLaunch, int64_t,
                                                    bool, cudaStream_t);
}  // namespace dsv4::cuda

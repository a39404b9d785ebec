// Warpgroup-MMA (wgmma, sm_90a) sparse attention, head_dim 512, window fp8_ds_mla + compressed fp8_ds_mla rows, bf16 output.
#include "cuda/ops/attention/wgmma/sparse_attention_wgmma_kernel.cuh"

namespace dsv4::cuda {
template void launch_sparse_attention_wgmma<uint16_t, KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla>(SparseAttentionLaunch, int64_t,
                                                    bool, cudaStream_t);
}  // namespace dsv4::cuda

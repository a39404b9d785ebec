// The warp-specialized tensor-core implementation of run_sparse_attention ("decode_mma", kernel in
// sparse_attention_decode_kernel.cuh): one block of 12 warps per (token, 64 heads) and SM (224 KB
// of shared memory), rows split over blocks with split_kv so that a small step still fills one
// wave of an H100 / H200. The kernels are instantiated in
// src/cuda/instantiations/sparse_attention_decode_mma_*.cu.
#include <algorithm>
#include <string>

#include "cuda/ops/attention/mma/sparse_attention_decode_kernel.cuh"
#include "cuda/ops/attention/sparse_attention_implementations.h"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

extern template void launch_sparse_attention_decode<uint16_t>(const SparseAttentionLaunch&, cudaStream_t);
extern template void launch_sparse_attention_decode<float>(const SparseAttentionLaunch&, cudaStream_t);

namespace {

// One block per SM (the accumulators of 64 heads x 512 channels take half the register file).
constexpr AttentionBlocking kBlocking{.heads_per_block = decode_mma::kHeadsPerBlock, .tile_rows = decode_mma::kTileRows,
                                      .head_dim = decode_mma::kHeadDim, .one_block_per_sm = true};

// The rows go to the tensor cores as bf16: formats whose decoded values are exact in bf16 (bf16;
// e4m3 codes times ue8m0 scales; e2m1 codes times e4m3 scales), copied 8 bytes at a time.
constexpr KvRowFormat kFormats[] = {KvRowFormat::bf16, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::fp8_ds_mla};

// sm_90a machine code only: elsewhere the driver would JIT the compute_80 PTX, which has no
// setmaxnreg, so the MMA warps would spill (mma_bf16 runs those devices).
std::string supports(const SparseAttentionParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability(90, device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_shared_memory(static_cast<long long>(decode_mma::kSharedBytes), device); !why_not.empty())
    return why_not;
  if (std::string why_not = needs_value("head_dim", decode_mma::kHeadDim, p.q.shape[2]); !why_not.empty()) return why_not;
  if (!p.bf16_rounding) return "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the tensor cores read q as bf16)";
  // Any head count, bf16 | f32 out.
  return gathered_caches_supported(p, kFormats, "whose values need not be exact in bf16", 8);
}

void run(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.q.shape[0] == 0 || p.q.shape[1] == 0) return;
  const SparseAttentionLaunch a =
      make_sparse_attention_launch(p, kSparseAttentionDecodeMma.plan(p, workspace != nullptr), workspace,
                                   decode_mma::kHeadDim);
  if (p.out.dtype == DType::bf16) launch_sparse_attention_decode<uint16_t>(a, stream);
  else launch_sparse_attention_decode<float>(a, stream);
  check_launch("sparse_attention (decode_mma)");
  if (a.splits > 1) combine_sparse_attention_splits(a, p.out.dtype, decode_mma::kHeadDim, stream);
}

}  // namespace

const SparseAttentionImplementation kSparseAttentionDecodeMma = {"decode_mma", &supports, kBlocking, &run};

}  // namespace dsv4::cuda

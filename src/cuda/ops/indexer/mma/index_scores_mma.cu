// The tensor-core implementation of run_index_scores ("mma_f16": the keys' FP4 / FP8 codes widened
// to f16 in registers), index_scores_mma_kernel.cuh; the kernels are instantiated in
// src/cuda/instantiations/index_scores_mma_f16_*.cu.
#include <algorithm>
#include <string>

#include "cuda/common/paged_rows.h"
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/mma/index_scores_mma_kernel.cuh"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

namespace index_mma {
extern template void launch_index_scores_mma<2, false>(const IndexScoresRangeLaunch&, cudaStream_t);
extern template void launch_index_scores_mma<4, false>(const IndexScoresRangeLaunch&, cudaStream_t);
extern template void launch_index_scores_mma<2, true>(const IndexScoresRangeLaunch&, cudaStream_t);
extern template void launch_index_scores_mma<4, true>(const IndexScoresRangeLaunch&, cudaStream_t);
}  // namespace index_mma

namespace {

using index_mma::launch_index_scores_mma;

constexpr int64_t kMaxGridY = 65535;
// Three CTAs per SM: 12 warps hide the MMA and shared memory latencies better than 8 with twice
// the tokens.
constexpr size_t kSharedBudget = 75 * 1024;
constexpr int64_t kMinKeysPerCta = 1024;  // 8 stages per warp
constexpr int kWaves = 2;

size_t shared_bytes(int blocks, bool fp8, int tokens_per_cta, int heads) {
  using index_mma::SharedLayout;
  if (blocks == 2) return fp8 ? SharedLayout<2, true>(tokens_per_cta, heads).bytes() : SharedLayout<2, false>(tokens_per_cta, heads).bytes();
  return fp8 ? SharedLayout<4, true>(tokens_per_cta, heads).bytes() : SharedLayout<4, false>(tokens_per_cta, heads).bytes();
}

int tokens_per_cta(int64_t tokens, int heads, int blocks, bool fp8) {
  return index_tokens_per_cta(tokens, index_mma::kMaxTokensPerCta, kSharedBudget,
                              [&](int n) { return shared_bytes(blocks, fp8, n, heads); });
}

int64_t keys_per_cta(int64_t entries, int64_t token_groups, size_t shared, const DeviceInfo& device) {
  return index_keys_per_cta(entries, token_groups, shared, index_mma::kMinBlocksPerSm, index_mma::kKeyGranule,
                            kMinKeysPerCta, kWaves, device);
}

std::string supports(const IndexScoresParams& p, const DeviceInfo& device) {
  // Built as sm_90a code only (elsewhere the compute_80 PTX has no fp8 MMA).
  if (std::string why_not = needs_compute_capability(90, device); !why_not.empty()) return why_not;
  if (!p.fp4_queries) return "needs fp4_queries (q read as e2m1 codes)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the FP4 values are read from bf16 bits)";
  const KvRowFormat f = p.keys.geometry.format;
  if (f != KvRowFormat::index_mxfp4 && f != KvRowFormat::index_fp8)
    return std::string("keys have format ") + kv_row_format_name(f) + ", supports index_mxfp4 and index_fp8";
  if (f == KvRowFormat::index_fp8 && p.bf16_rounding)
    return "index_fp8 keys with bf16_rounding (e4m3 x e2m1 block sums are not exact in the fp8 MMA)";
  const int64_t dim = p.q.shape[2], heads = p.q.shape[1], tokens = p.q.shape[0];
  if (dim != 64 && dim != 128) return "index_dim " + std::to_string(dim) + ", supports 64 and 128";
  if (heads > index_mma::kMaxHeads)
    return std::to_string(heads) + " index heads, supports at most " + std::to_string(index_mma::kMaxHeads);
  // A row's scales: an fp32 (index_fp8) or dim / 32 ue8m0 bytes.
  if (std::string why_not = tensor_core_copies_supported(p, f == KvRowFormat::index_fp8 ? 4 : dim / 32); !why_not.empty())
    return why_not;
  const bool fp8 = f == KvRowFormat::index_fp8;
  const int per_cta = tokens_per_cta(tokens, static_cast<int>(heads), static_cast<int>(dim / 32), fp8);
  if ((tokens + per_cta - 1) / per_cta > kMaxGridY)
    return std::to_string(tokens) + " tokens, supports at most " + std::to_string(kMaxGridY * per_cta);
  return needs_shared_memory(static_cast<long long>(shared_bytes(static_cast<int>(dim / 32), fp8, per_cta, static_cast<int>(heads))),
                             device);
}

void run(const IndexScoresParams& p, cudaStream_t stream) {
  IndexScoresRangeLaunch a{index_scores_launch(p)};
  if (a.tokens == 0 || a.entries == 0) return;
  const bool fp8 = p.keys.geometry.format == KvRowFormat::index_fp8;
  const int blocks = static_cast<int>(p.q.shape[2] / 32);
  a.tokens_per_cta = tokens_per_cta(a.tokens, a.heads, blocks, fp8);
  a.keys_per_cta = keys_per_cta(a.entries, (a.tokens + a.tokens_per_cta - 1) / a.tokens_per_cta,
                                shared_bytes(blocks, fp8, a.tokens_per_cta, a.heads), device_info());
  if (p.q.shape[2] == 128) fp8 ? launch_index_scores_mma<4, true>(a, stream) : launch_index_scores_mma<4, false>(a, stream);
  else fp8 ? launch_index_scores_mma<2, true>(a, stream) : launch_index_scores_mma<2, false>(a, stream);
  check_launch("index_scores");
}

}  // namespace

const IndexScoresImplementation kIndexScoresMmaF16 = {"mma_f16", &supports, &run};

}  // namespace dsv4::cuda

// The fp8 warpgroup-MMA implementation of run_index_scores ("wgmma": FP4 queries against
// index_mxfp4 keys, sm_90a), index_scores_wgmma_kernel.cuh; the kernels are instantiated in
// src/cuda/instantiations/index_scores_wgmma_*.cu.
#include <string>

#include "cuda/common/paged_rows.h"
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/wgmma/index_scores_wgmma_kernel.cuh"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

namespace index_wgmma {
#define DSV4_WGMMA_INDEX_SCORES(kBlocks, kBf16Rounding, kTokenRuns, kHeadSum)                      \
  extern template void launch_index_scores_wgmma<kBlocks, kBf16Rounding, kTokenRuns, HeadSum::kHeadSum>( \
      const IndexScoresRangeLaunch&, cudaStream_t);
#define DSV4_WGMMA_INDEX_SCORES_OF_DIM(kBlocks)                  \
  DSV4_WGMMA_INDEX_SCORES(kBlocks, false, false, ordered)        \
  DSV4_WGMMA_INDEX_SCORES(kBlocks, true, false, ordered)         \
  DSV4_WGMMA_INDEX_SCORES(kBlocks, true, false, tensor_cores)    \
  DSV4_WGMMA_INDEX_SCORES(kBlocks, false, true, ordered)         \
  DSV4_WGMMA_INDEX_SCORES(kBlocks, true, true, ordered)          \
  DSV4_WGMMA_INDEX_SCORES(kBlocks, true, true, tensor_cores)
DSV4_WGMMA_INDEX_SCORES_OF_DIM(2)
DSV4_WGMMA_INDEX_SCORES_OF_DIM(4)
#undef DSV4_WGMMA_INDEX_SCORES_OF_DIM
#undef DSV4_WGMMA_INDEX_SCORES
}  // namespace index_wgmma

namespace {

using index_wgmma::HeadSum;
using index_wgmma::launch_index_scores_wgmma;

constexpr int64_t kMaxGridY = 65535;
// The shared memory of a CTA with token runs: its share of an SM's 228 KB (ctas_per_sm of them),
// less the 1 KB the hardware reserves per CTA. (One token fits the four one-token CTAs' share.)
constexpr size_t kTokenRunsSharedBudget = (228 / index_wgmma::ctas_per_sm(true) - 1) * 1024;
constexpr int64_t kMinKeysPerCta = 1024;     // 8 stages
// One wave: CTAs of equal work finish together, and longer ranges amortize the query staging.
constexpr int kWaves = 1;

// bf16-rounded whole sums take the tensor-core head sum; fp32 scores and partial sums (the
// tensor-parallel split) add in head order.
HeadSum head_sum(const IndexScoresParams& p) {
  return p.bf16_rounding && !p.partial ? HeadSum::tensor_cores : HeadSum::ordered;
}

size_t shared_bytes(int blocks, HeadSum sum, int tokens_per_cta) {
  using index_wgmma::SharedLayout;
  const bool ordered = sum == HeadSum::ordered;
  if (blocks == 2)
    return ordered ? SharedLayout<2, HeadSum::ordered>{tokens_per_cta}.bytes()
                   : SharedLayout<2, HeadSum::tensor_cores>{tokens_per_cta}.bytes();
  return ordered ? SharedLayout<4, HeadSum::ordered>{tokens_per_cta}.bytes()
                 : SharedLayout<4, HeadSum::tensor_cores>{tokens_per_cta}.bytes();
}

// Tokens per CTA: as many as the budget of CTAs with token runs allows (1: the one-token kernel).
int tokens_per_cta(int64_t tokens, int blocks, HeadSum sum) {
  return index_tokens_per_cta(tokens, index_wgmma::kMaxTokensPerCta, kTokenRunsSharedBudget,
                              [&](int n) { return shared_bytes(blocks, sum, n); });
}

std::string supports(const IndexScoresParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability(90, device); !why_not.empty()) return why_not;
  if (!p.fp4_queries) return "needs fp4_queries (q read as e2m1 codes)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the FP4 values are read from bf16 bits)";
  const KvRowFormat f = p.keys.geometry.format;
  if (f != KvRowFormat::index_mxfp4)
    return std::string("keys have format ") + kv_row_format_name(f) + ", supports index_mxfp4";
  const int64_t dim = p.q.shape[2], heads = p.q.shape[1], tokens = p.q.shape[0];
  if (dim != 64 && dim != 128) return "index_dim " + std::to_string(dim) + ", supports 64 and 128";
  if (heads > index_wgmma::kHeads)
    return std::to_string(heads) + " index heads, supports at most " + std::to_string(index_wgmma::kHeads);
  // A row's scales: dim / 32 ue8m0 bytes.
  if (std::string why_not = tensor_core_copies_supported(p, dim / 32); !why_not.empty()) return why_not;
  const int blocks = static_cast<int>(dim / 32);
  const HeadSum sum = head_sum(p);
  const int per_cta = tokens_per_cta(tokens, blocks, sum);
  if ((tokens + per_cta - 1) / per_cta > kMaxGridY)
    return std::to_string(tokens) + " tokens, supports at most " + std::to_string(kMaxGridY * per_cta);
  return needs_shared_memory(static_cast<long long>(shared_bytes(blocks, sum, per_cta)), device);
}

void run(const IndexScoresParams& p, cudaStream_t stream) {
  IndexScoresRangeLaunch a{index_scores_launch(p)};
  if (a.tokens == 0 || a.entries == 0) return;
  const int blocks = static_cast<int>(p.q.shape[2] / 32);
  const HeadSum sum = head_sum(p);
  a.tokens_per_cta = tokens_per_cta(a.tokens, blocks, sum);
  const bool token_runs = a.tokens_per_cta > 1;
  a.keys_per_cta = index_keys_per_cta(a.entries, (a.tokens + a.tokens_per_cta - 1) / a.tokens_per_cta,
                                      shared_bytes(blocks, sum, a.tokens_per_cta), index_wgmma::ctas_per_sm(token_runs),
                                      index_wgmma::kStageRows, kMinKeysPerCta, kWaves, device_info());
  using Launch = void (*)(const IndexScoresRangeLaunch&, cudaStream_t);
  // [dim 128][scores: fp32, bf16 in head order, bf16 on tensor cores][token_runs]
  constexpr Launch kLaunches[2][3][2] = {
      {{launch_index_scores_wgmma<2, false, false, HeadSum::ordered>, launch_index_scores_wgmma<2, false, true, HeadSum::ordered>},
       {launch_index_scores_wgmma<2, true, false, HeadSum::ordered>, launch_index_scores_wgmma<2, true, true, HeadSum::ordered>},
       {launch_index_scores_wgmma<2, true, false, HeadSum::tensor_cores>,
        launch_index_scores_wgmma<2, true, true, HeadSum::tensor_cores>}},
      {{launch_index_scores_wgmma<4, false, false, HeadSum::ordered>, launch_index_scores_wgmma<4, false, true, HeadSum::ordered>},
       {launch_index_scores_wgmma<4, true, false, HeadSum::ordered>, launch_index_scores_wgmma<4, true, true, HeadSum::ordered>},
       {launch_index_scores_wgmma<4, true, false, HeadSum::tensor_cores>,
        launch_index_scores_wgmma<4, true, true, HeadSum::tensor_cores>}}};
  const int scores = sum == HeadSum::tensor_cores ? 2 : a.bf16_rounding ? 1 : 0;
  kLaunches[blocks == 4][scores][token_runs](a, stream);
  check_launch("index_scores");
}

}  // namespace

const IndexScoresImplementation kIndexScoresWgmma = {"wgmma", &supports, &run};

}  // namespace dsv4::cuda

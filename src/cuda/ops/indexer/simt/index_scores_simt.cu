// The SIMT implementation of run_index_scores; the kernel is instantiated in
// src/cuda/instantiations/index_scores_simt_*.cu: with the key row in registers for the index_dims
// of the released models (64, 128), and for any other multiple of 32.
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/simt/index_scores_kernel.cuh"

namespace dsv4::cuda {

extern template void launch_index_scores<64>(const IndexScoresSimtLaunch&, cudaStream_t);
extern template void launch_index_scores<128>(const IndexScoresSimtLaunch&, cudaStream_t);
extern template void launch_index_scores<0>(const IndexScoresSimtLaunch&, cudaStream_t);

namespace {

constexpr int64_t kMaxGridY = 65535;

std::string supports(const IndexScoresParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  const int64_t dim = p.q.shape[2];
  if (dim % kIndexKeyChunk != 0 || dim > kStagedQueryFloats)
    return "index_dim " + std::to_string(dim) + ", supports multiples of " + std::to_string(kIndexKeyChunk) +
           " up to " + std::to_string(kStagedQueryFloats);
  if (p.q.shape[1] > INT32_MAX)
    return std::to_string(p.q.shape[1]) + " index heads, supports at most " + std::to_string(INT32_MAX);
  if (p.scores.shape[1] > kMaxGridY * kIndexEntriesPerBlock)
    return std::to_string(p.scores.shape[1]) + " entries per row, supports at most " +
           std::to_string(kMaxGridY * kIndexEntriesPerBlock);
  return "";  // every key format, bf16 | f32 q, candidates or not, any number of index heads (staged)
}

void run(const IndexScoresParams& p, cudaStream_t stream) {
  IndexScoresSimtLaunch a{index_scores_launch(p)};
  if (a.tokens == 0 || a.entries == 0) return;
  a.staged_heads = index_scores_staged_heads(a.heads, a.dim);
  if (a.dim == 128) launch_index_scores<128>(a, stream);
  else if (a.dim == 64) launch_index_scores<64>(a, stream);
  else launch_index_scores<0>(a, stream);
  check_launch("index_scores");
}

}  // namespace

const IndexScoresImplementation kIndexScoresSimt = {"simt", &supports, &run};

}  // namespace dsv4::cuda

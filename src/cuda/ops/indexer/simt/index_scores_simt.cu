// The SIMT implementation of run_index_scores; the kernel is instantiated in
// src/cuda/instantiations/index_scores_simt_*.cu.
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/simt/index_scores_kernel.cuh"

namespace dsv4::cuda {

extern template void launch_index_scores<128>(const IndexScoresLaunch&, cudaStream_t);

namespace {

constexpr int64_t kIndexDim = 128;   // the index head size the kernel is instantiated for
constexpr int kMaxIndexHeads = 128;  // keeps the queries of a token in shared memory
constexpr int64_t kMaxGridY = 65535;

std::string supports(const IndexScoresParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_value("index_dim", kIndexDim, p.q.shape[2]); !why_not.empty()) return why_not;
  if (p.q.shape[1] > kMaxIndexHeads)
    return std::to_string(p.q.shape[1]) + " index heads, supports at most " + std::to_string(kMaxIndexHeads);
  if (p.scores.shape[1] > kMaxGridY * kIndexEntriesPerBlock)
    return std::to_string(p.scores.shape[1]) + " entries per row, supports at most " +
           std::to_string(kMaxGridY * kIndexEntriesPerBlock);
  return "";  // every key format, candidates or not
}

void run(const IndexScoresParams& p, cudaStream_t stream) {
  IndexScoresLaunch a;
  a.tokens = p.q.shape[0];
  a.heads = static_cast<int>(p.q.shape[1]);
  a.entries = p.scores.shape[1];
  if (a.tokens == 0 || a.entries == 0) return;
  a.q = p.q.ptr<const uint16_t>();
  a.weights = p.weights.ptr<const float>();
  a.keys = device_rows(p.keys);
  a.token_sequence = p.token_sequence.ptr<const int32_t>();
  a.token_position = p.token_position.ptr<const int32_t>();
  a.compress_ratio = p.compress_ratio;
  if (is_present(p.candidates)) {
    a.candidates = p.candidates.ptr<const int32_t>();
    a.num_candidates = p.candidates.shape[1];
    a.candidate_block_size = p.candidate_block_size;
  }
  a.scores = p.scores.ptr<float>();
  launch_index_scores<kIndexDim>(a, stream);
  check_launch("index_scores");
}

}  // namespace

const IndexScoresImplementation kIndexScoresSimt = {"simt", &supports, &run};

}  // namespace dsv4::cuda

// The implementations of run_index_scores and run_topk and their choosers (the dispatch seam,
// dispatch.h). Adding an implementation: a folder next to simt/ that defines an entry, declared
// below and listed in indexer.cu ahead of the ones it should win over.
#pragma once

#include <span>
#include <string>

#include "cuda/common/dispatch.h"
#include "dsv4/cuda/indexer.h"

namespace dsv4::cuda {

struct IndexScoresImplementation {
  const char* name;
  // "" when the implementation runs this (validated) call on `device`, else why not.
  std::string (*supports)(const IndexScoresParams& p, const DeviceInfo& device);
  void (*run)(const IndexScoresParams& p, cudaStream_t stream);
};

struct TopkImplementation {
  const char* name;
  std::string (*supports)(const TopkParams& p, const DeviceInfo& device);
  void (*run)(const TopkParams& p, cudaStream_t stream);
};

// fp8 warpgroup MMAs (wgmma/): FP4 queries of at most 32 heads against index_mxfp4 keys, sm_90a.
extern const IndexScoresImplementation kIndexScoresWgmma;
// f16 tensor cores (mma/): FP4 queries against index_mxfp4 (exact) or index_fp8 keys, sm_90.
extern const IndexScoresImplementation kIndexScoresMmaF16;
// The portable fallbacks (simt/): one thread per entry for the scores, a radix select per row.
extern const IndexScoresImplementation kIndexScoresSimt;
extern const TopkImplementation kTopkSimt;

// The radix top-k (radix/): a row over a thread-block cluster on sm_90, one CTA elsewhere; its
// keys held in shared memory where every row fits at once, else streamed (read twice); any row.
extern const TopkImplementation kTopkRadix;
// The same with every row streamed, not in the chooser's list: the tests run it on every shape.
extern const TopkImplementation kTopkRadixStreamed;

// For the tensor-core implementations, which copy q and the key rows 16 bytes at a time and a
// row's scales as one aligned word of scale_bytes: "" when the call's buffers allow it, else why not.
std::string tensor_core_copies_supported(const IndexScoresParams& p, int64_t scale_bytes);

// In order of preference; the choosers take the first that supports the call.
std::span<const IndexScoresImplementation* const> index_scores_implementations();
std::span<const TopkImplementation* const> topk_implementations();
const IndexScoresImplementation& choose_index_scores(const IndexScoresParams& p, const DeviceInfo& device);
const TopkImplementation& choose_topk(const TopkParams& p, const DeviceInfo& device);

}  // namespace dsv4::cuda

// How the tensor-core index-score kernels (wgmma, mma_f16) split a call (IndexScoresRangeLaunch):
// a CTA takes tokens t0 … t0 + count − 1 and entries k0 … k1 − 1; consecutive tokens of one
// sequence form a run that shares the key loads.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/ops/indexer/fp4_dots.cuh"
#include "cuda/ops/indexer/indexer_launch.h"

namespace dsv4::cuda::index_fp4 {

struct CtaRange {
  int64_t t0;
  int count;
  int64_t k0, k1;
  __device__ explicit CtaRange(const IndexScoresRangeLaunch& a)
      : t0(int64_t{blockIdx.y} * a.tokens_per_cta),
        count(static_cast<int>(a.tokens - t0 < a.tokens_per_cta ? a.tokens - t0 : a.tokens_per_cta)),
        k0(int64_t{blockIdx.x} * a.keys_per_cta),
        k1(k0 + a.keys_per_cta < a.entries ? k0 + a.keys_per_cta : a.entries) {}

  // After init_tokens and a barrier: when the range is in every token's future, writes its -inf
  // scores and returns true (the CTA has nothing else to do).
  template <int kThreads>
  __device__ bool in_the_future(const IndexScoresRangeLaunch& a, const int64_t* visible) const {
    int64_t cta_visible = 0;
    for (int i = 0; i < count; ++i) cta_visible = max(cta_visible, visible[i]);
    if (k0 < cta_visible) return false;
    for (int i = 0; i < count; ++i)
      for (int64_t j = k0 + threadIdx.x; j < k1; j += kThreads) a.scores[(t0 + i) * a.entries + j] = -INFINITY;
    return true;
  }
};

// A CTA's start: its tokens' arrays (init_tokens), then, unless its range is in every token's
// future (then it has written its -inf scores: false), their queries staged by `stage`
// (prepare_queries; ends with a barrier).
template <int kBlocks, int kThreads, class Stage>
__device__ __forceinline__ bool start_tokens(const IndexScoresRangeLaunch& a, const CtaRange& cta, int padded_heads,
                                             const TokenQueries& tq, Stage stage) {
  init_tokens<kThreads>(a, cta.t0, cta.count, tq);
  __syncthreads();
  if (cta.in_the_future<kThreads>(a, tq.visible)) return false;
  prepare_queries<kBlocks, kThreads>(a, cta.t0, cta.count, padded_heads, tq, stage);
  return true;
}

// The run of tokens first … end − 1 reading one sequence, and the end of the keys it loads.
struct TokenRun {
  int end;
  int64_t sequence, load_end;
  __device__ TokenRun(const CtaRange& r, int first, const TokenQueries& tq) {
    end = first + 1;
    int64_t visible = tq.visible[first];
    auto sequence_of = [&](int i) { return tq.stats[kTokenStats * i + kSequence]; };
    while (end < r.count && sequence_of(end) == sequence_of(first)) visible = max(visible, tq.visible[end++]);
    sequence = sequence_of(first);
    load_end = visible < r.k1 ? visible : r.k1;
  }
};

// The grid of a call: key ranges in x, token groups in y.
inline dim3 range_grid(const IndexScoresRangeLaunch& a) {
  return dim3(static_cast<unsigned>((a.entries + a.keys_per_cta - 1) / a.keys_per_cta),
              static_cast<unsigned>((a.tokens + a.tokens_per_cta - 1) / a.tokens_per_cta));
}

}  // namespace dsv4::cuda::index_fp4

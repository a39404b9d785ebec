// Image spans (SPEC §14): which window positions a token attends when its prefill chunk carries
// image spans. The rule is decided here once: begin_step lays the per-token ranges out in the step
// (StepLayout::windows), the CPU reference reads them as the definition of its window rows and the
// CUDA engine uploads them for its attention kernels (SparseAttentionParams::window_first /
// window_last). Compressed entries, the compressor and the indexer stay causal (SPEC §14.4).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/step_layout.h"
#include "dsv4/types.h"

namespace dsv4 {

// The causal window of position p: p - W + 1 … p, from 0 (SPEC §5.1).
constexpr WindowRange causal_window(int64_t p, int64_t W) { return {std::max<int64_t>(0, p - W + 1), p}; }

// The window of position p inside `span` (span.first <= p <= span.last), M >= 1 the max image
// tokens, as DeepSeek's Vision-Exp get_image_visible / get_window_topk_idxs_visible compute it
// (SPEC §14.3): left = min(p - first, M - 1) and right = min(last - p, M) span tokens are visible;
// the window reaches further left than the causal one only as far as `left` does, and holds at
// most W + M rows. A span of at most M tokens is thus seen whole, together with the causal window.
constexpr WindowRange image_span_window(int64_t p, int64_t W, int64_t M, const ImageSpan& span) {
  const int64_t left = std::min(p - span.first, M - 1), right = std::min(span.last - p, M);
  const int64_t first = std::max<int64_t>(0, p - (W - 1) - std::max<int64_t>(left - (W - 1), 0));
  return {first, std::min(p + right, first + W + M - 1)};
}

// The window token t of `step` attends.
inline WindowRange token_window(const StepLayout& step, int64_t t, int64_t W) {
  return step.windows.empty() ? causal_window(step.positions[static_cast<size_t>(t)], W)
                              : step.windows[static_cast<size_t>(t)];
}

// Checks the entries' image spans against their chunks (`step.chunks`, laid out from `entries`)
// and, when any entry has one, fills step.windows. M: ModelConfig::vision_max_n_token. Throws
// naming the sequence and the span: a span that ends before it starts, overlaps another, does not
// lie inside its chunk (SPEC §14.5: its rows must be computed in the chunk that attends them),
// is longer than M, or sits in a one-token (decode) entry; any span when M is 0.
void lay_out_image_spans(StepLayout& step, const std::vector<StepEntry>& entries, int64_t W, int64_t M);

}  // namespace dsv4

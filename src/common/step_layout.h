// Where a step's tokens sit: the step engine lays them out once at begin_step (positions continue
// each sequence's committed length) and every backend computes from that layout.
#pragma once

#include <cstdint>
#include <vector>

#include "dsv4/types.h"

namespace dsv4 {

// One sequence's tokens in a step: tokens [first_token, first_token + tokens) of the step at
// positions [start, start + tokens).
struct StepChunk {
  SequenceId sequence = 0;
  int64_t first_token = 0;
  int64_t tokens = 0;
  int64_t start = 0;
};

// Window positions first … last (inclusive) of a token's sequence that the token attends.
struct WindowRange {
  int64_t first = 0;
  int64_t last = -1;
};

struct StepLayout {
  std::vector<StepChunk> chunks;      // one per step entry, in the entries' order
  std::vector<int64_t> positions;     // [T]
  std::vector<int32_t> chunk_of;      // [T]
  // [T] when an entry of the step has image spans (common/image_spans.h), else empty: every token
  // then attends its causal window.
  std::vector<WindowRange> windows;
  int64_t tokens() const { return static_cast<int64_t>(positions.size()); }
};

}  // namespace dsv4

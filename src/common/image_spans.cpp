#include "common/image_spans.h"

#include "dsv4/error.h"

namespace dsv4 {
namespace {

// The entry's spans, checked and sorted by position.
std::vector<ImageSpan> checked_spans(const StepEntry& e, const StepChunk& chunk, int64_t M) {
  std::vector<ImageSpan> spans = e.image_spans;
  const int64_t chunk_last = chunk.start + chunk.tokens - 1;
  for (const ImageSpan& s : spans) {
    const auto fail_span = [&](const auto&... why) {
      fail("engine: begin_step: sequence ", e.sequence, ": image span [", s.first, ", ", s.last, "] ", why...);
    };
    if (M == 0) fail_span("is given, but the model takes no image spans (its config's vision_max_n_token is 0)");
    if (s.last < s.first) fail_span("ends before it starts");
    if (chunk.tokens == 1)
      fail_span("is in a decode entry (one token at position ", chunk.start,
                "); image spans belong to the prefill chunk that carries all of their tokens");
    if (s.first < chunk.start || s.last > chunk_last)
      fail_span("does not lie inside the entry's chunk, positions ", chunk.start, " to ", chunk_last,
                "; a span must be prefilled in one chunk (SPEC §14.5)");
    if (s.last - s.first + 1 > M)
      fail_span("has ", s.last - s.first + 1, " tokens, more than vision_max_n_token ", M);
  }
  std::sort(spans.begin(), spans.end(), [](const ImageSpan& a, const ImageSpan& b) { return a.first < b.first; });
  for (size_t i = 1; i < spans.size(); ++i)
    DSV4_CHECK(spans[i].first > spans[i - 1].last, "engine: begin_step: sequence ", e.sequence, ": image spans [",
               spans[i - 1].first, ", ", spans[i - 1].last, "] and [", spans[i].first, ", ", spans[i].last,
               "] overlap");
  return spans;
}

}  // namespace

void lay_out_image_spans(StepLayout& step, const std::vector<StepEntry>& entries, int64_t W, int64_t M) {
  step.windows.clear();
  bool any = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::vector<ImageSpan> spans = checked_spans(entries[i], step.chunks[i], M);
    if (spans.empty()) continue;
    if (!any) {
      step.windows.resize(step.positions.size());
      for (size_t t = 0; t < step.positions.size(); ++t) step.windows[t] = causal_window(step.positions[t], W);
      any = true;
    }
    const StepChunk& chunk = step.chunks[i];
    for (const ImageSpan& s : spans)
      for (int64_t p = s.first; p <= s.last; ++p)
        step.windows[static_cast<size_t>(chunk.first_token + p - chunk.start)] = image_span_window(p, W, M, s);
  }
}

}  // namespace dsv4

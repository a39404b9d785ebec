// The CUDA engine's per-step metadata: at begin_step the step's layout and the cache manager's
// block tables and slots are packed into one staging buffer and uploaded with a single copy
// (StepUpload); the layer pipeline reads them through the views below until the next step.
#pragma once

#include <cstdint>
#include <vector>

#include "common/step_layout.h"
#include "cuda/engine/device_caches.h"
#include "cuda/engine/step_upload.h"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

// What one layer reads and writes in a step.
struct LayerStep {
  PagedCache window, compressed, index_keys;                   // compressed / index_keys: kv sources only
  TensorView window_slots, compressed_slots, index_key_slots;  // [step tokens] i64
  int64_t entries = 0;  // kv sources: the longest compressed cache of the step's sequences after it
};

class StepMetadata {
 public:
  // Capacity for steps of at most max_tokens tokens of at most max_sequences sequences, each at
  // most max_context long.
  StepMetadata(const ModelTopology& topology, const DeviceCaches& caches, int64_t max_tokens, int64_t max_sequences,
               int64_t max_context);

  // Packs `step` (reserved in `caches`) and queues its upload on `stream`.
  void pack(const StepLayout& step, const ModelTopology& topology, const DeviceCaches& caches, cudaStream_t stream);

  int64_t tokens() const { return tokens_; }
  // [step tokens] i32: the token's entry in the step (row of every block table), its position,
  // its sequence's slot in the compressor rings.
  const TensorView& token_sequence() const { return token_sequence_; }
  const TensorView& token_position() const { return token_position_; }
  const TensorView& state_slot() const { return state_slot_; }
  // [step tokens] i32 when the step has image spans (StepLayout::windows), else absent: the first
  // and last window position each token attends; and the most window rows a token has then.
  const TensorView& window_first() const { return window_first_; }
  const TensorView& window_last() const { return window_last_; }
  int64_t max_window_rows() const { return max_window_rows_; }
  const LayerStep& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  size_t device_bytes() const { return upload_.capacity(); }

 private:
  StepUpload upload_;
  int64_t tokens_ = 0;
  TensorView token_sequence_, token_position_, state_slot_, window_first_, window_last_;
  int64_t max_window_rows_ = 0;
  std::vector<LayerStep> layers_;
};

}  // namespace dsv4::cuda

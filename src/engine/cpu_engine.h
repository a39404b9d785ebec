// The CPU backend (Backend::cpu): the reference layers (src/reference) over the reference's cache
// stores, behind the step engine's protocol. Exposed inside the library (and to tests) for the
// diagnostics the public interface does not carry.
#pragma once

#include <memory>
#include <vector>

#include "engine/step_engine.h"
#include "reference/cache_store.h"
#include "reference/layer.h"

namespace dsv4 {

class CpuEngine final : public StepEngine {
 public:
  CpuEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights, const EngineOptions& options);

  EngineMemory memory() const override;
  CUstream_st* cuda_stream() const override { return nullptr; }
  uint64_t step_graph_key() const override { return 0; }

  // Diagnostics. When on, index sources keep the masked scores their top-k ran on.
  void set_record_index_scores(bool on) { record_index_scores_ = on; }
  // What `layer` published in the current (or last) step.
  const reference::LayerPublication& publication(int layer) const;
  // Every sequence's caches, e.g. to compare them with a reference's final state.
  const reference::CacheStore& cache_store() const { return *caches_; }

 private:
  void add_sequence_caches(SequenceId id) override { caches_->add_sequence(id); }
  void fork_sequence_caches(SequenceId parent, SequenceId child) override { caches_->fork_sequence(parent, child); }
  void release_sequence_caches(SequenceId id) override { caches_->release_sequence(id); }
  void rollback_sequence_caches(SequenceId id, int64_t new_length) override { caches_->rollback(id, new_length); }
  int64_t cached_length(SequenceId id) const override { return caches_->length(id); }
  int64_t cached_bytes(SequenceId id) const override { return caches_->cache_bytes(id); }
  void prepare_step(const StepLayout& step) override;
  void run_layer_step(int layer, const TensorView& hidden_in, const TensorView& attn_out) override;
  bool accepts_activations_on(Device device) const override { return device == Device::cpu; }
  HostTensor read_picks(int layer) const override;
  void commit_sequence(const StepChunk& chunk) override { caches_->commit(chunk.sequence, chunk.tokens); }
  void run_draft_context_step(const TensorView& main_hidden) override;
  void run_draft_block_layer(int layer, const std::vector<SequenceId>& sequences, const std::vector<int64_t>& lengths,
                             const TensorView& hidden_in, const TensorView& attn_out) override;
  // Never called: the cpu backend's step graph key is 0.
  void capture_step_graph(uint64_t, const std::function<void()>&) override { fail("engine: cpu: no step graphs"); }
  void launch_step_graph(uint64_t) override { fail("engine: cpu: no step graphs"); }

  std::vector<reference::LayerParameters> layers_;  // absent MTP layers: the recipe only
  std::unique_ptr<reference::CacheStore> caches_;
  std::vector<reference::LayerPublication> published_;
  bool record_index_scores_ = false;
};

}  // namespace dsv4

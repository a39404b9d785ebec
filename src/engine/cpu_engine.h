// The CPU backend of dsv4::Engine: the reference layers (src/reference) over per-sequence caches.
// Exposed inside the library (and to tests) for the diagnostics the public interface does not carry.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "dsv4/engine.h"
#include "engine/sequence_registry.h"
#include "reference/layer.h"
#include "reference/cache_store.h"

namespace dsv4 {

class CpuEngine final : public Engine {
 public:
  CpuEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights, const EngineOptions& options);

  const ModelConfig& config() const override { return config_; }
  const ModelTopology& topology() const override { return topology_; }

  SequenceId add_sequence() override;
  SequenceId fork_sequence(SequenceId parent) override;
  void release_sequence(SequenceId sequence) override;
  int64_t sequence_length(SequenceId sequence) const override;

  void begin_step(const std::vector<StepEntry>& entries) override;
  void run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) override;
  HostTensor layer_picks(int layer) const override;
  void end_step() override;

  int64_t sequence_cache_bytes(SequenceId sequence) const override;

  // Diagnostics. When on, index sources keep the masked scores their top-k ran on.
  void set_record_index_scores(bool on) { record_index_scores_ = on; }
  // What `layer` published in the current (or last) step.
  const reference::LayerPublication& publication(int layer) const;
  // Every sequence's caches, e.g. to compare them with a reference's final state.
  const reference::CacheStore& cache_store() const { return *caches_; }

 private:
  void check_layer(const char* operation, int layer) const;
  void check_activation(const char* name, const TensorView& v, int layer) const;
  void check_layer_inputs(int layer) const;

  ModelConfig config_;
  ModelTopology topology_;
  std::shared_ptr<const ModelWeights> weights_;
  EngineOptions options_;
  std::vector<reference::LayerParameters> layers_;
  std::vector<bool> layer_has_weights_;  // false for MTP layers absent from the checkpoint
  std::unique_ptr<reference::CacheStore> caches_;
  SequenceRegistry sequences_;

  bool in_step_ = false;
  std::vector<StepEntry> step_entries_;
  reference::StepLayout step_;
  std::vector<reference::LayerPublication> published_;
  bool record_index_scores_ = false;
};

}  // namespace dsv4

// The engine protocol, written once for every backend (SPEC §1.3): sequences (add, fork, release,
// lengths), the checks of begin_step / run_layer / layer_picks / end_step, the layer-order rules
// and the bookkeeping of layers a sequence skipped. A backend derives from StepEngine and
// implements only the hooks below: its caches, the preparation of a step, one layer, the picks
// and the commit. Nothing a hook is handed has to be checked again.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "common/step_layout.h"
#include "dsv4/engine.h"
#include "engine/sequence_registry.h"
#include "model/layer_recipe.h"

namespace dsv4 {

class StepEngine : public Engine {
 public:
  const ModelConfig& config() const final { return config_; }
  const ModelTopology& topology() const final { return topology_; }

  SequenceId add_sequence() final;
  SequenceId fork_sequence(SequenceId parent) final;
  void release_sequence(SequenceId sequence) final;
  int64_t sequence_length(SequenceId sequence) const final;
  void rollback_sequence(SequenceId sequence, int64_t new_length) final;
  int64_t sequence_cache_bytes(SequenceId sequence) const final;

  void begin_step(const std::vector<StepEntry>& entries) final;
  void run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) final;
  HostTensor layer_picks(int layer) const final;
  void end_step() final;
  bool run_step_graph(const std::function<void()>& enqueue) final;
  void run_draft_context(const TensorView& main_hidden) final;
  void run_draft_block(int layer, const std::vector<SequenceId>& sequences, const TensorView& hidden_in,
                       const TensorView& attn_out) final;

 protected:
  // Engine::create checked the options against the config and the weights.
  StepEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights, const EngineOptions& options);

  // ----- hooks
  // A sequence's caches: created empty, forked from a live parent (the parent is not part of a
  // running step), released. The ids are new or live as the operation needs.
  virtual void add_sequence_caches(SequenceId id) = 0;
  virtual void fork_sequence_caches(SequenceId parent, SequenceId child) = 0;
  virtual void release_sequence_caches(SequenceId id) = 0;
  // Shrinks a sequence's caches to its first new_length tokens (checked: within what the caches
  // keep, below its length, not in a running step).
  virtual void rollback_sequence_caches(SequenceId id, int64_t new_length) = 0;
  // Committed tokens of a sequence, and the bytes of cache it holds.
  virtual int64_t cached_length(SequenceId id) const = 0;
  virtual int64_t cached_bytes(SequenceId id) const = 0;
  // Reserves the step's cache space and prepares the step (step() is not yet set). All-or-nothing:
  // when a pool is exhausted it throws and nothing changed.
  virtual void prepare_step(const StepLayout& step) = 0;
  // Runs layer `layer` of step(); hidden_in and attn_out are [step tokens, hidden_size] f32,
  // contiguous, on a device accepts_activations_on() allows.
  virtual void run_layer_step(int layer, const TensorView& hidden_in, const TensorView& attn_out) = 0;
  virtual bool accepts_activations_on(Device device) const = 0;
  // The picks the index source `layer` published in step(): [step tokens, index_topk] i32.
  virtual HostTensor read_picks(int layer) const = 0;
  // Advances the chunk's sequence by the chunk's tokens.
  virtual void commit_sequence(const StepChunk& chunk) = 0;
  // DSpark: stores every draft layer's window rows of step()'s tokens from main_hidden
  // [step tokens, dspark_main_width] f32 (SPEC §13.1 step 1).
  virtual void run_draft_context_step(const TensorView& main_hidden) = 0;
  // DSpark: draft layer `layer` over the blocks of live sequences of committed length >= 1, not in a
  // step; hidden_in, attn_out [blocks · dspark_block_size, hidden_size] f32, contiguous.
  virtual void run_draft_block_layer(int layer, const std::vector<SequenceId>& sequences,
                                     const std::vector<int64_t>& lengths, const TensorView& hidden_in,
                                     const TensorView& attn_out) = 0;
  // Step graphs (backends with a nonzero step_graph_key()): capture what `enqueue` queues into
  // the graph of `key` and launch it; launch the graph of `key`, captured earlier.
  virtual void capture_step_graph(uint64_t key, const std::function<void()>& enqueue) = 0;
  virtual void launch_step_graph(uint64_t key) = 0;

  // ----- for the backends
  const ModelWeights& weights() const { return *weights_; }
  const EngineOptions& options() const { return options_; }
  // False for an MTP layer the checkpoint leaves out (transformers checkpoints) and for a layer
  // outside options().layers: it cannot run.
  bool layer_present(int layer) const { return present_[static_cast<size_t>(layer)] != 0; }
  // How each layer computes (one per layer, also for absent ones), and the formats of paged
  // caches (options().kv_format, or default_kv_formats): decided once for every backend.
  const std::vector<LayerRecipe>& recipes() const { return recipes_; }
  const KvFormatSet& kv_formats() const { return kv_formats_; }
  // The running step (kept after end_step until the next begin_step).
  const StepLayout& step() const { return step_; }
  bool layer_ran(int layer) const { return ran_[static_cast<size_t>(layer)] != 0; }

 private:
  void check_layer(const char* operation, int layer) const;
  void check_activation(const char* operation, const char* name, const TensorView& v, int64_t rows, int64_t width,
                        const char* shape_meaning) const;
  bool in_running_step(SequenceId sequence) const;

  ModelConfig config_;
  ModelTopology topology_;
  std::shared_ptr<const ModelWeights> weights_;
  EngineOptions options_;
  std::vector<uint8_t> present_;  // per layer
  std::vector<LayerRecipe> recipes_;
  KvFormatSet kv_formats_;
  SequenceRegistry sequences_;

  bool in_step_ = false;
  StepLayout step_;
  std::vector<uint8_t> ran_;      // per layer: ran in this step
  std::map<uint64_t, std::vector<uint8_t>> graph_ran_;  // per step graph key: the layers its graph runs
};

}  // namespace dsv4

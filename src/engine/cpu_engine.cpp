#include "engine/cpu_engine.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "dsv4/error.h"
#include "engine/layer_order.h"

namespace dsv4 {
namespace {

// Sets the OpenMP thread count for the duration of a call (0: leave it) and restores it.
class ThreadCountScope {
 public:
  explicit ThreadCountScope(int threads) : saved_(omp_get_max_threads()) {
    if (threads > 0) omp_set_num_threads(threads);
  }
  ~ThreadCountScope() { omp_set_num_threads(saved_); }
  ThreadCountScope(const ThreadCountScope&) = delete;
  ThreadCountScope& operator=(const ThreadCountScope&) = delete;

 private:
  int saved_;
};

bool has_any_weight(const LayerWeights& w) {
  return std::any_of(w.tensors.begin(), w.tensors.end(), [](const auto& t) { return t.has_value(); });
}


}  // namespace

CpuEngine::CpuEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                     const EngineOptions& options)
    : config_(config),
      topology_(resolve_topology(config)),
      weights_(std::move(weights)),
      options_(options),
      sequences_(static_cast<size_t>(config.total_layers()), options.max_sequences) {
  // Engine::create checked what every backend needs.
  DSV4_CHECK(options_.num_threads >= 0, "engine: create: num_threads is ", options_.num_threads,
             ", expected >= 0 (0: all cores)");

  std::vector<reference::LayerCacheShape> shapes;
  for (int l = 0; l < config_.total_layers(); ++l) {
    const LayerPlan& plan = topology_[l];
    const LayerWeights& w = weights_->layers[static_cast<size_t>(l)];
    // transformers checkpoints leave the MTP layers out; such a layer cannot run.
    const bool present = !plan.is_mtp || has_any_weight(w);
    layer_has_weights_.push_back(present);
    if (present) {
      layers_.push_back(reference::prepare_layer(config_, plan, w, options_.precision, options_.split_index_heads));
    } else {
      layers_.emplace_back();
      layers_.back().plan = plan;
    }
    shapes.push_back(present ? reference::layer_cache_shape(config_, layers_.back()) : reference::LayerCacheShape{});
  }
  caches_ = options_.kv_format.empty()
                ? reference::make_float_cache_store(std::move(shapes))
                : reference::make_paged_cache_store(config_, topology_, std::move(shapes), options_);
  published_.resize(layers_.size());
}

// ---------------------------------------------------------------------------------------------
// Sequences

SequenceId CpuEngine::add_sequence() {
  return sequences_.add([&](SequenceId id) { caches_->add_sequence(id); });
}

SequenceId CpuEngine::fork_sequence(SequenceId parent) {
  sequences_.skipped_layers("fork_sequence", parent);
  DSV4_CHECK(!(in_step_ && step_contains(step_entries_, parent)), "engine: fork_sequence: sequence ", parent,
             " is part of the running step; fork it before begin_step or after end_step");
  return sequences_.fork(parent, [&](SequenceId id) { caches_->fork_sequence(parent, id); });
}

void CpuEngine::release_sequence(SequenceId sequence) {
  sequences_.skipped_layers("release_sequence", sequence);
  DSV4_CHECK(!(in_step_ && step_contains(step_entries_, sequence)), "engine: release_sequence: sequence ", sequence,
             " is part of the running step; release it after end_step");
  caches_->release_sequence(sequence);
  sequences_.remove(sequence);
}

int64_t CpuEngine::sequence_length(SequenceId sequence) const {
  sequences_.skipped_layers("sequence_length", sequence);
  return caches_->length(sequence);
}

int64_t CpuEngine::sequence_cache_bytes(SequenceId sequence) const {
  sequences_.skipped_layers("sequence_cache_bytes", sequence);
  return caches_->cache_bytes(sequence);
}

// ---------------------------------------------------------------------------------------------
// Steps

void CpuEngine::begin_step(const std::vector<StepEntry>& entries) {
  DSV4_CHECK(!in_step_, "engine: begin_step: a step is in progress; call end_step first");
  sequences_.check_step(entries, options_, [&](SequenceId s) { return caches_->length(s); });
  reference::StepLayout layout;
  int64_t tokens = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StepEntry& e = entries[i];
    const int64_t length = caches_->length(e.sequence);
    layout.chunks.push_back({e.sequence, tokens, e.num_tokens, length});
    for (int64_t k = 0; k < e.num_tokens; ++k) {
      layout.positions.push_back(length + k);
      layout.chunk_of.push_back(static_cast<int32_t>(i));
    }
    tokens += e.num_tokens;
  }
  caches_->reserve(entries);  // all-or-nothing: a full pool throws here and nothing changed
  step_entries_ = entries;
  step_ = std::move(layout);
  published_.assign(layers_.size(), {});
  in_step_ = true;
}

void CpuEngine::check_layer(const char* operation, int layer) const {
  DSV4_CHECK(layer >= 0 && layer < topology_.size(), "engine: ", operation, ": layer ", layer,
             " does not exist (the model has ", topology_.size(), " layers)");
}

void CpuEngine::check_activation(const char* name, const TensorView& v, int layer) const {
  const std::vector<int64_t> expected{step_.tokens(), config_.hidden_size};
  const std::vector<int64_t> given(v.shape.begin(), v.shape.begin() + std::clamp(v.rank, 0, kMaxRank));
  DSV4_CHECK(v.device == Device::cpu, "engine: run_layer: layer ", layer, " ", name, " is on ", device_name(v.device),
             ", the cpu backend needs host memory");
  DSV4_CHECK(v.dtype == DType::f32, "engine: run_layer: layer ", layer, " ", name, " has dtype ", dtype_name(v.dtype),
             ", expected F32");
  DSV4_CHECK(given == expected, "engine: run_layer: layer ", layer, " ", name, " has shape ", shape_string(given),
             ", expected ", shape_string(expected), " (step tokens, hidden_size)");
  DSV4_CHECK(v.is_contiguous() && v.data != nullptr, "engine: run_layer: layer ", layer, " ", name,
             " must be a contiguous view of existing memory");
}

void CpuEngine::check_layer_inputs(int layer) const {
  bool skipped = false;
  for (const reference::StepChunk& ch : step_.chunks)
    skipped = skipped || sequences_.skipped_layers("run_layer", ch.sequence)[static_cast<size_t>(layer)];
  check_layer_may_run(config_, topology_, layer, layer_has_weights_[static_cast<size_t>(layer)], skipped,
                      [&](int l) { return published_[static_cast<size_t>(l)].ran; });
}

void CpuEngine::run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  DSV4_CHECK(in_step_, "engine: run_layer: no step is in progress; call begin_step first");
  check_layer("run_layer", layer);
  check_layer_inputs(layer);
  check_activation("hidden_in", hidden_in, layer);
  check_activation("attn_out", attn_out, layer);
  ThreadCountScope threads(options_.num_threads);
  reference::run_layer_step(config_, layers_[static_cast<size_t>(layer)], step_, *caches_, hidden_in.ptr<float>(),
                            attn_out.ptr<float>(), published_, record_index_scores_,
                            {options_.communicator.get(), options_.split_index_heads > 0});
}

HostTensor CpuEngine::layer_picks(int layer) const {
  check_layer("layer_picks", layer);
  const LayerPlan& plan = topology_[layer];
  DSV4_CHECK(plan.owns_indexer, "engine: layer_picks: layer ", layer, " is not an index source",
             plan.index_source >= 0 ? " (it reuses the picks of layer " + std::to_string(plan.index_source) + ")" : "");
  const reference::LayerPublication& p = published_[static_cast<size_t>(layer)];
  if (!p.ran) return HostTensor();
  HostTensor picks(DType::i32, {step_.tokens(), config_.index_topk});
  std::memcpy(picks.data(), p.picks.data(), picks.nbytes());
  return picks;
}

void CpuEngine::end_step() {
  DSV4_CHECK(in_step_, "engine: end_step: no step is in progress");
  // MTP layers are optional: a sequence whose step skipped one can no longer run it.
  for (int l = 0; l < config_.num_layers; ++l)
    DSV4_CHECK(published_[static_cast<size_t>(l)].ran, "engine: end_step: layer ", l, " has not run in this step");
  for (const reference::StepChunk& ch : step_.chunks) {
    std::vector<uint8_t>& skipped = sequences_.skipped_layers("end_step", ch.sequence);
    for (int l = config_.num_layers; l < topology_.size(); ++l)
      if (!published_[static_cast<size_t>(l)].ran) skipped[static_cast<size_t>(l)] = 1;
    caches_->commit(ch.sequence, ch.tokens);
  }
  in_step_ = false;
}

const reference::LayerPublication& CpuEngine::publication(int layer) const {
  check_layer("publication", layer);
  return published_[static_cast<size_t>(layer)];
}

}  // namespace dsv4

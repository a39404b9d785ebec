#include "engine/step_engine.h"

#include <algorithm>

#include "common/image_spans.h"
#include "dsv4/error.h"
#include "dsv4/parallel.h"
#include "engine/layer_order.h"

namespace dsv4 {
namespace {

bool has_any_weight(const LayerWeights& w) {
  return std::any_of(w.tensors.begin(), w.tensors.end(), [](const auto& t) { return t.has_value(); });
}

}  // namespace

StepEngine::StepEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                       const EngineOptions& options)
    : config_(config),
      topology_(resolve_topology(config)),
      weights_(std::move(weights)),
      options_(options),
      kv_formats_(options.kv_format.empty() ? default_kv_formats(config, options.precision)
                                            : kv_format_set(options.kv_format)),
      sequences_(static_cast<size_t>(config.total_layers()), options.max_sequences) {
  // A tensor-parallel shard with a split indexer scales its index weights by the whole model's heads.
  const int ranks = options.communicator ? options.communicator->size() : 1;
  const int64_t counted = index_heads_counted(config, options.indexer_sharding, ranks);
  for (int l = 0; l < topology_.size(); ++l) {
    // transformers checkpoints leave the MTP layers out, a drafter the backbone; such a layer cannot run.
    const bool present = layer_in_set(topology_[l], options.layers) &&
                         (!topology_[l].is_mtp || has_any_weight(weights_->layers[static_cast<size_t>(l)]));
    present_.push_back(present ? 1 : 0);
    LayerRecipe& r = recipes_.emplace_back(layer_recipe(config, topology_[l], options.precision, counted));
    for (std::optional<CompressorGeometry>* c : {&r.compressor, &r.index_compressor})
      if (*c) (*c)->rollback_rows = options.max_rollback;
  }
  ran_.assign(present_.size(), 0);
}

// ---------------------------------------------------------------------------------------------
// Sequences

bool StepEngine::in_running_step(SequenceId sequence) const {
  return in_step_ && std::any_of(step_.chunks.begin(), step_.chunks.end(),
                                 [&](const StepChunk& c) { return c.sequence == sequence; });
}

SequenceId StepEngine::add_sequence() {
  return sequences_.add([&](SequenceId id) { add_sequence_caches(id); });
}

SequenceId StepEngine::fork_sequence(SequenceId parent) {
  sequences_.skipped_layers("fork_sequence", parent);
  DSV4_CHECK(!in_running_step(parent), "engine: fork_sequence: sequence ", parent,
             " is part of the running step; fork it before begin_step or after end_step");
  return sequences_.fork(parent, [&](SequenceId id) { fork_sequence_caches(parent, id); });
}

void StepEngine::release_sequence(SequenceId sequence) {
  sequences_.skipped_layers("release_sequence", sequence);
  DSV4_CHECK(!in_running_step(sequence), "engine: release_sequence: sequence ", sequence,
             " is part of the running step; release it after end_step");
  release_sequence_caches(sequence);
  sequences_.remove(sequence);
}

int64_t StepEngine::sequence_length(SequenceId sequence) const {
  sequences_.skipped_layers("sequence_length", sequence);
  return cached_length(sequence);
}

void StepEngine::rollback_sequence(SequenceId sequence, int64_t new_length) {
  const int64_t longest = sequences_.longest_length("rollback_sequence", sequence);
  DSV4_CHECK(!in_running_step(sequence), "engine: rollback_sequence: sequence ", sequence,
             " is part of the running step; roll it back after end_step");
  const int64_t length = cached_length(sequence), floor = std::max<int64_t>(0, longest - options_.max_rollback);
  DSV4_CHECK(new_length >= floor && new_length <= length, "engine: rollback_sequence: sequence ", sequence,
             " to length ", new_length, ": expected a length in [", floor, ", ", length, "] (its length is ", length,
             "; the caches keep max_rollback = ", options_.max_rollback, " tokens behind its longest length ",
             longest, ")");
  if (new_length < length) rollback_sequence_caches(sequence, new_length);
}

int64_t StepEngine::sequence_cache_bytes(SequenceId sequence) const {
  sequences_.skipped_layers("sequence_cache_bytes", sequence);
  return cached_bytes(sequence);
}

// ---------------------------------------------------------------------------------------------
// Steps

void StepEngine::begin_step(const std::vector<StepEntry>& entries) {
  DSV4_CHECK(!in_step_, "engine: begin_step: a step is in progress; call end_step first");
  sequences_.check_step(entries, options_, [&](SequenceId s) { return cached_length(s); });
  StepLayout layout;
  int64_t tokens = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StepEntry& e = entries[i];
    const int64_t length = cached_length(e.sequence);
    layout.chunks.push_back({e.sequence, tokens, e.num_tokens, length});
    for (int64_t k = 0; k < e.num_tokens; ++k) {
      layout.positions.push_back(length + k);
      layout.chunk_of.push_back(static_cast<int32_t>(i));
    }
    tokens += e.num_tokens;
  }
  lay_out_image_spans(layout, entries, config_.sliding_window, config_.vision_max_n_token);
  prepare_step(layout);  // all-or-nothing: a full pool throws here and nothing changed
  step_ = std::move(layout);
  ran_.assign(ran_.size(), 0);
  in_step_ = true;
}

void StepEngine::check_layer(const char* operation, int layer) const {
  DSV4_CHECK(layer >= 0 && layer < topology_.size(), "engine: ", operation, ": layer ", layer,
             " does not exist (the model has ", topology_.size(), " layers)");
}

// `operation` names the call and the layer, e.g. "run_layer: layer 3".
void StepEngine::check_activation(const char* operation, const char* name, const TensorView& v, int64_t rows,
                                  int64_t width, const char* shape_meaning) const {
  const std::vector<int64_t> expected{rows, width};
  const std::vector<int64_t> given(v.shape.begin(), v.shape.begin() + std::clamp(v.rank, 0, kMaxRank));
  DSV4_CHECK(accepts_activations_on(v.device), "engine: ", operation, " ", name, " is on ", device_name(v.device),
             ", which the ", backend_name(options_.backend), " backend cannot read");
  DSV4_CHECK(v.dtype == DType::f32, "engine: ", operation, " ", name, " has dtype ", dtype_name(v.dtype),
             ", expected F32");
  DSV4_CHECK(given == expected, "engine: ", operation, " ", name, " has shape ", shape_string(given), ", expected ",
             shape_string(expected), " (", shape_meaning, ")");
  DSV4_CHECK(v.is_contiguous() && v.data != nullptr, "engine: ", operation, " ", name,
             " must be a contiguous view of existing memory");
}

void StepEngine::run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  DSV4_CHECK(in_step_, "engine: run_layer: no step is in progress; call begin_step first");
  check_layer("run_layer", layer);
  DSV4_CHECK(topology_[layer].kind != AttentionKind::dspark, "engine: run_layer: layer ", layer,
             " is a DSpark draft layer: give it the target's hidden states with run_draft_context and run its "
             "blocks with run_draft_block");
  DSV4_CHECK(layer_in_set(topology_[layer], options_.layers), "engine: run_layer: layer ", layer,
             " is a backbone layer, which a drafter engine (EngineOptions::layers = draft) does not run");
  bool skipped = false;
  for (const StepChunk& ch : step_.chunks)
    skipped = skipped || sequences_.skipped_layers("run_layer", ch.sequence)[static_cast<size_t>(layer)];
  check_layer_may_run(config_, topology_, layer, layer_present(layer), skipped, [&](int l) { return layer_ran(l); });
  const std::string operation = "run_layer: layer " + std::to_string(layer);
  check_activation(operation.c_str(), "hidden_in", hidden_in, step_.tokens(), config_.hidden_size,
                   "step tokens, hidden_size");
  check_activation(operation.c_str(), "attn_out", attn_out, step_.tokens(), config_.hidden_size,
                   "step tokens, hidden_size");
  run_layer_step(layer, hidden_in, attn_out);
  ran_[static_cast<size_t>(layer)] = 1;
}

HostTensor StepEngine::layer_picks(int layer) const {
  check_layer("layer_picks", layer);
  const LayerPlan& plan = topology_[layer];
  DSV4_CHECK(plan.owns_indexer, "engine: layer_picks: layer ", layer, " is not an index source",
             plan.index_source >= 0 ? " (it reuses the picks of layer " + std::to_string(plan.index_source) + ")" : "");
  if (!layer_ran(layer)) return HostTensor();  // kept after end_step until the next step
  return read_picks(layer);
}

void StepEngine::end_step() {
  DSV4_CHECK(in_step_, "engine: end_step: no step is in progress");
  // MTP layers are optional: a sequence whose step skipped one can no longer run it.
  for (int l = 0; l < config_.num_layers; ++l)
    DSV4_CHECK(layer_ran(l) || !layer_in_set(topology_[l], options_.layers), "engine: end_step: layer ", l,
               " has not run in this step");
  for (const StepChunk& ch : step_.chunks) {
    std::vector<uint8_t>& skipped = sequences_.skipped_layers("end_step", ch.sequence);
    for (int l = config_.num_layers; l < topology_.size(); ++l)
      if (!layer_ran(l)) skipped[static_cast<size_t>(l)] = 1;
    commit_sequence(ch);
    sequences_.note_length(ch.sequence, cached_length(ch.sequence));
  }
  in_step_ = false;
}

bool StepEngine::run_step_graph(const std::function<void()>& enqueue) {
  DSV4_CHECK(in_step_, "engine: run_step_graph: no step is in progress; call begin_step first");
  DSV4_CHECK(std::none_of(ran_.begin(), ran_.end(), [](uint8_t r) { return r != 0; }),
             "engine: run_step_graph: layers of this step already ran outside the graph");
  const uint64_t key = step_graph_key();
  if (key == 0) {
    enqueue();
    return false;
  }
  const auto captured = graph_ran_.find(key);
  if (captured == graph_ran_.end()) {
    capture_step_graph(key, enqueue);  // run_layer's checks and bookkeeping run as it captures
    graph_ran_[key] = ran_;
    return false;
  }
  // The graph runs the layers its capture ran; those checks that depend on the sequences (an MTP
  // layer a sequence skipped earlier) are made again.
  for (int l = config_.num_layers; l < topology_.size(); ++l) {
    if (!captured->second[static_cast<size_t>(l)]) continue;
    for (const StepChunk& ch : step_.chunks)
      DSV4_CHECK(!sequences_.skipped_layers("run_step_graph", ch.sequence)[static_cast<size_t>(l)],
                 "engine: run_step_graph: the step graph runs MTP layer ", l, ", which sequence ", ch.sequence,
                 " skipped in an earlier step");
  }
  launch_step_graph(key);
  ran_ = captured->second;
  return true;
}

// ---------------------------------------------------------------------------------------------
// DSpark draft layers

void StepEngine::run_draft_context(const TensorView& main_hidden) {
  DSV4_CHECK(config_.has_dspark(), "engine: run_draft_context: config ", config_.name,
             " has no DSpark draft layers (no dspark_target_layer_ids)");
  DSV4_CHECK(in_step_, "engine: run_draft_context: no step is in progress; call begin_step first");
  const int first = config_.num_layers;
  DSV4_CHECK(!layer_ran(first), "engine: run_draft_context: already ran in this step");
  for (int l = first; l < topology_.size(); ++l) {
    DSV4_CHECK(layer_present(l), "engine: run_draft_context: draft layer ", l, " has no weights in the checkpoint");
    for (const StepChunk& ch : step_.chunks)
      DSV4_CHECK(!sequences_.skipped_layers("run_draft_context", ch.sequence)[static_cast<size_t>(l)],
                 "engine: run_draft_context: sequence ", ch.sequence,
                 " skipped the draft context in an earlier step; its draft windows are incomplete");
  }
  check_activation("run_draft_context", "main_hidden", main_hidden, step_.tokens(), config_.dspark_main_width(),
                   "step tokens, hidden_size x dspark_target_layer_ids");
  run_draft_context_step(main_hidden);
  for (int l = first; l < topology_.size(); ++l) ran_[static_cast<size_t>(l)] = 1;
}

void StepEngine::run_draft_block(int layer, const std::vector<SequenceId>& sequences, const TensorView& hidden_in,
                                 const TensorView& attn_out) {
  check_layer("run_draft_block", layer);
  DSV4_CHECK(topology_[layer].kind == AttentionKind::dspark, "engine: run_draft_block: layer ", layer, " is ",
             describe_plan(topology_[layer]), ", not a DSpark draft layer");
  DSV4_CHECK(layer_present(layer), "engine: run_draft_block: draft layer ", layer, " has no weights in the checkpoint");
  DSV4_CHECK(!in_step_, "engine: run_draft_block: a step is in progress; draft blocks read committed windows, "
             "run them after end_step");
  DSV4_CHECK(!sequences.empty(), "engine: run_draft_block: no sequences given");
  const int64_t B = config_.dspark_block_size;
  const int64_t rows = static_cast<int64_t>(sequences.size()) * B;
  DSV4_CHECK(rows <= options_.max_tokens_per_step, "engine: run_draft_block: ", sequences.size(),
             " blocks of ", B, " rows exceed max_tokens_per_step = ", options_.max_tokens_per_step);
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const SequenceId s = sequences[i];
    DSV4_CHECK(std::find(sequences.begin(), sequences.begin() + static_cast<std::ptrdiff_t>(i), s) ==
                   sequences.begin() + static_cast<std::ptrdiff_t>(i),
               "engine: run_draft_block: sequence ", s, " is given twice");
    DSV4_CHECK(!sequences_.skipped_layers("run_draft_block", s)[static_cast<size_t>(layer)],
               "engine: run_draft_block: sequence ", s, " skipped the draft context in an earlier step; the window of "
               "draft layer ", layer, " is incomplete");
    lengths.push_back(cached_length(s));
    DSV4_CHECK(lengths.back() >= 1, "engine: run_draft_block: sequence ", s,
               " has no committed token; a draft block follows the last committed token p0");
    DSV4_CHECK(lengths.back() + B <= options_.max_context, "engine: run_draft_block: sequence ", s,
               "'s block reaches position ", lengths.back() + B - 1, ", beyond max_context ", options_.max_context,
               " (positions 0 ... ", options_.max_context - 1, ")");
  }
  const std::string operation = "run_draft_block: layer " + std::to_string(layer);
  check_activation(operation.c_str(), "hidden_in", hidden_in, rows, config_.hidden_size,
                   "sequences x dspark_block_size, hidden_size");
  check_activation(operation.c_str(), "attn_out", attn_out, rows, config_.hidden_size,
                   "sequences x dspark_block_size, hidden_size");
  run_draft_block_layer(layer, sequences, lengths, hidden_in, attn_out);
}

}  // namespace dsv4

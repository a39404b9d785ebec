#include "engine/cpu_engine.h"

#include <omp.h>

#include <cstring>

#include "dsv4/error.h"
#include "dsv4/parallel.h"

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

int64_t float_bytes(const std::vector<float>& v) { return static_cast<int64_t>(v.size() * sizeof(float)); }

int64_t parameter_bytes(const reference::LayerParameters& L) {
  int64_t bytes = 0;
  for (const reference::Projection* p : {&L.wq_a, &L.wq_b, &L.wkv, &L.wo_a, &L.wo_b, &L.indexer_wk, &L.indexer_wq_b,
                                         &L.indexer_weights_proj, &L.compressor.projection,
                                         &L.index_compressor.projection})
    bytes += float_bytes(p->weight);
  bytes += float_bytes(L.main_proj.weight);
  for (const std::vector<float>* v : {&L.q_norm, &L.kv_norm, &L.attn_sink, &L.indexer_k_norm, &L.compressor.norm, &L.main_norm,
                                      &L.compressor.position_bias, &L.index_compressor.norm,
                                      &L.index_compressor.position_bias})
    bytes += float_bytes(*v);
  return bytes;
}

}  // namespace

CpuEngine::CpuEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                     const EngineOptions& options)
    : StepEngine(config, std::move(weights), options) {
  DSV4_CHECK(options.num_threads >= 0, "engine: create: num_threads is ", options.num_threads,
             ", expected >= 0 (0: all cores)");
  std::vector<reference::LayerCacheShape> shapes;
  for (int l = 0; l < topology().size(); ++l) {
    const LayerRecipe& recipe = recipes()[static_cast<size_t>(l)];
    if (layer_present(l)) {
      layers_.push_back(reference::prepare_layer(config, recipe, this->weights().layers[static_cast<size_t>(l)]));
      shapes.push_back(reference::layer_cache_shape(config, layers_.back()));
      shapes.back().rollback_rows = options.max_rollback;
    } else {
      layers_.emplace_back().recipe = recipe;
      shapes.emplace_back();
    }
  }
  caches_ = options.cache_storage == CacheStorage::float_rows
                ? reference::make_float_cache_store(std::move(shapes))
                : reference::make_paged_cache_store(config, topology(), std::move(shapes), kv_formats(),
                                                    {.max_sequences = options.max_sequences,
                                                     .max_context = options.max_context,
                                                     .max_step_tokens = options.max_tokens_per_step});
  published_.resize(layers_.size());
}

EngineMemory CpuEngine::memory() const {
  EngineMemory m;
  for (const reference::LayerParameters& L : layers_) m.weights += parameter_bytes(L);
  m.caches = caches_->held_bytes();
  return m;
}

void CpuEngine::prepare_step(const StepLayout& step) {
  std::vector<StepEntry> entries;
  for (const StepChunk& ch : step.chunks) entries.push_back({ch.sequence, ch.tokens});
  caches_->reserve(entries);  // all-or-nothing: a full pool throws here and nothing changed
  published_.assign(layers_.size(), {});
}

void CpuEngine::run_layer_step(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  ThreadCountScope threads(options().num_threads);
  reference::run_layer_step(config(), layers_[static_cast<size_t>(layer)], step(), *caches_, hidden_in.ptr<float>(),
                            attn_out.ptr<float>(), published_, record_index_scores_,
                            {options().communicator.get(), options().indexer_sharding == IndexerSharding::split});
}

void CpuEngine::run_draft_context_step(const TensorView& main_hidden) {
  ThreadCountScope threads(options().num_threads);
  const int first = config().num_layers;
  std::vector<float> main_x(static_cast<size_t>(step().tokens() * config().hidden_size));
  reference::draft_main_input(config(), layers_[static_cast<size_t>(first)], step().tokens(), main_hidden.ptr<float>(),
                              main_x.data());
  for (int l = first; l < topology().size(); ++l)
    reference::write_draft_context(config(), layers_[static_cast<size_t>(l)], step(), *caches_, main_x.data());
}

void CpuEngine::run_draft_block_layer(int layer, const std::vector<SequenceId>& sequences,
                                      const std::vector<int64_t>& lengths, const TensorView& hidden_in,
                                      const TensorView& attn_out) {
  ThreadCountScope threads(options().num_threads);
  std::vector<reference::DraftBlock> blocks;
  for (size_t i = 0; i < sequences.size(); ++i) blocks.push_back({sequences[i], lengths[i]});
  reference::run_draft_block(config(), layers_[static_cast<size_t>(layer)], blocks, *caches_, hidden_in.ptr<float>(),
                             attn_out.ptr<float>());
}

HostTensor CpuEngine::read_picks(int layer) const {
  const reference::LayerPublication& p = published_[static_cast<size_t>(layer)];
  HostTensor picks(DType::i32, {step().tokens(), config().index_topk});
  std::memcpy(picks.data(), p.picks.data(), picks.nbytes());
  return picks;
}

const reference::LayerPublication& CpuEngine::publication(int layer) const {
  DSV4_CHECK(layer >= 0 && layer < topology().size(), "engine: publication: layer ", layer,
             " does not exist (the model has ", topology().size(), " layers)");
  return published_[static_cast<size_t>(layer)];
}

}  // namespace dsv4

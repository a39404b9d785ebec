// Engine::create: the checks every backend shares, then the backend's engine. The interface
// (dsv4/engine.h) knows no backend; this file is the one place that knows them all.
#include "dsv4/engine.h"

#include "dsv4/error.h"
#include "dsv4/parallel.h"
#include "engine/cpu_engine.h"
#if defined(DSV4_WITH_CUDA)
#include "cuda/engine/cuda_engine.h"
#endif

namespace dsv4 {

std::unique_ptr<Engine> Engine::create(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                                       const EngineOptions& options) {
  DSV4_CHECK(weights != nullptr, "engine: create: no weights given");
  DSV4_CHECK(static_cast<int>(weights->layers.size()) == config.total_layers(), "engine: create: the weights have ",
             weights->layers.size(), " layers, the config ", config.total_layers());
  DSV4_CHECK(options.max_sequences >= 1, "engine: create: max_sequences is ", options.max_sequences, ", expected >= 1");
  DSV4_CHECK(options.max_tokens_per_step >= 1, "engine: create: max_tokens_per_step is ", options.max_tokens_per_step,
             ", expected >= 1");
  DSV4_CHECK(options.max_context >= 1, "engine: create: max_context is ", options.max_context, ", expected >= 1");
  DSV4_CHECK(options.max_rollback >= 0 && options.max_rollback <= options.max_context, "engine: create: max_rollback is ",
             options.max_rollback, ", expected 0 ... max_context (", options.max_context, ")");
  DSV4_CHECK(options.attention_stage_bytes >= 0, "engine: create: attention_stage_bytes is ",
             options.attention_stage_bytes, ", expected >= 0");
  DSV4_CHECK(options.cache_storage == CacheStorage::paged || options.kv_format.empty(), "engine: create: kv_format '",
             options.kv_format, "' is given with cache_storage float_rows, which has no byte format");
  if (!options.kv_format.empty()) kv_format_set(options.kv_format);  // an unknown name fails, naming the known ones
  DSV4_CHECK(options.cache_storage == CacheStorage::paged || options.backend == Backend::cpu,
             "engine: create: cache_storage float_rows is a cpu backend storage; the ", backend_name(options.backend),
             " backend stores paged caches (CacheStorage::paged)");
  DSV4_CHECK(options.cuda_stream == nullptr || options.backend == Backend::cuda,
             "engine: create: a cuda_stream is given to the ", backend_name(options.backend), " backend");
  // Candidate masks are published over the candidate source's entries; a layer applying them
  // must score the same entries.
  const ModelTopology topology = resolve_topology(config);
  for (const LayerPlan& plan : topology.layers)
    if (plan.uses_candidates) {
      const int source = config.candidate_source_layer;
      DSV4_CHECK(topology[source].kv_source == plan.kv_source, "engine: create: layer ", plan.layer,
                 " applies the candidates of layer ", source, ", which scores the entries of kv source ",
                 topology[source].kv_source, ", but layer ", plan.layer, " scores those of kv source ", plan.kv_source);
    }
  // A split indexer's partial scores are summed over the ranks.
  if (options.indexer_sharding == IndexerSharding::split)
    DSV4_CHECK(options.communicator != nullptr,
               "engine: create: indexer_sharding is split but no communicator is given (a split indexer sums its "
               "partial scores over the ranks)");
  if (options.backend == Backend::cpu) return std::make_unique<CpuEngine>(config, std::move(weights), options);
#if defined(DSV4_WITH_CUDA)
  return std::make_unique<cuda::CudaEngine>(config, std::move(weights), options);
#else
  fail("engine: create: backend 'cuda' is not available in this build (it was built without CUDA)");
#endif
}

}  // namespace dsv4

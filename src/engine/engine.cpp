// Engine::create and the backend / precision names.
#include "dsv4/engine.h"

#include "dsv4/error.h"
#include "engine/cpu_engine.h"
#if defined(DSV4_WITH_CUDA)
#include "cuda/engine/cuda_engine.h"
#endif

namespace dsv4 {

const char* backend_name(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }

Backend parse_backend(const std::string& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  fail("engine: unknown backend '", name, "', expected cpu or cuda");
}

const char* precision_name(Precision p) { return p == Precision::fp32 ? "fp32" : "reference"; }

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "reference") return Precision::reference;
  fail("engine: unknown precision '", name, "', expected fp32 or reference");
}

std::unique_ptr<Engine> Engine::create(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                                       const EngineOptions& options) {
  // What every backend needs; each backend adds its own limits.
  DSV4_CHECK(weights != nullptr, "engine: create: no weights given");
  DSV4_CHECK(static_cast<int>(weights->layers.size()) == config.total_layers(), "engine: create: the weights have ",
             weights->layers.size(), " layers, the config ", config.total_layers());
  DSV4_CHECK(options.max_sequences >= 1, "engine: create: max_sequences is ", options.max_sequences, ", expected >= 1");
  DSV4_CHECK(options.max_tokens_per_step >= 1, "engine: create: max_tokens_per_step is ", options.max_tokens_per_step,
             ", expected >= 1");
  DSV4_CHECK(options.max_context >= 1, "engine: create: max_context is ", options.max_context, ", expected >= 1");
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
  // A split indexer's partial scores are summed over the ranks, and the weight scale counts the
  // whole model's index heads, of which the shard holds an equal share.
  if (options.split_index_heads != 0) {
    DSV4_CHECK(options.communicator != nullptr, "engine: create: split_index_heads is ", options.split_index_heads,
               " but no communicator is given (a split indexer sums its partial scores over the ranks)");
    DSV4_CHECK(options.split_index_heads > 0 && config.index_n_heads > 0 &&
                   options.split_index_heads % config.index_n_heads == 0,
               "engine: create: split_index_heads is ", options.split_index_heads,
               ", expected a positive multiple of the shard's index_n_heads = ", config.index_n_heads);
  }
  if (options.backend == Backend::cpu) return std::make_unique<CpuEngine>(config, std::move(weights), options);
#if defined(DSV4_WITH_CUDA)
  return std::make_unique<cuda::CudaEngine>(config, std::move(weights), options);
#else
  fail("engine: create: backend 'cuda' is not available in this build (it was built without CUDA)");
#endif
}

}  // namespace dsv4

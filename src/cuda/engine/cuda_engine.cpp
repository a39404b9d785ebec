#include "cuda/engine/cuda_engine.h"

#include "cuda/common/dispatch.h"
#include "dsv4/cuda/qkv.h"
#include "dsv4/kv_format.h"
#include "dsv4/parallel.h"

namespace dsv4::cuda {
namespace {

// The current device; throws when there is none (before any stream or handle is created).
int engine_device() {
  DSV4_CHECK(device_count() > 0, "engine: create: backend 'cuda' needs a CUDA device, none is present");
  int device = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace

CudaEngine::CudaEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                       const EngineOptions& options)
    : StepEngine(config, std::move(weights), options), device_(engine_device()) {
  // Engine::create checked what every backend needs; these are the cuda backend's own limits.
  DSV4_CHECK(options.max_context <= INT32_MAX, "engine: create: max_context is ", options.max_context,
             ", expected 1 ... ", INT32_MAX, " (positions are i32 on the device)");
  DSV4_CHECK(config.head_dim == 512, "engine: create: the cuda backend's attention needs head_dim 512, the config has ",
             config.head_dim);
  const ModelTopology& topo = topology();
  if (options.cuda_stream) {
    stream_ = options.cuda_stream;
  } else {
    own_stream_.emplace();
    stream_ = own_stream_->get();
  }

  const int L = topo.size();
  for (int l = 0; l < L; ++l) {
    if (layer_present(l))
      layers_.emplace_back(std::in_place, config, recipes()[static_cast<size_t>(l)],
                           this->weights().layers[static_cast<size_t>(l)], stream_);
    else
      layers_.emplace_back();
  }

  // RoPE tables: positions stay below max_context; each table comes from the recipes that use it.
  for (const LayerRecipe& r : recipes()) {
    DeviceBuffer& table = r.plan.uses_compress_rope ? compress_rope_ : main_rope_;
    if (table.data()) continue;
    const HostTensor t = rope_table(r.rope_frequencies, options.max_context);
    table = DeviceBuffer(t.nbytes());
    table.upload(t.data(), t.nbytes(), stream_);
  }

  // Caches: the pools in the formats asked for, and per kv source its compressor rings.
  KvCacheOptions cache_options;
  cache_options.formats = kv_formats();
  cache_options.rollback_rows = options.max_rollback;
  cache_options.capacity = plan_kv_cache_capacity(config, topo, cache_options, options.max_sequences,
                                                  options.max_context, options.max_tokens_per_step);
  std::vector<std::vector<int64_t>> rings(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    const LayerRecipe& r = recipes()[static_cast<size_t>(l)];
    if (r.compressor) rings[static_cast<size_t>(l)].push_back(r.compressor->ring_floats());
    if (r.index_compressor) rings[static_cast<size_t>(l)].push_back(r.index_compressor->ring_floats());
  }
  caches_ = std::make_unique<DeviceCaches>(config, topo, cache_options, rings, options.max_context,
                                           options.max_tokens_per_step, stream_);
  // Staged pages are attended by the Hopper kernel (wgmma over bf16 rows), which reference
  // precision's bf16 queries and exp-scores take; elsewhere the quantized rows are attended directly.
  AttentionStaging staging;
  if (device_info().compute_capability == 90 && options.precision == Precision::reference)
    staging.bytes = options.attention_stage_bytes;
  staging.max_sequences = options.max_sequences;
  staging.window = config.sliding_window;
  staging.index_topk = config.index_topk;
  step_metadata_ =
      std::make_unique<StepMetadata>(topo, *caches_, options.max_tokens_per_step, options.max_context, staging);

  // DSpark: the draft blocks' metadata and keys (the draft layers share the window format).
  const int first_draft = config.num_layers;
  const bool drafts = config.has_dspark() && first_draft < L && layer_present(first_draft);
  PagedCache draft_window;
  if (drafts) {
    draft_block_ = std::make_unique<DraftBlockMetadata>(topo, *caches_, options.max_tokens_per_step,
                                                        options.max_sequences, config.dspark_block_size);
    draft_window.geometry = caches_->geometry(CacheKind::window, first_draft);
    draft_window.tensor_scale = caches_->manager().pool(CacheKind::window, first_draft).tensor_scale();
  }
  workspace_ = make_workspace(config, recipes(), options, drafts ? &draft_window : nullptr);
  workspace_.attention_stage = make_attention_stage(*caches_, *step_metadata_, options.max_tokens_per_step);
  if (!options.communicator) {
    aux_stream_.emplace();
    aux_blas_.emplace();
  }
  pipeline_ = std::make_unique<LayerPipeline>(LayerPipelineInputs{
      .config = &this->config(),
      .recipes = &recipes(),
      .weights = &layers_,
      .main_rope = &main_rope_,
      .compress_rope = &compress_rope_,
      .max_context = options.max_context,
      .max_tokens = options.max_tokens_per_step,
      .caches = caches_.get(),
      .step = step_metadata_.get(),
      .draft_block = draft_block_.get(),
      .workspace = &workspace_,
      .blas = &blas_,
      .stream = stream_,
      .aux_stream = aux_stream_ ? aux_stream_->get() : nullptr,
      .aux_blas = aux_blas_ ? &*aux_blas_ : nullptr,
      .device = device_,
      .communicator = options.communicator.get(),
      .split_indexer = options.communicator && options.indexer_sharding == IndexerSharding::split});
  workspace_.scratch_memory = DeviceBuffer(pipeline_->scratch_bytes(options.max_tokens_per_step));
  workspace_.scratch = workspace_.scratch_memory.data();
  if (aux_stream_) {
    workspace_.aux_scratch_memory = DeviceBuffer(workspace_.scratch_memory.bytes());
    workspace_.aux_scratch = workspace_.aux_scratch_memory.data();
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

CudaEngine::~CudaEngine() {
  // Work queued on the stream may still use the buffers.
  cudaStreamSynchronize(stream_);
}

EngineMemory CudaEngine::memory() const {
  EngineMemory m;
  for (const auto& l : layers_)
    if (l) m.weights += l->device_bytes();
  m.caches = caches_->device_bytes();
  m.workspace = static_cast<int64_t>(workspace_.device_bytes() + step_metadata_->device_bytes() +
                                     (draft_block_ ? draft_block_->device_bytes() : 0) +
                                     BlasLt::kWorkspaceBytes * (aux_blas_ ? 2 : 1) + main_rope_.bytes() +
                                     compress_rope_.bytes());
  return m;
}

int CudaEngine::staged_attention_layers() const {
  int n = 0;
  for (int l = 0; l < topology().size(); ++l) n += step_metadata_->layer(l).stages_attention ? 1 : 0;
  return n;
}

void CudaEngine::prepare_step(const StepLayout& step) {
  std::vector<CacheStepEntry> cache_step;
  for (const StepChunk& ch : step.chunks) cache_step.push_back({ch.sequence, ch.tokens});
  caches_->reserve(cache_step);  // all-or-nothing: a full pool throws here and nothing changed
  // Everything below only packs what the manager now guarantees.
  step_metadata_->pack(step, topology(), *caches_, stream_);
}

void CudaEngine::run_layer_step(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  pipeline_->run(layer, hidden_in, attn_out);
}

HostTensor CudaEngine::read_picks(int layer) const {
  HostTensor picks(DType::i32, {step().tokens(), config().index_topk});
  DSV4_CUDA_CHECK(cudaMemcpyAsync(picks.data(), workspace_.picks[static_cast<size_t>(layer)], picks.nbytes(),
                                  cudaMemcpyDeviceToHost, stream_));
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return picks;
}

void CudaEngine::commit_sequence(const StepChunk& chunk) {
  caches_->commit(chunk.sequence, chunk.start + chunk.tokens);
}

void CudaEngine::run_draft_context_step(const TensorView& main_hidden) { pipeline_->run_draft_context(main_hidden); }

void CudaEngine::run_draft_block_layer(int layer, const std::vector<SequenceId>& sequences,
                                       const std::vector<int64_t>& lengths, const TensorView& hidden_in,
                                       const TensorView& attn_out) {
  draft_block_->pack(layer, sequences, lengths, config().dspark_block_size, *caches_, stream_);
  pipeline_->run_draft_block(layer, hidden_in, attn_out);
}

std::vector<float> CudaEngine::window_rows(SequenceId sequence, int layer, int64_t first, int64_t n) const {
  const KvCacheManager& manager = caches_->manager();
  const PageGeometry& g = caches_->geometry(CacheKind::window, layer);
  const TensorView pages = caches_->pages(CacheKind::window, layer);
  std::vector<std::byte> page(static_cast<size_t>(g.page_stride));
  std::vector<float> rows(static_cast<size_t>(n * g.row.dims));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = manager.slot(sequence, CacheKind::window, layer, first + i);
    const int64_t row_in_page = slot % g.rows_per_page;
    const std::byte* device_page = static_cast<const std::byte*>(pages.data) + slot / g.rows_per_page * g.page_stride;
    DSV4_CUDA_CHECK(cudaMemcpyAsync(page.data(), device_page, page.size(), cudaMemcpyDeviceToHost, stream_));
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
    decode_rows(g, page, &row_in_page, 1, rows.data() + i * g.row.dims, manager.pool(CacheKind::window, layer).tensor_scale());
  }
  return rows;
}

}  // namespace dsv4::cuda

#include "cuda/engine/cuda_engine.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>

#include "cuda/engine/glue.h"
#include "engine/layer_order.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/compressor.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/output.h"
#include "dsv4/cuda/projection.h"
#include "dsv4/cuda/qkv.h"
#include "dsv4/parallel.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

// Index scores of one token chunk are kept in at most this many floats (the chunk shrinks as
// the compressed caches grow).
constexpr int64_t kScoreFloats = int64_t{32} << 20;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool has_any_weight(const LayerWeights& w) {
  return std::any_of(w.tensors.begin(), w.tensors.end(), [](const auto& t) { return t.has_value(); });
}

// A compressor of a kv-source layer as run_compressor_pool sees it.
struct CompressorShape {
  int64_t ratio = 0;
  bool overlap = false;
  bool gated = true;
  int64_t dim = 0;
  int64_t coff() const { return overlap ? 2 : 1; }
  int64_t row_width() const { return (gated ? 2 : 1) * coff() * dim; }
  int64_t span() const { return coff() * ratio; }
  int64_t ring_floats() const { return span() * row_width(); }
};

CompressorShape main_compressor(const ModelConfig& config, const LayerPlan& plan) {
  const bool v41 = config.family == ModelFamily::v4_1;
  return {plan.compress_ratio, plan.kind == AttentionKind::csa, !(v41 && plan.compress_ratio == 1), config.head_dim};
}

// V4.0 CSA: the indexer's own compressor of index_head_dim channels.
CompressorShape index_compressor(const ModelConfig& config, const LayerPlan& plan) {
  return {plan.compress_ratio, true, true, config.index_head_dim};
}

bool has_index_compressor(const ModelConfig& config, const LayerPlan& plan) {
  return plan.owns_index_keys && config.family == ModelFamily::v4_0;
}

// The QAT of the rows a layer caches (SPEC §2.2, §3.4, §4, §10); none in Precision::fp32.
struct RowQuants {
  RowQuant window = RowQuant::none;
  RowQuant compressed = RowQuant::none;
  RowQuant indexer = RowQuant::none;  // index queries and keys
};

RowQuants row_quants(const ModelConfig& config, Precision precision) {
  if (precision != Precision::reference) return {};
  if (config.family == ModelFamily::v4_1) return {RowQuant::fp8_e4m3_32, RowQuant::fp4_e4m3_16, RowQuant::fp4_ue8m0_32};
  // The official V4.0 indexer rotates with a Hadamard transform before an FP4 quantization; the
  // transformers V4.0 the reference follows does neither.
  return {RowQuant::fp8_e4m3_nope_64, RowQuant::fp8_e4m3_nope_64, RowQuant::none};
}

TensorView device_view(void* data, DType dtype, const std::vector<int64_t>& shape, int device) {
  return TensorView::contiguous(data, dtype, shape, Device::cuda, device);
}

// Rows [first, first + count) of a contiguous view.
TensorView rows_of(const TensorView& v, int64_t first, int64_t count) {
  TensorView r = v;
  int64_t row_elements = 1;
  for (int d = 1; d < v.rank; ++d) row_elements *= v.shape[d];
  r.data = static_cast<std::byte*>(v.data) + first * row_elements * static_cast<int64_t>(dtype_size(v.dtype));
  r.shape[0] = count;
  return r;
}

// The current device; throws when there is none (before any stream or handle is created).
int engine_device() {
  DSV4_CHECK(device_count() > 0, "engine: create: backend 'cuda' needs a CUDA device, none is present");
  int device = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

LinearParams linear_params(const TensorView& x, const TensorView& weight, int activation_block, const TensorView& y,
                           const BlasLt* blas) {
  LinearParams p;
  p.x = x;
  p.weight = weight;
  p.activation_block = activation_block;
  p.y = y;
  p.blas = blas;
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Step metadata and workspace

struct CudaEngine::LayerStep {
  PagedCache window, compressed, index_keys;      // compressed / index_keys: kv sources only
  TensorView window_slots, compressed_slots, index_key_slots;  // [step tokens] i64
  int64_t entries = 0;  // kv sources: the longest compressed cache of the step's sequences after it
};

// Every device buffer run_layer uses, carved from one allocation at create. Row buffers that
// Precision::fp32 keeps in f32 are sized for f32.
struct CudaEngine::Workspace {
  DeviceBuffer memory;
  DType rows = DType::bf16;  // dtype of the intermediate rows (f32 in Precision::fp32)
  float* staged_in = nullptr;   // [T, hidden] f32: host hidden_in
  float* staged_out = nullptr;  // [T, hidden] f32: host attn_out
  void* x = nullptr;            // [T, hidden] bf16
  void* qr = nullptr;           // [T, q_lora] rows
  void* q = nullptr;            // [T, H, D] bf16
  void* kv = nullptr;           // [T, D] rows
  void* o = nullptr;            // [T, H, D] rows
  void* y = nullptr;            // [T, G, R] rows
  void* out = nullptr;          // [T, hidden] rows
  float* compressor_rows = nullptr;  // [T, max row width] f32
  void* latent = nullptr;       // [T, D] rows
  void* index_latent = nullptr; // [T, index_dim] rows (V4.0 CSA)
  void* keys = nullptr;         // [T, index_dim] rows
  void* index_q = nullptr;      // [T, index_heads, index_dim] bf16
  void* index_w_raw = nullptr;  // [T, index_heads] rows
  float* index_w = nullptr;     // [T, index_heads] f32
  float* scores = nullptr;      // [score_floats] f32
  float* block_scores = nullptr;// [score_floats] f32
  int64_t score_floats = 0;
  int32_t* candidates = nullptr;        // [T, candidate_topk_blocks] i32
  std::vector<int32_t*> picks;          // per layer: [T, index_topk] i32 for index sources
  int32_t* entry_picks = nullptr;       // [T, max HCA entries] i32
  int64_t entry_picks_capacity = 0;     // entries per token
  // Scratch of one op at a time (run_linear, run_output_projection, run_sparse_attention's row
  // split): the ops run in order on the engine's stream, so they share it. cuBLASLt's workspace is
  // not part of it: it is blas_'s alone (see BlasLt).
  DeviceBuffer scratch_memory;
  void* scratch = nullptr;
};

KvFormatSet engine_kv_formats(const ModelConfig& config, const EngineOptions& options) {
  if (!options.kv_format.empty()) return kv_format_set(options.kv_format);
  if (options.precision == Precision::fp32) return kv_format_set("bf16");
  if (config.family == ModelFamily::v4_1) return kv_format_set("v4.1-native");
  return {"v4.0-reference", KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, KvRowFormat::bf16};
}

CudaEngine::CudaEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                       const EngineOptions& options)
    : config_(config),
      topology_(resolve_topology(config)),
      weights_(std::move(weights)),
      options_(options),
      formats_(engine_kv_formats(config, options)),
      device_(engine_device()),
      sequences_(static_cast<size_t>(config.total_layers()), options.max_sequences) {
  // Engine::create checked what every backend needs; these are the cuda backend's own limits.
  DSV4_CHECK(options_.max_context <= INT32_MAX, "engine: create: max_context is ", options_.max_context,
             ", expected 1 ... ", INT32_MAX, " (positions are i32 on the device)");
  DSV4_CHECK(config_.head_dim == 512, "engine: create: the cuda backend's attention needs head_dim 512, the config has ",
             config_.head_dim);
  const bool has_indexer =
      std::any_of(topology_.layers.begin(), topology_.layers.end(), [](const LayerPlan& p) { return p.owns_indexer; });
  DSV4_CHECK(!has_indexer || config_.index_head_dim == 128,
             "engine: create: the cuda backend's indexer needs index_head_dim 128, the config has ",
             config_.index_head_dim);

  const int L = topology_.size();
  const int64_t T = options_.max_tokens_per_step, S = options_.max_sequences, W = config_.sliding_window;
  const int64_t hidden = config_.hidden_size, H = config_.num_heads, D = config_.head_dim;
  const int64_t nI = config_.index_n_heads, dI = config_.index_head_dim, k = config_.index_topk;

  // Weights.
  for (int l = 0; l < L; ++l) {
    const LayerWeights& w = weights_->layers[static_cast<size_t>(l)];
    // transformers checkpoints leave the MTP layers out; such a layer cannot run.
    if (topology_[l].is_mtp && !has_any_weight(w)) {
      layers_.emplace_back();
      continue;
    }
    layers_.emplace_back(std::in_place, config_, topology_[l], w, options_.precision, stream_.get());
  }

  // RoPE tables: positions stay below max_context.
  for (auto [params, table] : {std::pair{&config_.main_rope, &main_rope_}, std::pair{&config_.compress_rope, &compress_rope_}}) {
    const HostTensor t = rope_table(reference::rope_frequencies(*params, config_.rope_head_dim), options_.max_context);
    *table = to_device(t);
  }

  // Caches.
  KvCacheOptions cache_options;
  cache_options.formats = formats_;
  cache_options.capacity = plan_kv_cache_capacity(config_, topology_, cache_options, S, options_.max_context, T);
  std::vector<std::vector<int64_t>> rings(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) {
    const LayerPlan& plan = topology_[l];
    if (!plan.owns_compressor) continue;
    rings[static_cast<size_t>(l)].push_back(main_compressor(config_, plan).ring_floats());
    if (has_index_compressor(config_, plan))
      rings[static_cast<size_t>(l)].push_back(index_compressor(config_, plan).ring_floats());
  }
  caches_ = std::make_unique<DeviceCaches>(config_, topology_, cache_options, rings, stream_.get());

  // Step metadata: token arrays, then per layer its window table and slots, per kv source its
  // compressed and index-key tables and slots (SPEC §7; KvCacheManager block tables).
  size_t metadata = 3 * align_workspace(static_cast<size_t>(T) * 4);
  const auto table_bytes = [&](CacheKind kind, int layer, int64_t rows) {
    const int64_t rpp = caches_->manager().pool(kind, layer).rows_per_page();
    return align_workspace(static_cast<size_t>(S * (rows / rpp + 2)) * 4) + align_workspace(static_cast<size_t>(S) * 4) +
           align_workspace(static_cast<size_t>(T) * 8);
  };
  int64_t max_entries = 0, max_hca_entries = 0, max_row_width = 0;
  for (int l = 0; l < L; ++l) {
    const LayerPlan& plan = topology_[l];
    metadata += table_bytes(CacheKind::window, l, W + T);
    if (!plan.owns_compressor) continue;
    const int64_t entries = options_.max_context / plan.compress_ratio;
    max_entries = std::max(max_entries, entries);
    if (plan.kind == AttentionKind::hca) max_hca_entries = std::max(max_hca_entries, entries);
    max_row_width = std::max(max_row_width, main_compressor(config_, plan).row_width());
    if (has_index_compressor(config_, plan))
      max_row_width = std::max(max_row_width, index_compressor(config_, plan).row_width());
    metadata += table_bytes(CacheKind::compressed, l, entries);
    if (plan.owns_index_keys) metadata += table_bytes(CacheKind::index_keys, l, entries);
  }
  upload_ = std::make_unique<StepUpload>(metadata);

  // Workspace.
  workspace_ = std::make_unique<Workspace>();
  Workspace& ws = *workspace_;
  ws.rows = options_.precision == Precision::fp32 ? DType::f32 : DType::bf16;
  const size_t row_size = dtype_size(ws.rows);
  // Each buffer: where its address goes and its size.
  std::vector<std::pair<std::function<void(std::byte*)>, size_t>> carve;
  const auto add = [&](auto** pointer, size_t bytes) {
    using Pointer = std::remove_pointer_t<decltype(pointer)>;
    carve.emplace_back([pointer](std::byte* at) { *pointer = reinterpret_cast<Pointer>(at); }, align_workspace(bytes));
  };
  const auto n = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  add(&ws.staged_in, n(T, hidden) * 4);
  add(&ws.staged_out, n(T, hidden) * 4);
  add(&ws.x, n(T, hidden) * 2);
  add(&ws.qr, n(T, config_.q_lora_rank) * row_size);
  add(&ws.q, n(T, H * D) * 2);
  add(&ws.kv, n(T, D) * row_size);
  add(&ws.o, n(T, H * D) * row_size);
  add(&ws.y, n(T, config_.o_groups * config_.o_lora_rank) * row_size);
  add(&ws.out, n(T, hidden) * row_size);
  if (max_row_width > 0) {
    add(&ws.compressor_rows, n(T, max_row_width) * 4);
    add(&ws.latent, n(T, D) * row_size);
    add(&ws.index_latent, n(T, dI) * row_size);
    add(&ws.keys, n(T, dI) * row_size);
  }
  ws.picks.assign(static_cast<size_t>(L), nullptr);
  if (has_indexer) {
    add(&ws.index_q, n(T, nI * dI) * 2);
    add(&ws.index_w_raw, n(T, nI) * row_size);
    add(&ws.index_w, n(T, nI) * 4);
    ws.score_floats = std::max(std::min(T * max_entries, kScoreFloats), std::max<int64_t>(max_entries, 1));
    add(&ws.scores, static_cast<size_t>(ws.score_floats) * 4);
    for (int l = 0; l < L; ++l)
      if (topology_[l].owns_indexer) add(&ws.picks[static_cast<size_t>(l)], n(T, k) * 4);
    if (config_.candidate_source_layer >= 0) {
      add(&ws.block_scores, static_cast<size_t>(ws.score_floats) * 4);
      add(&ws.candidates, n(T, config_.candidate_topk_blocks) * 4);
    }
  }
  if (max_hca_entries > 0) {
    ws.entry_picks_capacity = max_hca_entries;
    add(&ws.entry_picks, n(T, max_hca_entries) * 4);
  }
  size_t total = 0;
  for (const auto& [place, bytes] : carve) total += bytes;
  ws.memory = DeviceBuffer(total);
  auto* cursor = static_cast<std::byte*>(ws.memory.data());
  for (const auto& [place, bytes] : carve) {
    place(cursor);
    cursor += bytes;
  }

  // Scratch of the projections and of the attention's row split at the largest step. The size
  // queries read shapes only; the views point at the workspace.
  void* any = ws.memory.data();
  const auto rows_view = [&](int64_t cols) { return device_view(any, ws.rows, {T, cols}, device_); };
  const auto bf16_view = [&](int64_t cols) { return device_view(any, DType::bf16, {T, cols}, device_); };
  size_t scratch = 0;
  for (int l = 0; l < L; ++l) {
    if (!layers_[static_cast<size_t>(l)]) continue;
    const DeviceLayerWeights& w = *layers_[static_cast<size_t>(l)];
    const LayerPlan& plan = topology_[l];
    const auto measure = [&](const TensorView& x, const TensorView& weight, int activation_block, const TensorView& y) {
      scratch = std::max(scratch, linear_workspace_bytes(linear_params(x, weight, activation_block, y, &blas_)));
    };
    const auto measure_role = [&](const TensorView& x, WeightRole role, const TensorView& y) {
      measure(x, w.get(role).view(), w.get(role).activation_block, y);
    };
    measure_role(bf16_view(hidden), WeightRole::wq_a, rows_view(config_.q_lora_rank));
    measure_role(rows_view(config_.q_lora_rank), WeightRole::wq_b, bf16_view(H * D));
    measure_role(bf16_view(hidden), WeightRole::wkv, rows_view(D));
    measure_role(rows_view(config_.o_groups * config_.o_lora_rank), WeightRole::wo_b,
                 options_.communicator ? device_view(any, DType::f32, {T, hidden}, device_) : rows_view(hidden));
    scratch = std::max(scratch, output_projection_workspace_bytes(output_params(
                                    l, device_view(any, ws.rows, {T, H, D}, device_),
                                    device_view(any, DType::i32, {T}, device_),
                                    device_view(any, ws.rows, {T, config_.o_groups, config_.o_lora_rank}, device_))));
    if (plan.owns_compressor) {
      const int64_t width = main_compressor(config_, plan).row_width();
      measure(bf16_view(hidden), w.fused(WeightRole::compressor_wkv, WeightRole::compressor_wgate), 0,
              device_view(any, DType::f32, {T, width}, device_));
      if (has_index_compressor(config_, plan))
        measure(bf16_view(hidden), w.fused(WeightRole::indexer_compressor_wkv, WeightRole::indexer_compressor_wgate), 0,
                device_view(any, DType::f32, {T, index_compressor(config_, plan).row_width()}, device_));
      else if (plan.owns_index_keys)
        measure_role(rows_view(D), WeightRole::indexer_wk, rows_view(dI));
    }
    if (plan.owns_indexer) {
      measure_role(rows_view(config_.q_lora_rank), WeightRole::indexer_wq_b, bf16_view(nI * dI));
      measure_role(bf16_view(hidden), WeightRole::indexer_weights_proj, rows_view(nI));
    }
  }
  scratch = std::max(scratch, sparse_attention_max_workspace_bytes(T, H, W + std::max(k, max_hca_entries)));
  ws.scratch_memory = DeviceBuffer(scratch);
  ws.scratch = ws.scratch_memory.data();
  layer_steps_.resize(static_cast<size_t>(L));
  ran_.assign(static_cast<size_t>(L), 0);
  stream_.synchronize("engine: create");
}

CudaEngine::~CudaEngine() {
  // Work queued on the stream may still use the buffers.
  cudaStreamSynchronize(stream_.get());
}

int64_t CudaEngine::device_bytes() const {
  int64_t bytes = caches_->device_bytes() +
                  static_cast<int64_t>(workspace_->memory.bytes() + workspace_->scratch_memory.bytes() +
                                       BlasLt::kWorkspaceBytes + main_rope_.bytes() + compress_rope_.bytes());
  for (const auto& l : layers_)
    if (l) bytes += l->device_bytes();
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Sequences

bool CudaEngine::in_running_step(SequenceId sequence) const {
  return in_step_ && step_contains(step_entries_, sequence);
}

SequenceId CudaEngine::add_sequence() {
  return sequences_.add([&](SequenceId id) { caches_->add_sequence(id); });
}

SequenceId CudaEngine::fork_sequence(SequenceId parent) {
  sequences_.skipped_layers("fork_sequence", parent);
  DSV4_CHECK(!in_running_step(parent), "engine: fork_sequence: sequence ", parent,
             " is part of the running step; fork it before begin_step or after end_step");
  return sequences_.fork(parent, [&](SequenceId id) { caches_->fork_sequence(parent, id); });
}

void CudaEngine::release_sequence(SequenceId sequence) {
  sequences_.skipped_layers("release_sequence", sequence);
  DSV4_CHECK(!in_running_step(sequence), "engine: release_sequence: sequence ", sequence,
             " is part of the running step; release it after end_step");
  caches_->release_sequence(sequence);
  sequences_.remove(sequence);
}

int64_t CudaEngine::sequence_length(SequenceId sequence) const {
  sequences_.skipped_layers("sequence_length", sequence);
  return caches_->manager().sequence_length(sequence);
}

int64_t CudaEngine::sequence_cache_bytes(SequenceId sequence) const {
  sequences_.skipped_layers("sequence_cache_bytes", sequence);
  return caches_->manager().sequence_bytes(sequence);
}

// ---------------------------------------------------------------------------------------------
// Steps

void CudaEngine::begin_step(const std::vector<StepEntry>& entries) {
  DSV4_CHECK(!in_step_, "engine: begin_step: a step is in progress; call end_step first");
  const KvCacheManager& manager = caches_->manager();
  sequences_.check_step(entries, options_, [&](SequenceId s) { return manager.sequence_length(s); });
  std::vector<CacheStepEntry> cache_step;
  std::vector<int32_t> token_sequence, token_position, state_slot;
  int64_t tokens = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const StepEntry& e = entries[i];
    const int64_t length = manager.sequence_length(e.sequence);
    cache_step.push_back({e.sequence, e.num_tokens});
    for (int64_t t = 0; t < e.num_tokens; ++t) {
      token_sequence.push_back(static_cast<int32_t>(i));
      token_position.push_back(static_cast<int32_t>(length + t));
      state_slot.push_back(static_cast<int32_t>(manager.sequence_slot(e.sequence)));
    }
    tokens += e.num_tokens;
  }
  caches_->reserve(cache_step);  // all-or-nothing: a full pool throws here and nothing changed

  // Everything below only packs what the manager now guarantees.
  const int64_t S = static_cast<int64_t>(entries.size());
  upload_->begin();
  token_sequence_ = upload_->append(std::span<const int32_t>(token_sequence), DType::i32, {tokens});
  token_position_ = upload_->append(std::span<const int32_t>(token_position), DType::i32, {tokens});
  state_slot_ = upload_->append(std::span<const int32_t>(state_slot), DType::i32, {tokens});
  // A pool's block tables [S, longest table] (-1 padded) and first logical pages [S].
  const auto paged = [&](CacheKind kind, int layer) {
    std::vector<BlockTableView> tables;
    int64_t blocks = 1;
    for (const StepEntry& e : entries) {
      tables.push_back(manager.block_table(e.sequence, kind, layer));
      blocks = std::max<int64_t>(blocks, static_cast<int64_t>(tables.back().pages.size()));
    }
    std::vector<int32_t> table(static_cast<size_t>(S * blocks), -1), first(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      const BlockTableView& t = tables[static_cast<size_t>(s)];
      std::transform(t.pages.begin(), t.pages.end(), table.begin() + s * blocks,
                     [](int64_t page) { return static_cast<int32_t>(page); });
      first[static_cast<size_t>(s)] = static_cast<int32_t>(t.first_logical_page);
    }
    PagedCache cache;
    cache.pages = caches_->pages(kind, layer);
    cache.geometry = caches_->geometry(kind, layer);
    cache.tensor_scale = manager.pool(kind, layer).tensor_scale();
    cache.block_table = upload_->append(std::span<const int32_t>(table), DType::i32, {S, blocks});
    cache.first_logical_page = upload_->append(std::span<const int32_t>(first), DType::i32, {S});
    return cache;
  };
  const auto slots = [&](const std::vector<int64_t>& s) {
    return upload_->append(std::span<const int64_t>(s), DType::i64, {tokens});
  };
  for (int l = 0; l < topology_.size(); ++l) {
    LayerStep& ls = layer_steps_[static_cast<size_t>(l)];
    ls = LayerStep{};
    const LayerPlan& plan = topology_[l];
    const LayerStepSlots layer_slots = manager.step_slots(cache_step, l);
    ls.window = paged(CacheKind::window, l);
    ls.window_slots = slots(layer_slots.window);
    if (!plan.owns_compressor) continue;
    ls.compressed = paged(CacheKind::compressed, l);
    ls.compressed_slots = slots(layer_slots.compressed);
    if (plan.owns_index_keys) {
      ls.index_keys = paged(CacheKind::index_keys, l);
      ls.index_key_slots = slots(layer_slots.index_keys);
    }
    for (const StepEntry& e : entries)
      ls.entries = std::max(ls.entries, (manager.sequence_length(e.sequence) + e.num_tokens) / plan.compress_ratio);
  }
  upload_->upload(stream_.get());

  step_entries_ = entries;
  step_tokens_ = tokens;
  ran_.assign(ran_.size(), 0);
  in_step_ = true;
}

void CudaEngine::check_layer(const char* operation, int layer) const {
  DSV4_CHECK(layer >= 0 && layer < topology_.size(), "engine: ", operation, ": layer ", layer,
             " does not exist (the model has ", topology_.size(), " layers)");
}

void CudaEngine::check_layer_inputs(int layer) const {
  bool skipped = false;
  for (const StepEntry& e : step_entries_)
    skipped = skipped || sequences_.skipped_layers("run_layer", e.sequence)[static_cast<size_t>(layer)];
  check_layer_may_run(config_, topology_, layer, layers_[static_cast<size_t>(layer)].has_value(), skipped,
                      [&](int l) { return ran_[static_cast<size_t>(l)] != 0; });
}

float* CudaEngine::activation(const char* name, const TensorView& v, int layer, float* staging) const {
  const std::vector<int64_t> expected{step_tokens_, config_.hidden_size};
  const std::vector<int64_t> given(v.shape.begin(), v.shape.begin() + std::clamp(v.rank, 0, kMaxRank));
  DSV4_CHECK(v.dtype == DType::f32, "engine: run_layer: layer ", layer, " ", name, " has dtype ", dtype_name(v.dtype),
             ", expected F32");
  DSV4_CHECK(given == expected, "engine: run_layer: layer ", layer, " ", name, " has shape ", shape_string(given),
             ", expected ", shape_string(expected), " (step tokens, hidden_size)");
  DSV4_CHECK(v.is_contiguous() && v.data != nullptr, "engine: run_layer: layer ", layer, " ", name,
             " must be a contiguous view of existing memory");
  if (v.device == Device::cpu) return staging;
  DSV4_CHECK(v.device_index == device_, "engine: run_layer: layer ", layer, " ", name, " is on cuda device ",
             v.device_index, ", the engine runs on device ", device_);
  return v.ptr<float>();
}

void CudaEngine::project(const TensorView& x, const DeviceWeight& w, const TensorView& y) const {
  run_linear(linear_params(x, w.view(), w.activation_block, y, &blas_), workspace_->scratch, stream_.get());
}

void CudaEngine::run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) {
  DSV4_CHECK(in_step_, "engine: run_layer: no step is in progress; call begin_step first");
  check_layer("run_layer", layer);
  check_layer_inputs(layer);
  Workspace& ws = *workspace_;
  const float* in = activation("hidden_in", hidden_in, layer, ws.staged_in);
  float* out = activation("attn_out", attn_out, layer, ws.staged_out);
  const cudaStream_t stream = stream_.get();
  const LayerPlan& plan = topology_[layer];
  const DeviceLayerWeights& w = *layers_[static_cast<size_t>(layer)];
  const LayerStep& ls = layer_steps_[static_cast<size_t>(layer)];
  const int64_t T = step_tokens_, hidden = config_.hidden_size, H = config_.num_heads, D = config_.head_dim;
  const int64_t G = config_.o_groups, R = config_.o_lora_rank;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const auto rows = [&](void* data, std::vector<int64_t> shape) { return device_view(data, ws.rows, shape, device_); };
  const auto bf16 = [&](void* data, std::vector<int64_t> shape) { return device_view(data, DType::bf16, shape, device_); };

  if (hidden_in.device == Device::cpu)
    DSV4_CUDA_CHECK(cudaMemcpyAsync(ws.staged_in, hidden_in.data, static_cast<size_t>(T * hidden) * 4,
                                    cudaMemcpyHostToDevice, stream));
  launch_f32_to_bf16(in, static_cast<uint16_t*>(ws.x), T * hidden, stream);
  const TensorView x = bf16(ws.x, {T, hidden});

  // Queries (SPEC §2.2 steps 1-4; V4.0 §12 adds the per-head normalization).
  const TensorView qr = rows(ws.qr, {T, config_.q_lora_rank});
  project(x, w.get(WeightRole::wq_a), qr);
  RmsNormParams q_norm;
  q_norm.x = q_norm.out = qr;
  q_norm.weight = w.get(WeightRole::q_norm).view();
  q_norm.eps = eps;
  run_rms_norm(q_norm, stream);
  const TensorView q = bf16(ws.q, {T, H, D});
  project(qr, w.get(WeightRole::wq_b), bf16(ws.q, {T, H * D}));
  RopeHeadsParams q_rope;
  q_rope.x = q_rope.out = q;
  q_rope.token_position = token_position_;
  q_rope.rope_table = rope_table_view(plan);
  q_rope.head_norm = config_.family == ModelFamily::v4_0;
  q_rope.eps = eps;
  run_rope_heads(q_rope, stream);

  // The step's window rows (steps 5-6), stored before the attention reads them.
  const TensorView kv = rows(ws.kv, {T, D});
  project(x, w.get(WeightRole::wkv), kv);
  CacheInsertParams window =
      insert_params(plan, row_quants(config_, options_.precision).window, ls.window_slots, ls.window);
  window.rows = kv;
  window.norm_weight = w.get(WeightRole::kv_norm).view();
  window.eps = eps;
  run_cache_insert(window, stream);

  if (plan.owns_compressor) compress(layer);
  if (plan.owns_indexer) index(layer);
  attend(layer);

  // Output projection (SPEC §6).
  const TensorView y = rows(ws.y, {T, G, R});
  run_output_projection(output_params(layer, rows(ws.o, {T, H, D}), token_position_, y), ws.scratch, stream);
  // The reference's output is bf16: widen it into attn_out (fp32 precision writes f32 directly).
  // A tensor-parallel rank's output is a partial sum over its heads: f32 until the ranks' partial
  // sums are added up, then rounded as the whole output is.
  const TensorView y_flat = rows(ws.y, {T, G * R});
  const TensorView out_f32 = device_view(out, DType::f32, {T, hidden}, device_);
  if (options_.communicator) {
    project(y_flat, w.get(WeightRole::wo_b), out_f32);
    options_.communicator->all_reduce_sum(out, T * hidden, stream);
    if (ws.rows != DType::f32) launch_scale_to_f32(out, DType::f32, 1.0f, true, out, T * hidden, stream);
  } else if (ws.rows == DType::f32) {
    project(y_flat, w.get(WeightRole::wo_b), out_f32);
  } else {
    project(y_flat, w.get(WeightRole::wo_b), rows(ws.out, {T, hidden}));
    launch_scale_to_f32(ws.out, ws.rows, 1.0f, false, out, T * hidden, stream);
  }
  if (attn_out.device == Device::cpu) {
    DSV4_CUDA_CHECK(cudaMemcpyAsync(attn_out.data, out, static_cast<size_t>(T * hidden) * 4, cudaMemcpyDeviceToHost,
                                    stream));
    stream_.synchronize("engine: run_layer");
  }
  ran_[static_cast<size_t>(layer)] = 1;
}

TensorView CudaEngine::rope_table_view(const LayerPlan& plan) const {
  const DeviceBuffer& table = plan.uses_compress_rope ? compress_rope_ : main_rope_;
  return table.view(DType::f32, {options_.max_context, config_.rope_head_dim});
}

// Compressed entries and index keys of a kv-source layer for the groups closing in this step
// (SPEC §3, §4.1; V4.0 §12), in the pipeline compressor.h describes.
void CudaEngine::compress(int layer) {
  Workspace& ws = *workspace_;
  const cudaStream_t stream = stream_.get();
  const LayerPlan& plan = topology_[layer];
  const DeviceLayerWeights& w = *layers_[static_cast<size_t>(layer)];
  const LayerStep& ls = layer_steps_[static_cast<size_t>(layer)];
  const int64_t T = step_tokens_, D = config_.head_dim, dI = config_.index_head_dim;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const RowQuants quants = row_quants(config_, options_.precision);
  const TensorView x = device_view(ws.x, DType::bf16, {T, config_.hidden_size}, device_);

  // Projects the step's tokens and pools every group that closes in it into `latent`.
  const auto pool = [&](const CompressorShape& c, int ring, WeightRole wkv, WeightRole wgate, WeightRole norm,
                        WeightRole bias, void* latent) {
    const TensorView projected = device_view(ws.compressor_rows, DType::f32, {T, c.row_width()}, device_);
    run_linear(linear_params(x, w.fused(wkv, wgate), 0, projected, &blas_), ws.scratch, stream);
    CompressorPoolParams p;
    p.rows = projected;
    p.token_position = token_position_;
    p.state_slot = state_slot_;
    p.state = caches_->compressor_ring(layer, ring, c.span(), c.row_width());
    if (w.has(bias)) p.position_bias = w.get(bias).view();
    p.norm_weight = w.get(norm).view();
    p.eps = eps;
    p.ratio = static_cast<int>(c.ratio);
    p.overlap = c.overlap;
    p.gated = c.gated;
    p.latent = device_view(latent, ws.rows, {T, c.dim}, device_);
    run_compressor_pool(p, stream);
  };
  pool(main_compressor(config_, plan), 0, WeightRole::compressor_wkv, WeightRole::compressor_wgate,
       WeightRole::compressor_norm, WeightRole::compressor_ape, ws.latent);
  const TensorView latent = device_view(ws.latent, ws.rows, {T, D}, device_);

  // Index keys first: V4.1 derives them from the pre-RoPE latent (SPEC §4.1).
  if (plan.owns_index_keys) {
    CacheInsertParams keys = insert_params(plan, quants.indexer, ls.index_key_slots, ls.index_keys);
    keys.position_offset = 1 - plan.compress_ratio;  // an entry rotates at its group's first position
    if (has_index_compressor(config_, plan)) {
      pool(index_compressor(config_, plan), 1, WeightRole::indexer_compressor_wkv, WeightRole::indexer_compressor_wgate,
           WeightRole::indexer_compressor_norm, WeightRole::indexer_compressor_ape, ws.index_latent);
      keys.rows = device_view(ws.index_latent, ws.rows, {T, dI}, device_);
    } else {
      keys.rows = device_view(ws.keys, ws.rows, {T, dI}, device_);
      project(latent, w.get(WeightRole::indexer_wk), keys.rows);
      keys.norm_weight = w.get(WeightRole::indexer_k_norm).view();
      keys.eps = eps;
    }
    run_cache_insert(keys, stream);
  }
  CacheInsertParams entries = insert_params(plan, quants.compressed, ls.compressed_slots, ls.compressed);
  entries.rows = latent;
  entries.position_offset = 1 - plan.compress_ratio;
  run_cache_insert(entries, stream);
}

CacheInsertParams CudaEngine::insert_params(const LayerPlan& plan, RowQuant quant, const TensorView& slots,
                                            const PagedCache& cache) const {
  CacheInsertParams p;
  p.token_position = token_position_;
  p.rope_table = rope_table_view(plan);
  p.quant = quant;
  p.bf16_rounding = options_.precision == Precision::reference;
  p.slots = slots;
  p.cache = cache;
  return p;
}

OutputProjectionParams CudaEngine::output_params(int layer, const TensorView& o, const TensorView& token_position,
                                                 const TensorView& y) const {
  const int64_t G = config_.o_groups, R = config_.o_lora_rank, H = config_.num_heads, D = config_.head_dim;
  OutputProjectionParams p;
  p.o = o;
  p.token_position = token_position;
  p.rope_table = rope_table_view(topology_[layer]);
  p.wo_a = layers_[static_cast<size_t>(layer)]->get(WeightRole::wo_a).view({G, R, H * D / G});
  p.y = y;
  p.blas = &blas_;
  return p;
}

// The indexer of an index-source layer: scores over its kv source's keys, candidate blocks, top-k
// picks (SPEC §4), in token chunks that fit the score buffer.
void CudaEngine::index(int layer) {
  Workspace& ws = *workspace_;
  const cudaStream_t stream = stream_.get();
  const LayerPlan& plan = topology_[layer];
  const DeviceLayerWeights& w = *layers_[static_cast<size_t>(layer)];
  const LayerStep& source = layer_steps_[static_cast<size_t>(plan.kv_source)];
  const int64_t T = step_tokens_, nI = config_.index_n_heads, dI = config_.index_head_dim, k = config_.index_topk;
  const bool reference = options_.precision == Precision::reference;

  // Queries and head weights (SPEC §4.2).
  const TensorView q = device_view(ws.index_q, DType::bf16, {T, nI, dI}, device_);
  project(device_view(ws.qr, ws.rows, {T, config_.q_lora_rank}, device_), w.get(WeightRole::indexer_wq_b),
          device_view(ws.index_q, DType::bf16, {T, nI * dI}, device_));
  RopeHeadsParams rope;
  rope.x = rope.out = q;
  rope.token_position = token_position_;
  rope.rope_table = rope_table_view(plan);
  rope.quant = row_quants(config_, options_.precision).indexer;
  run_rope_heads(rope, stream);
  project(device_view(ws.x, DType::bf16, {T, config_.hidden_size}, device_), w.get(WeightRole::indexer_weights_proj),
          device_view(ws.index_w_raw, ws.rows, {T, nI}, device_));
  // A split indexer (tensor parallelism) scores the rank's share of the heads; the scale counts all.
  const int64_t scale_heads = options_.split_index_heads > 0 ? options_.split_index_heads : nI;
  const float weight_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dI)) /
                                                std::sqrt(static_cast<double>(scale_heads)));
  launch_scale_to_f32(ws.index_w_raw, ws.rows, weight_scale, reference, ws.index_w, T * nI, stream);
  const TensorView weights = device_view(ws.index_w, DType::f32, {T, nI}, device_);

  const int64_t entries = source.entries, block_size = config_.candidate_block_size;
  const int ratio = plan.compress_ratio;
  const TensorView picks = device_view(ws.picks[static_cast<size_t>(layer)], DType::i32, {T, k}, device_);
  const TensorView candidates =
      ws.candidates ? device_view(ws.candidates, DType::i32, {T, config_.candidate_topk_blocks}, device_) : TensorView{};
  const int64_t chunk = std::max<int64_t>(1, ws.score_floats / std::max<int64_t>(entries, 1));
  for (int64_t first = 0; first < T; first += chunk) {
    const int64_t n = std::min(chunk, T - first);
    const TensorView positions = rows_of(token_position_, first, n);
    IndexScoresParams scores;
    scores.q = rows_of(q, first, n);
    scores.weights = rows_of(weights, first, n);
    scores.keys = source.index_keys;
    scores.token_sequence = rows_of(token_sequence_, first, n);
    scores.token_position = positions;
    scores.compress_ratio = ratio;
    if (plan.uses_candidates) {
      scores.candidates = rows_of(candidates, first, n);
      scores.candidate_block_size = block_size;
    }
    scores.scores = device_view(ws.scores, DType::f32, {n, entries}, device_);
    run_index_scores(scores, stream);
    // Split indexer: the partial sums over the rank's heads are summed over the ranks.
    if (options_.split_index_heads > 0) options_.communicator->all_reduce_sum(ws.scores, n * entries, stream);
    TopkParams topk;
    topk.token_position = positions;
    topk.compress_ratio = ratio;
    if (plan.is_candidate_source) {
      // Published over the candidate source's entries; the source itself does not apply them.
      CandidateBlockScoresParams blocks;
      blocks.scores = scores.scores;
      blocks.token_position = positions;
      blocks.compress_ratio = ratio;
      blocks.block_size = block_size;
      blocks.block_scores = device_view(ws.block_scores, DType::f32, {n, ceil_div(entries, block_size)}, device_);
      run_candidate_block_scores(blocks, stream);
      topk.scores = blocks.block_scores;
      topk.group_size = block_size;
      topk.picks = rows_of(candidates, first, n);
      run_topk(topk, stream);
    }
    topk.scores = scores.scores;
    topk.group_size = 1;
    topk.picks = rows_of(picks, first, n);
    run_topk(topk, stream);
  }
}

// Sparse attention over the layer's window and the picked entries of its kv source (SPEC §5).
void CudaEngine::attend(int layer) {
  Workspace& ws = *workspace_;
  const cudaStream_t stream = stream_.get();
  const LayerPlan& plan = topology_[layer];
  const int64_t T = step_tokens_, H = config_.num_heads, D = config_.head_dim;
  SparseAttentionParams a;
  a.q = device_view(ws.q, DType::bf16, {T, H, D}, device_);
  a.token_sequence = token_sequence_;
  a.token_position = token_position_;
  a.window = layer_steps_[static_cast<size_t>(layer)].window;
  a.window_size = config_.sliding_window;
  a.sink = layers_[static_cast<size_t>(layer)]->get(WeightRole::attn_sink).view();
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.out = device_view(ws.o, ws.rows, {T, H, D}, device_);
  if (plan.kv_source >= 0) {
    const LayerStep& source = layer_steps_[static_cast<size_t>(plan.kv_source)];
    a.compressed = source.compressed;
    a.compress_ratio = plan.compress_ratio;
    if (plan.index_source >= 0) {
      a.picks = device_view(ws.picks[static_cast<size_t>(plan.index_source)], DType::i32, {T, config_.index_topk}, device_);
    } else {  // V4.0 HCA: every visible entry
      DSV4_CHECK(source.entries <= ws.entry_picks_capacity, "engine: layer ", layer, ": ", source.entries,
                 " compressed entries exceed the ", ws.entry_picks_capacity, " planned at create");
      launch_fill_entry_picks(ws.entry_picks, T, source.entries, stream);
      a.picks = device_view(ws.entry_picks, DType::i32, {T, source.entries}, device_);
    }
  }
  run_sparse_attention(a, ws.scratch, stream);
}

HostTensor CudaEngine::layer_picks(int layer) const {
  check_layer("layer_picks", layer);
  const LayerPlan& plan = topology_[layer];
  DSV4_CHECK(plan.owns_indexer, "engine: layer_picks: layer ", layer, " is not an index source",
             plan.index_source >= 0 ? " (it reuses the picks of layer " + std::to_string(plan.index_source) + ")" : "");
  if (!ran_[static_cast<size_t>(layer)]) return HostTensor();  // kept after end_step until the next step
  HostTensor picks(DType::i32, {step_tokens_, config_.index_topk});
  DSV4_CUDA_CHECK(cudaMemcpyAsync(picks.data(), workspace_->picks[static_cast<size_t>(layer)], picks.nbytes(),
                                  cudaMemcpyDeviceToHost, stream_.get()));
  stream_.synchronize("engine: layer_picks");
  return picks;
}

void CudaEngine::end_step() {
  DSV4_CHECK(in_step_, "engine: end_step: no step is in progress");
  // MTP layers are optional: a sequence whose step skipped one can no longer run it.
  for (int l = 0; l < config_.num_layers; ++l)
    DSV4_CHECK(ran_[static_cast<size_t>(l)], "engine: end_step: layer ", l, " has not run in this step");
  const KvCacheManager& manager = caches_->manager();
  for (const StepEntry& e : step_entries_) {
    std::vector<uint8_t>& skipped = sequences_.skipped_layers("end_step", e.sequence);
    for (int l = config_.num_layers; l < topology_.size(); ++l)
      if (!ran_[static_cast<size_t>(l)]) skipped[static_cast<size_t>(l)] = 1;
    caches_->commit(e.sequence, manager.sequence_length(e.sequence) + e.num_tokens);
  }
  in_step_ = false;
}

}  // namespace dsv4::cuda

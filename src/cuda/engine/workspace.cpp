#include "cuda/engine/workspace.h"

#include <algorithm>
#include <functional>
#include <type_traits>
#include <utility>

#include "dsv4/cuda/cache.h"

namespace dsv4::cuda {
namespace {

// Index scores of one token chunk are kept in at most this many floats (the chunk shrinks as
// the compressed caches grow).
constexpr int64_t kScoreFloats = int64_t{32} << 20;

}  // namespace

size_t AttentionStage::device_bytes() const {
  size_t bytes = pages.bytes();
  for (const Table* t : {&window, &compressed}) bytes += t->source_pages.bytes() + t->table.bytes() + t->first.bytes();
  return bytes;
}

AttentionStage make_attention_stage(const DeviceCaches& caches, const StepMetadata& metadata, int64_t max_tokens) {
  AttentionStage stage;
  const AttentionStaging& staging = metadata.staging();
  const KvCacheManager& manager = caches.manager();
  const std::vector<const PagePool*> pools = manager.pools();
  int64_t most_pages = 0, widest = 0;
  for (size_t p = 0; p < pools.size(); ++p) {
    if (!metadata.stageable(static_cast<int>(p))) continue;
    const PageGeometry staged = staged_page_geometry(pools[p]->geometry());
    most_pages = std::max(most_pages, staging.bytes / staged.page_stride);
    widest = std::max<int64_t>(widest, caches.pool_tables()[p].width);
  }
  if (most_pages == 0) return stage;
  const int64_t sequences = std::min(max_tokens, staging.max_sequences);
  stage.pages = DeviceBuffer(static_cast<size_t>(staging.bytes));
  for (AttentionStage::Table* t : {&stage.window, &stage.compressed}) {
    t->source_pages = DeviceBuffer(static_cast<size_t>(most_pages) * 4);
    t->table = DeviceBuffer(static_cast<size_t>(sequences * widest) * 4);
    t->first = DeviceBuffer(static_cast<size_t>(sequences) * 4);
  }
  return stage;
}

Workspace make_workspace(const ModelConfig& config, const std::vector<LayerRecipe>& recipes,
                         const EngineOptions& options, const PagedCache* draft_window) {
  const int64_t T = options.max_tokens_per_step, hidden = config.hidden_size, H = config.num_heads,
                D = config.head_dim;
  const int64_t nI = config.index_n_heads, dI = config.index_head_dim, k = config.index_topk;
  int64_t max_entries = 0, max_hca_entries = 0, max_row_width = 0;
  bool has_indexer = false;
  for (const LayerRecipe& r : recipes) {
    has_indexer = has_indexer || r.plan.owns_indexer;
    if (!r.compressor) continue;
    const int64_t entries = options.max_context / r.compressor->ratio;
    max_entries = std::max(max_entries, entries);
    if (r.plan.kind == AttentionKind::hca) max_hca_entries = std::max(max_hca_entries, entries);
    max_row_width = std::max(max_row_width, r.compressor->row_width());
    if (r.index_compressor) max_row_width = std::max(max_row_width, r.index_compressor->row_width());
  }

  Workspace ws;
  ws.rows = options.precision == Precision::fp32 ? DType::f32 : DType::bf16;
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
  add(&ws.x, n(T, hidden) * row_size);
  add(&ws.qr, n(T, config.q_lora_rank) * row_size);
  add(&ws.q, n(T, H * D) * row_size);
  add(&ws.kv, n(T, D) * row_size);
  add(&ws.o, n(T, H * D) * row_size);
  add(&ws.y, n(T, config.o_groups * config.o_lora_rank) * row_size);
  add(&ws.out, n(T, hidden) * row_size);
  if (max_row_width > 0) {
    add(&ws.compressor_rows, n(T, max_row_width) * 4);
    add(&ws.latent, n(T, D) * row_size);
    add(&ws.index_latent, n(T, dI) * row_size);
    add(&ws.keys, n(T, dI) * row_size);
  }
  ws.picks.assign(recipes.size(), nullptr);
  if (has_indexer) {
    add(&ws.index_q, n(T, nI * dI) * row_size);
    add(&ws.index_w_raw, n(T, nI) * row_size);
    add(&ws.index_w, n(T, nI) * 4);
    ws.score_floats = std::max(std::min(T * max_entries, kScoreFloats), std::max<int64_t>(max_entries, 1));
    add(&ws.scores, static_cast<size_t>(ws.score_floats) * 4);
    for (size_t l = 0; l < recipes.size(); ++l)
      if (recipes[l].plan.owns_indexer) add(&ws.picks[l], n(T, k) * 4);
    if (config.candidate_source_layer >= 0) {
      add(&ws.block_scores, static_cast<size_t>(ws.score_floats) * 4);
      add(&ws.candidates, n(T, config.candidate_topk_blocks) * 4);
    }
  }
  if (max_hca_entries > 0) {
    ws.entry_picks_capacity = max_hca_entries;
    add(&ws.entry_picks, n(T, max_hca_entries) * 4);
  }
  void* block_key_pages = nullptr;
  int64_t block_key_page_count = 0;
  if (draft_window) {
    add(&ws.main_hidden, n(T, config.dspark_main_width()) * row_size);
    add(&ws.main_x, n(T, hidden) * row_size);
    const PageGeometry& g = draft_window->geometry;
    block_key_page_count = (T + g.rows_per_page - 1) / g.rows_per_page;
    add(&block_key_pages, n(block_key_page_count, g.page_stride));
  }
  size_t total = 0;
  for (const auto& [place, bytes] : carve) total += bytes;
  ws.memory = DeviceBuffer(total);
  auto* cursor = static_cast<std::byte*>(ws.memory.data());
  for (const auto& [place, bytes] : carve) {
    place(cursor);
    cursor += bytes;
  }
  if (draft_window) {
    int device = 0;
    DSV4_CUDA_CHECK(cudaGetDevice(&device));
    ws.block_keys.geometry = draft_window->geometry;
    ws.block_keys.tensor_scale = draft_window->tensor_scale;
    ws.block_keys.fp8_scale_floor = draft_window->fp8_scale_floor;
    ws.block_keys.pages = TensorView::contiguous(block_key_pages, DType::u8,
                                                 {block_key_page_count, draft_window->geometry.page_stride},
                                                 Device::cuda, device);
  }
  return ws;
}

}  // namespace dsv4::cuda

#include "cuda/engine/step_metadata.h"

#include <algorithm>

namespace dsv4::cuda {
namespace {

// Bytes of one pool's table [S, blocks] i32, first logical pages [S] i32 and slots [T] i64.
size_t paged_bytes(const KvCacheManager& manager, CacheKind kind, int layer, int64_t rows, int64_t S, int64_t T) {
  const int64_t rpp = manager.pool(kind, layer).rows_per_page();
  return align_workspace(static_cast<size_t>(S * (rows / rpp + 2)) * 4) + align_workspace(static_cast<size_t>(S) * 4) +
         align_workspace(static_cast<size_t>(T) * 8);
}

size_t metadata_bytes(const ModelTopology& topology, const KvCacheManager& manager, int64_t T, int64_t S,
                      int64_t max_context) {
  size_t bytes = 5 * align_workspace(static_cast<size_t>(T) * 4);  // the token arrays, window ranges
  for (int l = 0; l < topology.size(); ++l) {
    const LayerPlan& plan = topology[l];
    bytes += paged_bytes(manager, CacheKind::window, l, manager.sliding_window() + T, S, T);
    if (!plan.owns_compressor) continue;
    const int64_t entries = max_context / plan.compress_ratio;
    bytes += paged_bytes(manager, CacheKind::compressed, l, entries, S, T);
    if (plan.owns_index_keys) bytes += paged_bytes(manager, CacheKind::index_keys, l, entries, S, T);
  }
  return bytes;
}

// A pool's block tables [S, longest table] (-1 padded) and first logical pages [S] of the given
// sequences, appended to `upload`.
PagedCache pack_paged(StepUpload& upload, const DeviceCaches& caches, CacheKind kind, int layer,
                      const std::vector<SequenceId>& sequences) {
  const KvCacheManager& manager = caches.manager();
  const int64_t S = static_cast<int64_t>(sequences.size());
  std::vector<BlockTableView> tables;
  int64_t blocks = 1;
  for (SequenceId id : sequences) {
    tables.push_back(manager.block_table(id, kind, layer));
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
  cache.pages = caches.pages(kind, layer);
  cache.geometry = caches.geometry(kind, layer);
  cache.tensor_scale = manager.pool(kind, layer).tensor_scale();
  cache.block_table = upload.append(std::span<const int32_t>(table), DType::i32, {S, blocks});
  cache.first_logical_page = upload.append(std::span<const int32_t>(first), DType::i32, {S});
  return cache;
}

}  // namespace

StepMetadata::StepMetadata(const ModelTopology& topology, const DeviceCaches& caches, int64_t max_tokens,
                           int64_t max_sequences, int64_t max_context)
    : upload_(metadata_bytes(topology, caches.manager(), max_tokens, max_sequences, max_context)),
      layers_(static_cast<size_t>(topology.size())) {}

void StepMetadata::pack(const StepLayout& step, const ModelTopology& topology, const DeviceCaches& caches,
                        cudaStream_t stream) {
  const KvCacheManager& manager = caches.manager();
  const int64_t T = step.tokens();
  std::vector<CacheStepEntry> cache_step;
  std::vector<SequenceId> sequences;
  std::vector<int32_t> token_position(step.positions.begin(), step.positions.end()), state_slot;
  for (const StepChunk& ch : step.chunks) {
    cache_step.push_back({ch.sequence, ch.tokens});
    sequences.push_back(ch.sequence);
    state_slot.insert(state_slot.end(), static_cast<size_t>(ch.tokens),
                      static_cast<int32_t>(manager.sequence_slot(ch.sequence)));
  }
  upload_.begin();
  tokens_ = T;
  token_sequence_ = upload_.append(std::span<const int32_t>(step.chunk_of), DType::i32, {T});
  token_position_ = upload_.append(std::span<const int32_t>(token_position), DType::i32, {T});
  state_slot_ = upload_.append(std::span<const int32_t>(state_slot), DType::i32, {T});
  window_first_ = window_last_ = TensorView{};
  max_window_rows_ = 0;
  if (!step.windows.empty()) {
    std::vector<int32_t> first, last;
    for (const WindowRange& w : step.windows) {
      first.push_back(static_cast<int32_t>(w.first));
      last.push_back(static_cast<int32_t>(w.last));
      max_window_rows_ = std::max(max_window_rows_, w.last - w.first + 1);
    }
    window_first_ = upload_.append(std::span<const int32_t>(first), DType::i32, {T});
    window_last_ = upload_.append(std::span<const int32_t>(last), DType::i32, {T});
  }
  const auto paged = [&](CacheKind kind, int layer) { return pack_paged(upload_, caches, kind, layer, sequences); };
  const auto slots = [&](const std::vector<int64_t>& s) {
    return upload_.append(std::span<const int64_t>(s), DType::i64, {T});
  };
  for (int l = 0; l < topology.size(); ++l) {
    LayerStep& ls = layers_[static_cast<size_t>(l)];
    ls = LayerStep{};
    const LayerPlan& plan = topology[l];
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
    for (const StepChunk& ch : step.chunks)
      ls.entries = std::max(ls.entries, (ch.start + ch.tokens) / plan.compress_ratio);
  }
  upload_.upload(stream);
}

// The draft layers' window tables hold at most the sliding window plus the rollback rows, on
// pages that start anywhere: two pages more than those rows need.
DraftBlockMetadata::DraftBlockMetadata(const ModelTopology& topology, const DeviceCaches& caches, int64_t max_tokens,
                                       int64_t max_sequences, int64_t block_size)
    : upload_([&] {
        const KvCacheManager& manager = caches.manager();
        size_t bytes = 3 * align_workspace(static_cast<size_t>(max_tokens) * 4) +
                       align_workspace(static_cast<size_t>(max_tokens * block_size) * 4) +
                       align_workspace(static_cast<size_t>(max_tokens) * 8);
        size_t window = 0;
        for (int l = 0; l < topology.size(); ++l)
          if (topology[l].kind == AttentionKind::dspark)
            window = std::max(window, paged_bytes(manager, CacheKind::window, l,
                                                  manager.sliding_window() + manager.options().rollback_rows,
                                                  max_sequences, max_tokens));
        return bytes + window;
      }()) {}

void DraftBlockMetadata::pack(int layer, const std::vector<SequenceId>& sequences, const std::vector<int64_t>& lengths,
                              int64_t block_size, const DeviceCaches& caches, cudaStream_t stream) {
  const int64_t B = block_size, T = static_cast<int64_t>(sequences.size()) * B;
  std::vector<int32_t> token_sequence(static_cast<size_t>(T)), token_position(static_cast<size_t>(T)),
      window_last(static_cast<size_t>(T)), block_rows(static_cast<size_t>(T * B));
  std::vector<int64_t> block_slot(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = t / B, length = lengths[static_cast<size_t>(b)];
    token_sequence[static_cast<size_t>(t)] = static_cast<int32_t>(b);
    token_position[static_cast<size_t>(t)] = static_cast<int32_t>(length + t % B);
    window_last[static_cast<size_t>(t)] = static_cast<int32_t>(length - 1);
    block_slot[static_cast<size_t>(t)] = t;
    for (int64_t j = 0; j < B; ++j) block_rows[static_cast<size_t>(t * B + j)] = static_cast<int32_t>(b * B + j);
  }
  upload_.begin();
  tokens_ = T;
  token_sequence_ = upload_.append(std::span<const int32_t>(token_sequence), DType::i32, {T});
  token_position_ = upload_.append(std::span<const int32_t>(token_position), DType::i32, {T});
  window_last_ = upload_.append(std::span<const int32_t>(window_last), DType::i32, {T});
  block_rows_ = upload_.append(std::span<const int32_t>(block_rows), DType::i32, {T, B});
  block_slot_ = upload_.append(std::span<const int64_t>(block_slot), DType::i64, {T});
  window_ = pack_paged(upload_, caches, CacheKind::window, layer, sequences);
  upload_.upload(stream);
}

}  // namespace dsv4::cuda

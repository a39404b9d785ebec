#include "cuda/engine/step_metadata.h"

#include <algorithm>

#include "dsv4/cuda/cache.h"

namespace dsv4::cuda {
namespace {

// Bytes of one pool's table [S, blocks] i32, first logical pages [S] i32 and slots [T] i64.
size_t paged_bytes(const KvCacheManager& manager, CacheKind kind, int layer, int64_t rows, int64_t S, int64_t T) {
  const int64_t rpp = manager.pool(kind, layer).rows_per_page();
  return align_workspace(static_cast<size_t>(S * (rows / rpp + 2)) * 4) + align_workspace(static_cast<size_t>(S) * 4) +
         align_workspace(static_cast<size_t>(T) * 8);
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

namespace {

// Entries rounded up to within an eighth of their power of two (at least 256), at most `limit`:
// a step graph captured at one context length replays the next ones (SPEC-exact either way: the
// kernels mask every entry a token cannot see).
int64_t entries_bucket(int64_t entries, int64_t limit) {
  if (entries == 0) return 0;
  int64_t power = 1;
  while (power < entries) power *= 2;
  const int64_t granule = std::max<int64_t>(256, power / 8);
  return std::min(limit, (entries + granule - 1) / granule * granule);
}

uint64_t mix(uint64_t hash, uint64_t value) { return (hash ^ value) * 0x100000001b3ull; }

// A staged page is decoded once and then read by the attention of every token that attends its
// rows. Measured on the H200 (bench/RESULTS.md, fifteenth session): staging costs about as much
// per row as attending 4.5 rows from the quantized pages instead of bf16 ones; a layer stages when
// its tokens attend at least this many rows per staged row.
constexpr int64_t kMinRowReuse = 8;

// The layers whose attention a step runs (not the draft layers': their attention is
// run_draft_block's) with the window and compressed pools it reads.
std::vector<AttendedPools> attended_pools(const ModelTopology& topology, const KvCacheManager& manager) {
  std::vector<AttendedPools> attended;
  for (const LayerPlan& plan : topology.layers) {
    // A drafter's engine keeps no pools for the backbone layers it does not run.
    if (plan.kind == AttentionKind::dspark || !manager.has_pool(CacheKind::window, plan.layer)) continue;
    attended.push_back({plan.layer, manager.pool_index(CacheKind::window, plan.layer),
                        plan.kv_source >= 0 ? manager.pool_index(CacheKind::compressed, plan.kv_source) : -1});
  }
  return attended;
}

// The window and compressed pools an attention reads, in formats run_cache_stage decodes and worth
// decoding (not bf16 already).
std::vector<bool> stageable_pools(const std::vector<AttendedPools>& attended, const KvCacheManager& manager,
                                  const AttentionStaging& staging) {
  const std::vector<const PagePool*> pools = manager.pools();
  std::vector<bool> stageable(pools.size(), false);
  if (staging.bytes == 0) return stageable;
  for (const AttendedPools& a : attended)
    for (int pool : {a.window, a.compressed}) {
      if (pool < 0) continue;
      const PageGeometry& g = pools[static_cast<size_t>(pool)]->geometry();
      const KvRowFormat f = g.format;
      stageable[static_cast<size_t>(pool)] =
          g.row.dims == 512 && (f == KvRowFormat::v41_fp8 || f == KvRowFormat::v41_fp4 || f == KvRowFormat::fp8_ds_mla);
    }
  return stageable;
}

// `staging` with its budget cut to what one layer can stage at most (every page of its window pool
// and of its kv source's compressed pool as bf16 pages), so that a small engine holds no more.
AttentionStaging clamped(AttentionStaging staging, const std::vector<AttendedPools>& attended,
                         const KvCacheManager& manager) {
  const std::vector<const PagePool*> pools = manager.pools();
  int64_t most = 0;
  for (const AttendedPools& a : attended) {
    int64_t bytes = 0;
    for (int pool : {a.window, a.compressed}) {
      if (pool < 0) continue;
      const PagePool& p = *pools[static_cast<size_t>(pool)];
      bytes += static_cast<int64_t>(staged_pages_bytes(p.geometry(), p.num_pages()));
    }
    most = std::max(most, bytes);
  }
  staging.bytes = std::min(staging.bytes, most);
  return staging;
}

size_t staging_upload_bytes(const std::vector<bool>& stageable, int64_t max_tokens, const AttentionStaging& staging) {
  const int64_t pools = std::count(stageable.begin(), stageable.end(), true);
  if (pools == 0) return 0;
  const int64_t sequences = std::min(max_tokens, staging.max_sequences);
  return align_workspace(static_cast<size_t>(max_tokens) * 4) +
         static_cast<size_t>(pools) * align_workspace(static_cast<size_t>(sequences) * sizeof(StagedRun));
}

}  // namespace

size_t staged_pages_bytes(const PageGeometry& geometry, int64_t pages) {
  return align_workspace(static_cast<size_t>(pages * staged_page_geometry(geometry).page_stride));
}

StepMetadata::StepMetadata(const ModelTopology& topology, const DeviceCaches& caches, int64_t max_tokens,
                           int64_t max_context, const AttentionStaging& staging)
    : max_tokens_(max_tokens), max_context_(max_context), attended_(attended_pools(topology, caches.manager())),
      staging_(clamped(staging, attended_, caches.manager())),
      stageable_pools_(stageable_pools(attended_, caches.manager(), staging_)),
      staged_pools_(caches.manager().pools().size()),
      upload_(4 * align_workspace(static_cast<size_t>(max_tokens) * 4) +
              staging_upload_bytes(stageable_pools_, max_tokens, staging_)),
      slots_(caches.pool_tables().size() * static_cast<size_t>(max_tokens) * sizeof(int64_t)),
      layers_(static_cast<size_t>(topology.size())) {
  std::vector<int64_t*> rows;
  for (size_t p = 0; p < caches.pool_tables().size(); ++p)
    rows.push_back(static_cast<int64_t*>(slots_.data()) + static_cast<int64_t>(p) * max_tokens);
  slot_pointers_ = DeviceBuffer(rows.size() * sizeof(int64_t*));
  // A synchronous copy: `rows` ends with this constructor.
  DSV4_CUDA_CHECK(cudaMemcpy(slot_pointers_.data(), rows.data(), slot_pointers_.bytes(), cudaMemcpyHostToDevice));
  // What each layer reads and writes sits at the same addresses every step.
  int device = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  const KvCacheManager& manager = caches.manager();
  const auto slots = [&](CacheKind kind, int layer) {
    return TensorView::contiguous(rows[static_cast<size_t>(manager.pool_index(kind, layer))], DType::i64,
                                  {max_tokens}, Device::cuda, device);
  };
  for (int l = 0; l < topology.size(); ++l) {
    LayerStep& ls = layers_[static_cast<size_t>(l)];
    ls.window = caches.paged(CacheKind::window, l);
    ls.window_slots = slots(CacheKind::window, l);
    if (!topology[l].owns_compressor) continue;
    ls.compressed = caches.paged(CacheKind::compressed, l);
    ls.compressed_slots = slots(CacheKind::compressed, l);
    if (!topology[l].owns_index_keys) continue;
    ls.index_keys = caches.paged(CacheKind::index_keys, l);
    ls.index_key_slots = slots(CacheKind::index_keys, l);
  }
}

void StepMetadata::pack(const StepLayout& step, const ModelTopology& topology, DeviceCaches& caches,
                        cudaStream_t stream) {
  const KvCacheManager& manager = caches.manager();
  const int64_t T = step.tokens();
  const size_t reserve = static_cast<size_t>(max_tokens_) * 4;
  std::vector<int32_t> token_slot, token_position(step.positions.begin(), step.positions.end());
  for (const StepChunk& ch : step.chunks)
    token_slot.insert(token_slot.end(), static_cast<size_t>(ch.tokens),
                      static_cast<int32_t>(manager.sequence_slot(ch.sequence)));
  std::vector<int32_t> first, last;
  max_window_rows_ = 0;
  for (const WindowRange& w : step.windows) {
    first.push_back(static_cast<int32_t>(w.first));
    last.push_back(static_cast<int32_t>(w.last));
    max_window_rows_ = std::max(max_window_rows_, w.last - w.first + 1);
  }
  // The tokens' arrays, each at its fixed offset.
  upload_.begin();
  tokens_ = T;
  token_sequence_ = upload_.append(std::span<const int32_t>(token_slot), DType::i32, {T}, reserve);
  token_position_ = upload_.append(std::span<const int32_t>(token_position), DType::i32, {T}, reserve);
  window_first_ = upload_.append(std::span<const int32_t>(first), DType::i32, {static_cast<int64_t>(first.size())},
                                 reserve);
  window_last_ = upload_.append(std::span<const int32_t>(last), DType::i32, {static_cast<int64_t>(last.size())},
                                reserve);
  if (step.windows.empty()) window_first_ = window_last_ = TensorView{};
  pack_staging(step, topology, caches);
  upload_.upload(stream);
  // The tables, then the slots read from them.
  caches.upload_table_changes();
  launch_step_slots(caches.device_pool_tables(), static_cast<int64_t* const*>(slot_pointers_.data()),
                    static_cast<int>(caches.pool_tables().size()), token_sequence_.ptr<const int32_t>(),
                    token_position_.ptr<const int32_t>(), T, stream);

  int64_t longest = 0;
  for (const StepChunk& ch : step.chunks) longest = std::max(longest, ch.start + ch.tokens);
  graph_key_ = mix(mix(mix(0xcbf29ce484222325ull, static_cast<uint64_t>(T)), step.windows.empty() ? 0 : 1),
                   static_cast<uint64_t>(max_window_rows_));
  for (int l = 0; l < topology.size(); ++l) {
    LayerStep& ls = layers_[static_cast<size_t>(l)];
    for (TensorView* v : {&ls.window_slots, &ls.compressed_slots, &ls.index_key_slots})
      if (is_present(*v)) *v = TensorView::contiguous(v->data, DType::i64, {T}, Device::cuda, v->device_index);
    if (!topology[l].owns_compressor) continue;
    const int64_t ratio = topology[l].compress_ratio;
    ls.entries = entries_bucket(longest / ratio, max_context_ / ratio);
    graph_key_ = mix(graph_key_, static_cast<uint64_t>(ls.entries));
  }
  graph_key_ = mix(graph_key_, staging_key_);
}

void StepMetadata::pack_staging(const StepLayout& step, const ModelTopology& topology, const DeviceCaches& caches) {
  const KvCacheManager& manager = caches.manager();
  const int64_t T = step.tokens(), S = static_cast<int64_t>(step.chunks.size());
  sequences_ = S;
  staging_key_ = 0;
  step_sequence_ = TensorView{};
  for (LayerStep& ls : layers_) ls.stages_attention = false;
  std::fill(staged_pools_.begin(), staged_pools_.end(), StagedPool{});
  if (std::find(stageable_pools_.begin(), stageable_pools_.end(), true) == stageable_pools_.end()) return;

  // Each pool's runs, counted when a layer first asks.
  std::vector<std::vector<StagedRun>> runs(stageable_pools_.size());
  std::vector<int64_t> pages(stageable_pools_.size(), -1);
  const auto count = [&](int pool) {
    if (pages[static_cast<size_t>(pool)] >= 0) return pages[static_cast<size_t>(pool)];
    const int64_t width = caches.pool_tables()[static_cast<size_t>(pool)].width;
    int64_t first = 0;
    for (const StepChunk& ch : step.chunks) {
      const int64_t slot = manager.sequence_slot(ch.sequence);
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(manager.slot_block_table(pool, slot).pages.size()), width);
      runs[static_cast<size_t>(pool)].push_back(
          {static_cast<int32_t>(slot), static_cast<int32_t>(first), static_cast<int32_t>(n)});
      first += n;
    }
    return pages[static_cast<size_t>(pool)] = first;
  };
  const std::vector<const PagePool*> pools = manager.pools();
  std::vector<bool> used(stageable_pools_.size(), false);
  for (const auto& [layer, window, compressed] : attended_) {
    const LayerPlan& plan = topology[layer];
    if (!stageable_pools_[static_cast<size_t>(window)] ||
        (compressed >= 0 && !stageable_pools_[static_cast<size_t>(compressed)]))
      continue;
    // The rows the step's tokens attend (at most), and the window rows they attend together:
    // a lower bound of the staged rows that settles decode steps before any page is counted.
    int64_t attended = 0, window_rows = 0;
    for (const StepChunk& ch : step.chunks) {
      const int64_t end = ch.start + ch.tokens;
      int64_t picks = 0;
      if (plan.kv_source >= 0) {
        const int64_t visible = end / topology[plan.kv_source].compress_ratio;
        picks = plan.index_source >= 0 ? std::min(staging_.index_topk, visible) : visible;
      }
      attended += ch.tokens * (std::min(staging_.window, end) + picks);
      window_rows += std::min(end, staging_.window - 1 + ch.tokens);
    }
    if (attended < kMinRowReuse * window_rows) continue;
    const PagePool& window_pool = *pools[static_cast<size_t>(window)];
    int64_t rows = count(window) * window_pool.rows_per_page();
    int64_t bytes = static_cast<int64_t>(staged_pages_bytes(window_pool.geometry(), count(window)));
    if (compressed >= 0) {
      const PagePool& compressed_pool = *pools[static_cast<size_t>(compressed)];
      rows += count(compressed) * compressed_pool.rows_per_page();
      bytes += static_cast<int64_t>(staged_pages_bytes(compressed_pool.geometry(), count(compressed)));
    }
    if (attended < kMinRowReuse * rows || bytes > staging_.bytes) continue;
    layers_[static_cast<size_t>(plan.layer)].stages_attention = true;
    used[static_cast<size_t>(window)] = true;
    if (compressed >= 0) used[static_cast<size_t>(compressed)] = true;
    staging_key_ = mix(mix(mix(staging_key_, static_cast<uint64_t>(plan.layer)), static_cast<uint64_t>(count(window))),
                       static_cast<uint64_t>(compressed >= 0 ? count(compressed) : 0));
  }
  if (std::find(used.begin(), used.end(), true) == used.end()) return;
  staging_key_ = mix(staging_key_, static_cast<uint64_t>(S));
  // The step's entries and every stageable pool's runs, each at its fixed offset.
  std::vector<int32_t> entry(step.chunk_of.begin(), step.chunk_of.end());
  step_sequence_ = upload_.append(std::span<const int32_t>(entry), DType::i32, {T}, static_cast<size_t>(max_tokens_) * 4);
  const size_t reserve = static_cast<size_t>(std::min(max_tokens_, staging_.max_sequences)) * sizeof(StagedRun);
  for (size_t pool = 0; pool < stageable_pools_.size(); ++pool) {
    if (!stageable_pools_[pool]) continue;
    const std::vector<StagedRun> none;
    const std::vector<StagedRun>& r = used[pool] ? runs[pool] : none;
    const TensorView view = upload_.append(r.data(), r.size() * sizeof(StagedRun), DType::i32,
                                           {static_cast<int64_t>(r.size()), 3}, reserve);
    if (used[pool]) staged_pools_[pool] = {view, pages[pool]};
  }
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

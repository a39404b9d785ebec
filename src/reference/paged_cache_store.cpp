// Paged storage of the CPU reference's caches: the KvCacheManager's pools in the byte formats of a
// kv_format set (window, compressed and index-key rows encoded and decoded by the row formats).
#include <map>
#include <new>

#include "dsv4/error.h"
#include "dsv4/kv_cache.h"
#include "dsv4/kv_format.h"
#include "reference/cache_store.h"

namespace dsv4::reference {
namespace {

KvCacheOptions cache_options(const ModelConfig& config, const ModelTopology& topology,
                             const std::vector<LayerCacheShape>& shapes, const KvFormatSet& formats,
                             const PoolLimits& limits) {
  KvCacheOptions o;
  o.formats = formats;
  for (const LayerCacheShape& s : shapes) o.compressor_state_floats.push_back(s.compressor_floats);
  if (!shapes.empty()) o.rollback_rows = shapes.front().rollback_rows;
  o.capacity = plan_kv_cache_capacity(config, topology, o, limits.max_sequences, limits.max_context,
                                      limits.max_step_tokens);
  return o;
}

class PagedCacheStore final : public CacheStore {
 public:
  PagedCacheStore(const ModelConfig& config, const ModelTopology& topology, std::vector<LayerCacheShape> shapes,
                  const KvFormatSet& formats, const PoolLimits& limits)
      : shapes_(std::move(shapes)), manager_(config, topology, cache_options(config, topology, shapes_, formats, limits)) {
    for (int l = 0; l < static_cast<int>(shapes_.size()); ++l) {
      const LayerCacheShape& s = shapes_[static_cast<size_t>(l)];
      DSV4_CHECK(manager_.has_pool(CacheKind::compressed, l) == s.has_compressed &&
                     manager_.has_pool(CacheKind::index_keys, l) == (s.index_key_dim > 0),
                 "reference: paged cache store: the cache manager's pools of layer ", l,
                 " do not match the layer's caches");
    }
  }

  void add_sequence(SequenceId id) override {
    manager_.add_sequence(id);
    entries_[id].assign(shapes_.size(), Entries{});
  }
  void fork_sequence(SequenceId parent, SequenceId child) override {
    manager_.fork_sequence(parent, child);
    entries_[child] = entries_.at(parent);
  }
  void release_sequence(SequenceId id) override {
    manager_.release_sequence(id);
    entries_.erase(id);
  }
  int64_t length(SequenceId id) const override { return manager_.sequence_length(id); }
  int64_t cache_bytes(SequenceId id) const override { return manager_.sequence_bytes(id); }
  int64_t held_bytes() const override {
    int64_t bytes = 0;
    for (const PagePool* pool : manager_.pools()) bytes += static_cast<int64_t>(pool->bytes().size());
    int64_t state_floats = 0;  // compressor states of one sequence
    for (const LayerCacheShape& s : shapes_) state_floats += s.compressor_floats;
    return bytes + static_cast<int64_t>(manager_.sequences().size()) * state_floats * static_cast<int64_t>(sizeof(float));
  }

  void reserve(const std::vector<StepEntry>& step) override {
    std::vector<CacheStepEntry> entries;
    for (const StepEntry& e : step) entries.push_back({e.sequence, e.num_tokens});
    manager_.reserve(entries);
  }
  void commit(SequenceId id, int64_t tokens) override { manager_.commit(id, length(id) + tokens); }
  void rollback(SequenceId id, int64_t new_length) override {
    manager_.rollback(id, new_length);
    for (size_t l = 0; l < shapes_.size(); ++l) {
      const LayerCacheShape& shape = shapes_[l];
      if (!shape.has_compressed) continue;
      Entries& e = entries_of(id, static_cast<int>(l));
      e.compressed = std::min(e.compressed, new_length / shape.compress_ratio);
      e.index_keys = std::min(e.index_keys, new_length / shape.compress_ratio);
    }
  }

  void read_window_rows(SequenceId id, int layer, int64_t first, int64_t n, float* out) const override {
    manager_.read_rows(id, CacheKind::window, layer, first, n, out);
  }
  void write_window_rows(SequenceId id, int layer, int64_t first, int64_t n, const float* rows) override {
    manager_.write_rows(id, CacheKind::window, layer, first, n, rows);
  }
  void round_trip_window_rows(int layer, float* rows, int64_t n) const override {
    const PagePool& pool = manager_.pool(CacheKind::window, layer);
    const PageGeometry& g = pool.geometry();
    std::vector<std::byte> pages(static_cast<size_t>((n + g.rows_per_page - 1) / g.rows_per_page * g.page_stride));
    std::vector<int64_t> slots(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) slots[i] = i;
    encode_rows(g, rows, n, slots.data(), pages.data(), pool.tensor_scale());
    decode_rows(g, pages.data(), slots.data(), n, rows, pool.tensor_scale());
  }

  int64_t compressed_entries(SequenceId id, int layer) const override { return entries_of(id, layer).compressed; }
  void read_compressed_entries(SequenceId id, int layer, const int64_t* entries, int64_t n, float* out) const override {
    const int64_t count = compressed_entries(id, layer);
    std::vector<int64_t> slots(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      DSV4_CHECK(entries[i] >= 0 && entries[i] < count, "reference: layer ", layer, ": compressed entry ", entries[i],
                 " does not exist (", count, " entries)");
      slots[i] = manager_.slot(id, CacheKind::compressed, layer, entries[i]);
    }
    manager_.read_slots(CacheKind::compressed, layer, slots.data(), n, out);
  }
  void append_compressed_entries(SequenceId id, int layer, int64_t n, const float* rows) override {
    int64_t& count = entries_of(id, layer).compressed;
    manager_.write_rows(id, CacheKind::compressed, layer, count, n, rows);
    count += n;
  }
  int64_t index_keys(SequenceId id, int layer) const override { return entries_of(id, layer).index_keys; }
  void read_index_keys(SequenceId id, int layer, int64_t first, int64_t n, float* out) const override {
    const int64_t count = index_keys(id, layer);
    DSV4_CHECK(first >= 0 && n >= 0 && first + n <= count, "reference: layer ", layer, ": index keys [", first, ", ",
               first + n, ") do not exist (", count, " keys)");
    manager_.read_rows(id, CacheKind::index_keys, layer, first, n, out);
  }
  void append_index_keys(SequenceId id, int layer, int64_t n, const float* keys) override {
    int64_t& count = entries_of(id, layer).index_keys;
    manager_.write_rows(id, CacheKind::index_keys, layer, count, n, keys);
    count += n;
  }

  std::span<float> compressor_state(SequenceId id, int layer) override { return manager_.compressor_state(id, layer); }
  std::span<const float> compressor_state(SequenceId id, int layer) const override {
    return manager_.compressor_state(id, layer);
  }

 private:
  // Entries written so far (the manager knows pages, not how many rows of the step are written).
  struct Entries {
    int64_t compressed = 0;
    int64_t index_keys = 0;
  };
  Entries& entries_of(SequenceId id, int layer) {
    auto it = entries_.find(id);
    DSV4_CHECK(it != entries_.end(), "reference: cache store: sequence ", id, " does not exist");
    DSV4_CHECK(layer >= 0 && layer < static_cast<int>(shapes_.size()), "reference: cache store: layer ", layer,
               " does not exist (", shapes_.size(), " layers)");
    return it->second[static_cast<size_t>(layer)];
  }
  const Entries& entries_of(SequenceId id, int layer) const {
    return const_cast<PagedCacheStore*>(this)->entries_of(id, layer);
  }

  std::vector<LayerCacheShape> shapes_;
  KvCacheManager manager_;
  std::map<SequenceId, std::vector<Entries>> entries_;
};

}  // namespace

std::unique_ptr<CacheStore> make_paged_cache_store(const ModelConfig& config, const ModelTopology& topology,
                                                   std::vector<LayerCacheShape> shapes, const KvFormatSet& formats,
                                                   const PoolLimits& limits) {
  try {
    return std::make_unique<PagedCacheStore>(config, topology, std::move(shapes), formats, limits);
  } catch (const std::bad_alloc&) {
    fail("engine: create: the '", formats.name, "' cache pools for ", limits.max_sequences, " sequences of ",
         limits.max_context, " tokens (EngineOptions::max_sequences, max_context) do not fit in memory");
  }
}

}  // namespace dsv4::reference

// Float storage of the CPU reference's caches: per sequence and layer a window ring of fp32 rows
// (window + rollback_rows slots, so that a rollback finds the window it needs) and growing arrays
// of compressed entries and index keys.
#include <algorithm>
#include <map>

#include "dsv4/error.h"
#include "reference/cache_store.h"

namespace dsv4::reference {
namespace {

class FloatCacheStore final : public CacheStore {
 public:
  explicit FloatCacheStore(std::vector<LayerCacheShape> shapes) : shapes_(std::move(shapes)) {}

  void add_sequence(SequenceId id) override {
    DSV4_CHECK(!sequences_.count(id), "reference: cache store: sequence ", id, " exists already");
    Sequence& s = sequences_[id];
    s.layers.resize(shapes_.size());
    for (size_t l = 0; l < shapes_.size(); ++l) {
      s.layers[l].window.assign(static_cast<size_t>(ring_rows(shapes_[l]) * shapes_[l].row_dim), 0.0f);
      s.layers[l].compressor.assign(static_cast<size_t>(shapes_[l].compressor_floats), 0.0f);
    }
  }
  void fork_sequence(SequenceId parent, SequenceId child) override {
    DSV4_CHECK(!sequences_.count(child), "reference: cache store: sequence ", child, " exists already");
    sequences_[child] = sequence(parent);
  }
  void release_sequence(SequenceId id) override {
    sequence(id);
    sequences_.erase(id);
  }
  int64_t length(SequenceId id) const override { return sequence(id).length; }
  int64_t cache_bytes(SequenceId id) const override {
    size_t floats = 0;
    for (const LayerCaches& c : sequence(id).layers)
      floats += c.window.size() + c.compressed.size() + c.index_keys.size() + c.compressor.size();
    return static_cast<int64_t>(floats * sizeof(float));
  }

  int64_t held_bytes() const override {
    int64_t bytes = 0;
    for (const auto& [id, s] : sequences_) bytes += cache_bytes(id);
    return bytes;
  }

  // Arrays grow on demand; reserving capacity up front keeps a step from failing half-way.
  void reserve(const std::vector<StepEntry>& step) override {
    for (const StepEntry& e : step) {
      Sequence& s = sequence(e.sequence);
      for (size_t l = 0; l < shapes_.size(); ++l) {
        const LayerCacheShape& shape = shapes_[l];
        if (!shape.has_compressed) continue;
        const size_t entries = static_cast<size_t>((s.length + e.num_tokens) / shape.compress_ratio);
        s.layers[l].compressed.reserve(entries * static_cast<size_t>(shape.row_dim));
        s.layers[l].index_keys.reserve(entries * static_cast<size_t>(shape.index_key_dim));
      }
    }
  }
  void commit(SequenceId id, int64_t tokens) override { sequence(id).length += tokens; }
  void rollback(SequenceId id, int64_t new_length) override {
    Sequence& s = sequence(id);
    DSV4_CHECK(new_length >= 0 && new_length <= s.length, "reference: cache store: rollback of sequence ", id,
               " to ", new_length, ", expected a length in [0, ", s.length, "]");
    s.length = new_length;
    for (size_t l = 0; l < shapes_.size(); ++l) {
      const LayerCacheShape& shape = shapes_[l];
      if (!shape.has_compressed) continue;
      const size_t entries = static_cast<size_t>(new_length / shape.compress_ratio);
      s.layers[l].compressed.resize(std::min(s.layers[l].compressed.size(), entries * shape.row_dim));
      s.layers[l].index_keys.resize(std::min(s.layers[l].index_keys.size(), entries * shape.index_key_dim));
    }
  }

  void read_window_rows(SequenceId id, int layer, int64_t first, int64_t n, float* out) const override {
    const Sequence& s = sequence(id);
    const LayerCacheShape& shape = shape_of(layer);
    DSV4_CHECK(n >= 0 && first >= std::max<int64_t>(0, s.length - shape.window) && first + n <= s.length,
               "reference: layer ", layer, ": window rows [", first, ", ", first + n,
               ") are not cached (sequence length ", s.length, ", window ", shape.window, ")");
    const std::vector<float>& ring = s.layers[static_cast<size_t>(layer)].window;
    for (int64_t i = 0; i < n; ++i) {
      const float* row = ring.data() + ((first + i) % ring_rows(shape)) * shape.row_dim;
      std::copy(row, row + shape.row_dim, out + i * shape.row_dim);
    }
  }
  void write_window_rows(SequenceId id, int layer, int64_t first, int64_t n, const float* rows) override {
    Sequence& s = sequence(id);
    const LayerCacheShape& shape = shape_of(layer);
    DSV4_CHECK(n >= 0 && first >= s.length, "reference: layer ", layer, ": window rows [", first, ", ", first + n,
               ") overwrite committed positions (sequence length ", s.length, ")");
    std::vector<float>& ring = s.layers[static_cast<size_t>(layer)].window;
    const int64_t slots = ring_rows(shape);
    for (int64_t i = std::max<int64_t>(0, n - slots); i < n; ++i)  // only the last `slots` rows survive
      std::copy(rows + i * shape.row_dim, rows + (i + 1) * shape.row_dim,
                ring.data() + ((first + i) % slots) * shape.row_dim);
  }
  void round_trip_window_rows(int, float*, int64_t) const override {}

  int64_t compressed_entries(SequenceId id, int layer) const override {
    const LayerCacheShape& shape = shape_of(layer);
    return shape.has_compressed
               ? static_cast<int64_t>(sequence(id).layers[static_cast<size_t>(layer)].compressed.size()) / shape.row_dim
               : 0;
  }
  void read_compressed_entries(SequenceId id, int layer, const int64_t* entries, int64_t n, float* out) const override {
    const int64_t count = compressed_entries(id, layer), dim = shape_of(layer).row_dim;
    const std::vector<float>& v = sequence(id).layers[static_cast<size_t>(layer)].compressed;
    for (int64_t i = 0; i < n; ++i) {
      DSV4_CHECK(entries[i] >= 0 && entries[i] < count, "reference: layer ", layer, ": compressed entry ", entries[i],
                 " does not exist (", count, " entries)");
      std::copy(v.data() + entries[i] * dim, v.data() + (entries[i] + 1) * dim, out + i * dim);
    }
  }
  void append_compressed_entries(SequenceId id, int layer, int64_t n, const float* rows) override {
    const LayerCacheShape& shape = shape_of(layer);
    DSV4_CHECK(shape.has_compressed, "reference: layer ", layer, " has no compressed cache");
    auto& v = sequence(id).layers[static_cast<size_t>(layer)].compressed;
    v.insert(v.end(), rows, rows + n * shape.row_dim);
  }
  int64_t index_keys(SequenceId id, int layer) const override {
    const LayerCacheShape& shape = shape_of(layer);
    return shape.index_key_dim
               ? static_cast<int64_t>(sequence(id).layers[static_cast<size_t>(layer)].index_keys.size()) /
                     shape.index_key_dim
               : 0;
  }
  void read_index_keys(SequenceId id, int layer, int64_t first, int64_t n, float* out) const override {
    const int64_t count = index_keys(id, layer), dim = shape_of(layer).index_key_dim;
    DSV4_CHECK(first >= 0 && n >= 0 && first + n <= count, "reference: layer ", layer, ": index keys [", first, ", ",
               first + n, ") do not exist (", count, " keys)");
    const std::vector<float>& v = sequence(id).layers[static_cast<size_t>(layer)].index_keys;
    std::copy(v.data() + first * dim, v.data() + (first + n) * dim, out);
  }
  void append_index_keys(SequenceId id, int layer, int64_t n, const float* keys) override {
    const LayerCacheShape& shape = shape_of(layer);
    DSV4_CHECK(shape.index_key_dim > 0, "reference: layer ", layer, " has no index-key cache");
    auto& v = sequence(id).layers[static_cast<size_t>(layer)].index_keys;
    v.insert(v.end(), keys, keys + n * shape.index_key_dim);
  }

  std::span<float> compressor_state(SequenceId id, int layer) override {
    shape_of(layer);
    return sequence(id).layers[static_cast<size_t>(layer)].compressor;
  }
  std::span<const float> compressor_state(SequenceId id, int layer) const override {
    shape_of(layer);
    return sequence(id).layers[static_cast<size_t>(layer)].compressor;
  }

 private:
  struct LayerCaches {
    std::vector<float> window;      // ring, slot = position % (window + rollback_rows)
    std::vector<float> compressed;  // [entries, row_dim]
    std::vector<float> index_keys;  // [entries, index_key_dim]
    std::vector<float> compressor;
  };
  struct Sequence {
    int64_t length = 0;
    std::vector<LayerCaches> layers;
  };

  static int64_t ring_rows(const LayerCacheShape& shape) { return shape.window + shape.rollback_rows; }
  const LayerCacheShape& shape_of(int layer) const {
    DSV4_CHECK(layer >= 0 && layer < static_cast<int>(shapes_.size()), "reference: cache store: layer ", layer,
               " does not exist (", shapes_.size(), " layers)");
    return shapes_[static_cast<size_t>(layer)];
  }
  Sequence& sequence(SequenceId id) {
    auto it = sequences_.find(id);
    DSV4_CHECK(it != sequences_.end(), "reference: cache store: sequence ", id, " does not exist");
    return it->second;
  }
  const Sequence& sequence(SequenceId id) const { return const_cast<FloatCacheStore*>(this)->sequence(id); }

  std::vector<LayerCacheShape> shapes_;
  std::map<SequenceId, Sequence> sequences_;
};

}  // namespace

std::unique_ptr<CacheStore> make_float_cache_store(std::vector<LayerCacheShape> shapes) {
  return std::make_unique<FloatCacheStore>(std::move(shapes));
}

}  // namespace dsv4::reference

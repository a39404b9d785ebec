#include "reference/sequence_state.h"

#include <algorithm>

#include "dsv4/error.h"

namespace dsv4::reference {

SequenceState::SequenceState(std::shared_ptr<const std::vector<LayerCacheShape>> shapes) : shapes_(std::move(shapes)) {
  layers_.resize(shapes_->size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerCacheShape& s = (*shapes_)[l];
    layers_[l].window.assign(static_cast<size_t>(s.window * s.row_dim), 0.0f);
    layers_[l].compressor.assign(static_cast<size_t>(s.compressor_floats), 0.0f);
  }
}

const LayerCacheShape& SequenceState::shape(int layer) const {
  DSV4_CHECK(layer >= 0 && layer < static_cast<int>(shapes_->size()), "reference: sequence state: layer ", layer,
             " does not exist (", shapes_->size(), " layers)");
  return (*shapes_)[static_cast<size_t>(layer)];
}

void SequenceState::read_window_rows(int layer, int64_t first, int64_t n, float* out) const {
  const LayerCacheShape& s = shape(layer);
  DSV4_CHECK(n >= 0 && first >= std::max<int64_t>(0, length_ - s.window) && first + n <= length_, "reference: layer ",
             layer, ": window rows [", first, ", ", first + n, ") are not cached (sequence length ", length_,
             ", window ", s.window, ")");
  const std::vector<float>& ring = layers_[static_cast<size_t>(layer)].window;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = ring.data() + ((first + i) % s.window) * s.row_dim;
    std::copy(row, row + s.row_dim, out + i * s.row_dim);
  }
}

void SequenceState::write_window_rows(int layer, int64_t first, int64_t n, const float* rows) {
  const LayerCacheShape& s = shape(layer);
  DSV4_CHECK(n >= 0 && first >= length_, "reference: layer ", layer, ": window rows [", first, ", ", first + n,
             ") overwrite committed positions (sequence length ", length_, ")");
  std::vector<float>& ring = layers_[static_cast<size_t>(layer)].window;
  // Only the last `window` rows survive.
  for (int64_t i = std::max<int64_t>(0, n - s.window); i < n; ++i)
    std::copy(rows + i * s.row_dim, rows + (i + 1) * s.row_dim, ring.data() + ((first + i) % s.window) * s.row_dim);
}

int64_t SequenceState::compressed_entries(int layer) const {
  const LayerCacheShape& s = shape(layer);
  return s.has_compressed ? static_cast<int64_t>(layers_[static_cast<size_t>(layer)].compressed.size()) / s.row_dim : 0;
}

void SequenceState::read_compressed_entries(int layer, const int64_t* entries, int64_t n, float* out) const {
  const LayerCacheShape& s = shape(layer);
  const int64_t count = compressed_entries(layer);
  const std::vector<float>& v = layers_[static_cast<size_t>(layer)].compressed;
  for (int64_t i = 0; i < n; ++i) {
    DSV4_CHECK(entries[i] >= 0 && entries[i] < count, "reference: layer ", layer, ": compressed entry ", entries[i],
               " does not exist (", count, " entries)");
    std::copy(v.data() + entries[i] * s.row_dim, v.data() + (entries[i] + 1) * s.row_dim, out + i * s.row_dim);
  }
}

void SequenceState::append_compressed_entries(int layer, int64_t n, const float* rows) {
  const LayerCacheShape& s = shape(layer);
  DSV4_CHECK(s.has_compressed, "reference: layer ", layer, " has no compressed cache");
  auto& v = layers_[static_cast<size_t>(layer)].compressed;
  v.insert(v.end(), rows, rows + n * s.row_dim);
}

int64_t SequenceState::index_keys(int layer) const {
  const LayerCacheShape& s = shape(layer);
  return s.index_key_dim ? static_cast<int64_t>(layers_[static_cast<size_t>(layer)].index_keys.size()) / s.index_key_dim
                         : 0;
}

void SequenceState::read_index_keys(int layer, int64_t first, int64_t n, float* out) const {
  const LayerCacheShape& s = shape(layer);
  DSV4_CHECK(first >= 0 && n >= 0 && first + n <= index_keys(layer), "reference: layer ", layer, ": index keys [",
             first, ", ", first + n, ") do not exist (", index_keys(layer), " keys)");
  const std::vector<float>& v = layers_[static_cast<size_t>(layer)].index_keys;
  std::copy(v.data() + first * s.index_key_dim, v.data() + (first + n) * s.index_key_dim, out);
}

void SequenceState::append_index_keys(int layer, int64_t n, const float* keys) {
  const LayerCacheShape& s = shape(layer);
  DSV4_CHECK(s.index_key_dim > 0, "reference: layer ", layer, " has no index-key cache");
  auto& v = layers_[static_cast<size_t>(layer)].index_keys;
  v.insert(v.end(), keys, keys + n * s.index_key_dim);
}

std::span<float> SequenceState::compressor_state(int layer) {
  shape(layer);
  return layers_[static_cast<size_t>(layer)].compressor;
}

std::span<const float> SequenceState::compressor_state(int layer) const {
  shape(layer);
  return layers_[static_cast<size_t>(layer)].compressor;
}

int64_t SequenceState::cache_bytes() const {
  size_t floats = 0;
  for (const LayerCaches& c : layers_)
    floats += c.window.size() + c.compressed.size() + c.index_keys.size() + c.compressor.size();
  return static_cast<int64_t>(floats * sizeof(float));
}

}  // namespace dsv4::reference

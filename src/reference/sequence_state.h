// The per-sequence caches of the CPU reference: for every layer its sliding-window rows, and for
// kv-source layers the compressed entries, the index keys and the compressor's pending projected
// rows. Values are stored as fp32 (already fake-quantized where the precision asks for it).
//
// The interface copies rows in and out by position / entry index, the way a paged cache manager
// with byte formats is addressed; nothing outside this class knows how the rows are kept.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace dsv4::reference {

// What one layer caches per sequence; a zero width means the layer has no such cache.
struct LayerCacheShape {
  int64_t window = 0;            // window rows kept (sliding_window)
  int64_t row_dim = 0;           // channels of a window row and of a compressed entry (head_dim)
  bool has_compressed = false;   // kv source: compressed entries
  int64_t index_key_dim = 0;     // kv source with index keys: channels of one key
  int64_t compressor_floats = 0; // kv source: fp32 state of its compressor(s)
};

class SequenceState {
 public:
  explicit SequenceState(std::shared_ptr<const std::vector<LayerCacheShape>> shapes);

  // Tokens committed so far (the position of the next token).
  int64_t length() const { return length_; }
  void advance(int64_t tokens) { length_ += tokens; }

  // Window rows of positions [first, first + n): readable are the last `window` committed
  // positions; written are positions >= length() (this step's tokens).
  void read_window_rows(int layer, int64_t first, int64_t n, float* out) const;
  void write_window_rows(int layer, int64_t first, int64_t n, const float* rows);

  // Compressed entries and index keys, appended in entry order.
  int64_t compressed_entries(int layer) const;
  void read_compressed_entries(int layer, const int64_t* entries, int64_t n, float* out) const;
  void append_compressed_entries(int layer, int64_t n, const float* rows);
  int64_t index_keys(int layer) const;
  void read_index_keys(int layer, int64_t first, int64_t n, float* out) const;
  void append_index_keys(int layer, int64_t n, const float* keys);

  // The fp32 state of the layer's compressor(s) (LayerCacheShape::compressor_floats).
  std::span<float> compressor_state(int layer);
  std::span<const float> compressor_state(int layer) const;

  // A layer that did not run in one of the sequence's steps (an optional MTP layer) has
  // incomplete caches and must not run for it again.
  void mark_skipped_layer(int layer) { layers_.at(static_cast<size_t>(layer)).skipped = true; }
  bool skipped_layer(int layer) const { return layers_.at(static_cast<size_t>(layer)).skipped; }

  // Bytes of every cache this sequence holds.
  int64_t cache_bytes() const;

 private:
  struct LayerCaches {
    std::vector<float> window;      // ring, slot = position % window
    std::vector<float> compressed;  // [entries, row_dim]
    std::vector<float> index_keys;  // [entries, index_key_dim]
    std::vector<float> compressor;
    bool skipped = false;
  };
  const LayerCacheShape& shape(int layer) const;

  std::shared_ptr<const std::vector<LayerCacheShape>> shapes_;
  std::vector<LayerCaches> layers_;
  int64_t length_ = 0;
};

}  // namespace dsv4::reference

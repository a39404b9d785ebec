// Where the CPU reference keeps every sequence's caches: per layer its sliding-window rows, and
// for kv-source layers the compressed entries, the index keys and the compressor state (the
// pending projected rows of open groups).
//
// Layers address rows by position and entries by index and copy them in and out, the way a paged
// cache manager with byte formats is addressed; two stores implement that:
//  * float storage (CacheStorage::float_rows): fp32 rows in per-sequence arrays that grow
//    with the sequence; nothing is allocated up front;
//  * paged storage (CacheStorage::paged): the KvCacheManager's page pools in that set's byte
//    formats, sized up front for max_sequences × max_context, forks sharing pages.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/kv_format.h"
#include "dsv4/types.h"

namespace dsv4::reference {

// What one layer caches per sequence; zero / false means the layer has no such cache.
struct LayerCacheShape {
  int64_t window = 0;             // window rows read (sliding_window)
  int64_t rollback_rows = 0;      // window rows kept beyond them for rollbacks (EngineOptions::max_rollback)
  int64_t row_dim = 0;            // channels of a window row and of a compressed entry (head_dim)
  int64_t compress_ratio = 0;     // tokens per compressed entry
  bool has_compressed = false;    // kv source: compressed entries
  int64_t index_key_dim = 0;      // kv source with index keys: channels of one key
  int64_t compressor_floats = 0;  // kv source: fp32 state of its compressor(s)
};

class CacheStore {
 public:
  virtual ~CacheStore() = default;

  // ----- sequences
  virtual void add_sequence(SequenceId id) = 0;
  // `child` starts with all of `parent`'s committed caches.
  virtual void fork_sequence(SequenceId parent, SequenceId child) = 0;
  virtual void release_sequence(SequenceId id) = 0;
  // Committed tokens (the position of the next token).
  virtual int64_t length(SequenceId id) const = 0;
  virtual int64_t cache_bytes(SequenceId id) const = 0;
  // Bytes the store holds for all sequences: the page pools of paged storage (allocated up
  // front), the live sequences' rows and states of float storage.
  virtual int64_t held_bytes() const = 0;

  // ----- steps
  // Makes room for every row the step writes; all-or-nothing (throws and changes nothing).
  virtual void reserve(const std::vector<StepEntry>& step) = 0;
  // Advances the sequence by `tokens` after its step.
  virtual void commit(SequenceId id, int64_t tokens) = 0;
  // Shrinks the sequence to its first new_length tokens (within the rollback_rows kept): entries
  // and keys past them go, window rows and compressor rows stay where they are (position-addressed).
  virtual void rollback(SequenceId id, int64_t new_length) = 0;

  // ----- rows
  // Window rows of positions [first, first + n): readable are the last `window` committed
  // positions; written are the step's positions (>= length).
  virtual void read_window_rows(SequenceId id, int layer, int64_t first, int64_t n, float* out) const = 0;
  virtual void write_window_rows(SequenceId id, int layer, int64_t first, int64_t n, const float* rows) = 0;
  // Replaces rows [n, row_dim] by what the layer's window cache returns after storing them (the
  // row format's rounding; nothing for float storage), so that a step's own rows are attended
  // exactly as later steps will read them.
  virtual void round_trip_window_rows(int layer, float* rows, int64_t n) const = 0;

  // Compressed entries and index keys, appended in entry order (during a step too).
  virtual int64_t compressed_entries(SequenceId id, int layer) const = 0;
  virtual void read_compressed_entries(SequenceId id, int layer, const int64_t* entries, int64_t n,
                                       float* out) const = 0;
  virtual void append_compressed_entries(SequenceId id, int layer, int64_t n, const float* rows) = 0;
  virtual int64_t index_keys(SequenceId id, int layer) const = 0;
  virtual void read_index_keys(SequenceId id, int layer, int64_t first, int64_t n, float* out) const = 0;
  virtual void append_index_keys(SequenceId id, int layer, int64_t n, const float* keys) = 0;

  // The fp32 state of the layer's compressor(s) (LayerCacheShape::compressor_floats).
  virtual std::span<float> compressor_state(SequenceId id, int layer) = 0;
  virtual std::span<const float> compressor_state(SequenceId id, int layer) const = 0;
};

// Float storage; `shapes` has one entry per layer.
std::unique_ptr<CacheStore> make_float_cache_store(std::vector<LayerCacheShape> shapes);

// How many sequences of how many tokens paged pools are sized for.
struct PoolLimits {
  int64_t max_sequences = 0;
  int64_t max_context = 0;
  int64_t max_step_tokens = 0;  // tokens of one step, over all sequences
};

// Paged storage in `formats`, pools sized for `limits`.
std::unique_ptr<CacheStore> make_paged_cache_store(const ModelConfig& config, const ModelTopology& topology,
                                                   std::vector<LayerCacheShape> shapes, const KvFormatSet& formats,
                                                   const PoolLimits& limits);

}  // namespace dsv4::reference

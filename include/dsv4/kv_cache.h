// Paged KV caches of a whole model (SPEC §1.3, §3.3, §7; docs/caches.md).
//
// A PagePool is an arena of equally sized pages holding rows of one format, with a free list and
// per-page reference counts. It hands out page ids and byte offsets only, so that the same
// bookkeeping drives an arena that lives on a GPU (host_storage off: no host bytes at all).
//
// A KvCacheManager owns every pool of a model: one sliding-window pool per layer, one compressed
// pool and one index-key pool per kv-source layer, plus the compressor partial-group state of each
// kv-source layer. Sequences hold per-pool block tables; forks share pages by reference count and
// copy a shared page before the first write into it.
//
// Row addressing: a pool's row index is the token position for window pools and the entry
// (= group) index j for compressed and index-key pools; `slot = page * rows_per_page + row % rows_per_page`
// where `page = block_table[row / rows_per_page - first_logical_page]`.
//
// Not thread-safe: one thread drives a manager (kernels may read and write pool bytes by slot in
// parallel between manager calls).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/kv_format.h"
#include "dsv4/types.h"

namespace dsv4 {

// ---------------------------------------------------------------------------------------------
// Page pool

struct PoolSpec {
  std::string name;                   // shown in messages, e.g. "layer 20 compressed (v41_fp4)"
  std::optional<KvRowFormat> format;  // row format; nullopt: float storage (dims fp32 per row)
  int64_t dims = 0;                   // channels per row
  int64_t rows_per_page = 0;
  int64_t num_pages = 0;
  PagePlacement placement = PagePlacement::segregated;  // encoded pools only
  float tensor_scale = 1.0f;          // fp8_per_tensor only
  // false: page bookkeeping only, no host arena (the bytes live elsewhere, e.g. on a GPU, and the
  // row operations below throw).
  bool host_storage = true;
};

struct PoolStats {
  int64_t total_pages = 0;
  int64_t free_pages = 0;    // reference count 0
  int64_t used_pages = 0;    // reference count >= 1; free + used = total
  int64_t shared_pages = 0;  // reference count >= 2
  int64_t page_bytes = 0;    // page stride
};

class PagePool {
 public:
  // Validates the spec (positive sizes, a format that accepts `dims`); all pages start free.
  explicit PagePool(PoolSpec spec);

  const std::string& name() const { return spec_.name; }
  bool float_storage() const { return !spec_.format.has_value(); }
  // Page layout of an encoded pool; throws for a float-storage pool.
  const PageGeometry& geometry() const;
  int64_t dims() const { return spec_.dims; }
  int64_t rows_per_page() const { return spec_.rows_per_page; }
  int64_t num_pages() const { return spec_.num_pages; }
  int64_t page_stride() const { return page_stride_; }
  float tensor_scale() const { return spec_.tensor_scale; }
  bool host_storage() const { return spec_.host_storage; }

  // The whole arena (num_pages * page_stride bytes; empty without host storage); page p starts at
  // p * page_stride. Float storage: page p holds rows_per_page rows of dims fp32, row after row.
  std::span<const std::byte> bytes() const { return bytes_; }
  int64_t page_offset(int64_t page) const;

  // All-or-nothing: n free pages with reference count 1 and no row written, or throws
  // "dsv4: kv_cache: pool '<name>' is exhausted: asked for 3 pages, 1 free of 4096".
  std::vector<int64_t> allocate(int64_t n);
  void retain(int64_t page);   // page must be in use
  void release(int64_t page);  // page must be in use; at reference count 0 it is free again
  int32_t refcount(int64_t page) const;
  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()); }
  PoolStats stats() const;
  // The message allocate() throws, for callers that check availability themselves.
  std::string exhausted_message(int64_t asked) const;

  // Copies page `from` (bytes and which rows are written) onto page `to`; both must be in use.
  // Without host storage only the checks remain: the owner of the bytes copies them.
  void copy_page(int64_t from, int64_t to);

  // Stores n fp32 rows x [n, dims] at `slots` through the pool's format (slot < 0 is skipped).
  // Every slot must lie on a page with reference count exactly 1 (a shared page is copied first).
  // All slots are checked before anything is written.
  void write_rows(const float* x, int64_t n, const int64_t* slots);
  // Loads n rows from `slots` into out [n, dims] (fp32, the exact dequantized values). Every slot
  // must lie on a page in use and have been written.
  void read_rows(const int64_t* slots, int64_t n, float* out) const;
  bool is_written(int64_t slot) const;

 private:
  void check_page(const char* operation, int64_t page) const;
  void check_slot(const char* operation, int64_t slot) const;
  void check_host(const char* operation) const;

  PoolSpec spec_;
  std::optional<PageGeometry> geometry_;  // set for encoded pools
  int64_t row_bytes_ = 0;                 // float storage: dims * 4
  int64_t page_stride_ = 0;
  std::vector<std::byte> bytes_;
  std::vector<int32_t> refcount_;   // per page
  std::vector<int64_t> free_list_;  // stack; the lowest page ids are handed out first
  std::vector<uint8_t> written_;    // per slot: 1 once a row was stored there
};

// ---------------------------------------------------------------------------------------------
// Model caches

enum class CacheKind : uint8_t { window, compressed, index_keys };
const char* cache_kind_name(CacheKind k);  // "window", "compressed", "index keys"

// Pages of every pool of a kind (all pools of one kind get the same count) and sequence slots.
struct KvCacheCapacity {
  int64_t max_sequences = 0;     // live sequences at once (slots of the compressor state)
  int64_t window_pages = 0;      // per window pool (one per layer)
  int64_t compressed_pages = 0;  // per compressed pool (one per kv-source layer)
  int64_t index_key_pages = 0;   // per index-key pool (one per kv-source layer with an indexer)
};

struct KvCacheOptions {
  // Row formats of the three caches (kv_format_set()); nullopt: float storage, rows kept as fp32.
  std::optional<KvFormatSet> formats;
  KvCacheCapacity capacity;
  // Rows per page of each kind; 0: default_rows_per_page(format) (float storage: that of bf16).
  int64_t window_rows_per_page = 0;
  int64_t compressed_rows_per_page = 0;
  int64_t index_key_rows_per_page = 0;
  PagePlacement placement = PagePlacement::segregated;
  float fp8_tensor_scale = 1.0f;  // tensor scale of fp8_per_tensor pools
  // Window rows kept beyond the sliding window (EngineOptions::max_rollback): a sequence rolled
  // back by up to that many tokens still finds its whole window.
  int64_t rollback_rows = 0;
  // false: the pools keep no host bytes (PoolSpec::host_storage) and there is no host compressor
  // state (compressor_state() throws), for a backend that holds both on its device and mirrors
  // reserve()'s page copies there. The state is still accounted in sequence_bytes().
  bool host_storage = true;
  // Floats of compressor partial-group state per sequence, per layer id (total_layers() entries,
  // or empty for none). Only layers that own a compressor may have a nonzero count.
  std::vector<int64_t> compressor_state_floats;
};

// Pages per pool so that `max_sequences` sequences can each grow to `max_context` tokens, in steps
// of at most `max_step_tokens` tokens over all sequences, with no sharing between them. Uses the
// formats and rows per page of `options` (its capacity is ignored).
KvCacheCapacity plan_kv_cache_capacity(const ModelConfig& config, const ModelTopology& topology,
                                       const KvCacheOptions& options, int64_t max_sequences,
                                       int64_t max_context, int64_t max_step_tokens);

// One sequence's part of a step: `new_tokens` tokens appended at its committed length.
struct CacheStepEntry {
  SequenceId sequence = 0;
  int64_t new_tokens = 0;
};

// Logical page `first_logical_page + i` of a sequence's rows is physical page `pages[i]`. Window
// tables start past the pages that left the window; compressed and index-key tables at 0.
struct BlockTableView {
  int64_t first_logical_page = 0;
  std::span<const int64_t> pages;
};

// A page reserve() copied on write: a device mirror of the arena performs the same copy.
struct PageCopy {
  CacheKind kind;
  int layer;
  int64_t from;  // the shared page
  int64_t to;    // the sequence's new page
};

// The slots a kernel writes for one layer in a step; tokens are those of the step's entries,
// concatenated in order.
struct LayerStepSlots {
  std::vector<int64_t> window;      // [step tokens]: the token's row in this layer's window pool
  std::vector<int64_t> compressed;  // [step tokens]: entry of the group the token closes, else -1;
                                    // empty unless the layer owns a compressed pool
  std::vector<int64_t> index_keys;  // the same for the index-key pool; empty unless owned
};

class KvCacheManager {
 public:
  KvCacheManager(const ModelConfig& config, const ModelTopology& topology, KvCacheOptions options);
  // Not copyable: slot_sequence_ points into sequences_ (moving keeps the map's nodes).
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;
  KvCacheManager(KvCacheManager&&) = default;
  KvCacheManager& operator=(KvCacheManager&&) = default;

  const KvCacheOptions& options() const { return options_; }
  int64_t sliding_window() const { return window_; }

  // ----- pools
  bool has_pool(CacheKind kind, int layer) const;
  // Throws naming the layer when it has no pool of that kind.
  const PagePool& pool(CacheKind kind, int layer) const;
  // Tokens per row of a pool: 1 for window pools, the compress ratio otherwise.
  int64_t tokens_per_row(CacheKind kind, int layer) const;
  // Every pool, in layer order (window, compressed, index keys per layer).
  std::vector<const PagePool*> pools() const;
  // The position of the layer's pool of `kind` in pools(); throws naming the layer when it has none.
  int pool_index(CacheKind kind, int layer) const;

  // ----- sequences
  void add_sequence(SequenceId id);
  // `child` starts with all of `parent`'s committed state: its pages are shared (reference counts),
  // its compressor state is copied. Nothing is allocated but a sequence slot.
  void fork_sequence(SequenceId parent, SequenceId child);
  // Returns every page reference and the sequence slot.
  void release_sequence(SequenceId id);
  bool has_sequence(SequenceId id) const { return sequences_.count(id) != 0; }
  std::vector<SequenceId> sequences() const;
  int64_t sequence_length(SequenceId id) const;
  // Bytes the sequence holds: every page in its block tables (a page shared with another sequence
  // counts for each holder) plus its compressor state.
  int64_t sequence_bytes(SequenceId id) const;

  // ----- steps
  // Makes every page the step writes present and exclusively owned, in every pool, for every
  // entry: new pages for rows past the held ones and a copy of each shared page the step writes
  // into (copy-on-write). All-or-nothing: when a pool lacks pages it throws naming the pool and
  // the request, and nothing changed. Reserving again before commit() allocates nothing new.
  // Returns the page copies it made, in the order it made them (bytes already copied on the host).
  std::vector<PageCopy> reserve(const std::vector<CacheStepEntry>& step);
  // Slots of every step token for `layer` (see LayerStepSlots); the step must be reserved.
  LayerStepSlots step_slots(const std::vector<CacheStepEntry>& step, int layer) const;
  // Advances the sequence to `new_length` (>= its length, within what is reserved) and returns the
  // window pages wholly before `new_length - sliding_window - rollback_rows` to their pools.
  void commit(SequenceId id, int64_t new_length);
  // Shrinks the sequence to `new_length` (<= its length, and its window's first row still kept) and
  // returns the pages wholly past its rows to their pools; rows keep their slots.
  void rollback(SequenceId id, int64_t new_length);

  // ----- rows (row = position for window pools, entry index for compressed / index-key pools)
  // First row kept: max(0, length - sliding_window - rollback_rows) for window pools, 0 otherwise.
  int64_t first_readable_row(SequenceId id, CacheKind kind, int layer) const;
  // Rows that hold pages (readable or reserved): rows < held_rows are addressable.
  int64_t held_rows(SequenceId id, CacheKind kind, int layer) const;
  // The slot of a row that has a page and has not left the window (written or not).
  int64_t slot(SequenceId id, CacheKind kind, int layer, int64_t row) const;
  // Stores rows [first_row, first_row + n) (x: [n, dims] fp32). The rows must be past the
  // committed ones and reserved; a page still shared (forked after reserve) is copied first.
  void write_rows(SequenceId id, CacheKind kind, int layer, int64_t first_row, int64_t n,
                  const float* x);
  // Loads rows [first_row, first_row + n) into out [n, dims]: every row must be readable (not
  // left the window) and written.
  void read_rows(SequenceId id, CacheKind kind, int layer, int64_t first_row, int64_t n,
                 float* out) const;
  BlockTableView block_table(SequenceId id, CacheKind kind, int layer) const;

  // ----- change tracking, for a device mirror of the block tables kept by sequence slot
  struct TableChange {
    int pool = 0;      // index into pools()
    int64_t slot = 0;  // sequence slot
  };
  // The tables changed since the last call (pages added, dropped or copied on write; sequences
  // added, forked, rolled back or released), each listed once; clears the list. Its length is what
  // changed, not the number of sequences or pages held.
  std::vector<TableChange> take_table_changes();
  // Pool `pool`'s table of the sequence in `slot`; empty when the slot is free.
  BlockTableView slot_block_table(int pool, int64_t slot) const;
  // Kernel-style access by slot (e.g. LayerStepSlots): the pool's write_rows / read_rows, so a
  // written slot must be on an exclusively owned page and a read slot must have been written.
  void write_slots(CacheKind kind, int layer, const int64_t* slots, int64_t n, const float* x);
  void read_slots(CacheKind kind, int layer, const int64_t* slots, int64_t n, float* out) const;

  // ----- compressor partial-group state (fp32, zeroed by add_sequence, copied by fork_sequence;
  //       without host storage only its size and the sequence slots remain)
  int64_t compressor_state_floats(int layer) const;
  std::span<float> compressor_state(SequenceId id, int layer);
  std::span<const float> compressor_state(SequenceId id, int layer) const;
  // The sequence's slot: its state lives at [slot * floats, (slot + 1) * floats) of the layer's slab.
  int64_t sequence_slot(SequenceId id) const;
  std::span<const float> compressor_state_slab(int layer) const;

 private:
  struct CachePool {
    CacheKind kind;
    int layer;
    int64_t tokens_per_row;  // 1 (window) or the compress ratio
    PagePool pages;
  };
  struct BlockTable {
    int64_t first_logical_page = 0;
    std::vector<int64_t> pages;
  };
  struct Sequence {
    int64_t length = 0;
    int64_t slot = -1;
    std::vector<BlockTable> tables;  // one per pool, indexed like pools_
  };

  Sequence& sequence(const char* operation, SequenceId id);
  const Sequence& sequence(const char* operation, SequenceId id) const;
  int64_t rows_at(const CachePool& p, int64_t tokens) const { return tokens / p.tokens_per_row; }
  int64_t first_kept_row(const CachePool& p, int64_t length) const;
  int64_t held_rows(const CachePool& p, const BlockTable& t) const;
  std::string row_name(const CachePool& p, SequenceId id, int64_t row) const;
  // The slot of a row of pool `pool` that has a page and has not left the window.
  int64_t checked_slot(size_t pool, SequenceId id, const Sequence& s, int64_t row) const;
  int64_t state_offset(SequenceId id, int layer) const;
  void check_host_state(const char* operation) const;
  int64_t take_sequence_slot(const char* operation, SequenceId id);
  void release_pages(Sequence& s);
  void table_changed(size_t pool, const Sequence& s);
  void all_tables_changed(const Sequence& s);

  KvCacheOptions options_;
  int64_t window_;
  std::vector<CachePool> pools_;
  std::vector<std::array<int, 3>> pool_of_layer_;  // [layer][kind] -> index in pools_, -1 if none
  std::map<SequenceId, Sequence> sequences_;
  std::vector<int64_t> free_slots_;                 // stack of sequence slots
  std::vector<const Sequence*> slot_sequence_;      // per slot: its sequence (map nodes stay put), or null
  std::vector<TableChange> table_changes_;
  std::vector<uint8_t> table_change_listed_;        // [pools, max_sequences]
  std::vector<std::vector<float>> state_slabs_;     // per layer: max_sequences * floats
};

}  // namespace dsv4

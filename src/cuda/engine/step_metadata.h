// The CUDA engine's per-step metadata: at begin_step the step's layout and the cache manager's
// block tables and slots are packed into one staging buffer and uploaded with a single copy
// (StepUpload); the layer pipeline reads them through the views below until the next step.
#pragma once

#include <cstdint>
#include <vector>

#include "common/step_layout.h"
#include "cuda/engine/device_caches.h"
#include "cuda/engine/step_upload.h"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

// What one layer reads and writes in a step.
struct LayerStep {
  PagedCache window, compressed, index_keys;                   // compressed / index_keys: kv sources only
  TensorView window_slots, compressed_slots, index_key_slots;  // [step tokens] i64
  // kv sources: the entries the step's index scores and entry lists span: the longest compressed
  // cache of the step's sequences after it, rounded up (entries_bucket) so that steps of a growing
  // context share it.
  int64_t entries = 0;
  // Whether the layer's attention reads its window's and kv source's pages staged to bf16 in this
  // step (StepMetadata::staged_pool).
  bool stages_attention = false;
};

// When a step's attention reads staged pages (EngineOptions::attention_stage_bytes).
struct AttentionStaging {
  int64_t bytes = 0;          // room for one layer's staged pages; 0: never stage
  int64_t max_sequences = 0;  // sequences a step holds at most
  int64_t window = 0;         // the sliding window (rows a token attends in its layer's window)
  int64_t index_topk = 0;     // the picks a token of a layer with an index source attends
};

// The pools a layer's attention reads (KvCacheManager::pool_index): its window pool and its kv
// source's compressed pool.
struct AttendedPools {
  int layer = 0;
  int window = 0;
  int compressed = -1;  // -1: the layer has no kv source
};

// Bytes `pages` pages of a pool of `geometry` take staged to bf16 pages in the staging buffer, where
// a layer's window pages come first and its kv source's follow, each part aligned.
size_t staged_pages_bytes(const PageGeometry& geometry, int64_t pages);

// A pool's pages staged for a step: the step's sequences in order, each a StagedRun.
struct StagedPool {
  TensorView runs;    // [step sequences, 3] i32: StagedRun per sequence
  int64_t pages = 0;  // staged pages the runs take together
};

// Every array of a step sits at an address fixed at create: the tokens' arrays and slots in
// buffers of max_tokens, the block tables in DeviceCaches' mirrors by sequence slot. What changes
// from step to step is only the data (uploaded at begin_step) and the scalars graph_key() covers,
// so the kernels a step launches are the same for every step of the same key.
class StepMetadata {
 public:
  // Capacity for steps of at most max_tokens tokens, each sequence at most max_context long.
  StepMetadata(const ModelTopology& topology, const DeviceCaches& caches, int64_t max_tokens, int64_t max_context,
               const AttentionStaging& staging);

  // Uploads `step` (reserved in `caches`) on `stream`: the tokens' arrays, the block tables that
  // changed, then the slots every pool's tokens write (computed on the device).
  void pack(const StepLayout& step, const ModelTopology& topology, DeviceCaches& caches, cudaStream_t stream);

  int64_t tokens() const { return tokens_; }
  // [step tokens] i32: the token's sequence slot (the row of every block table and compressor
  // ring) and its position.
  const TensorView& token_sequence() const { return token_sequence_; }
  const TensorView& token_position() const { return token_position_; }
  const TensorView& state_slot() const { return token_sequence_; }
  // [step tokens] i32 when the step has image spans (StepLayout::windows), else absent: the first
  // and last window position each token attends; and the most window rows a token has then.
  const TensorView& window_first() const { return window_first_; }
  const TensorView& window_last() const { return window_last_; }
  int64_t max_window_rows() const { return max_window_rows_; }
  const LayerStep& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  // Steps whose attention stages pages: [step tokens] i32, the token's step entry (the row of the
  // staged block tables); the step's entries; pool `pool`'s (KvCacheManager::pool_index) runs, for
  // the pools of the layers that stage.
  const TensorView& step_sequence() const { return step_sequence_; }
  int64_t sequences() const { return sequences_; }
  const StagedPool& staged_pool(int pool) const { return staged_pools_[static_cast<size_t>(pool)]; }
  // Whether a step may stage pool `pool`; the staging as the steps apply it (its budget at most what
  // one layer can stage).
  bool stageable(int pool) const { return stageable_pools_[static_cast<size_t>(pool)]; }
  const AttentionStaging& staging() const { return staging_; }
  // Equal for two steps exactly when their kernels' arguments are equal: the token count, every
  // kv source's entries, the image-span window bound, the staged pages.
  uint64_t graph_key() const { return graph_key_; }
  size_t device_bytes() const { return upload_.capacity() + slots_.bytes() + slot_pointers_.bytes(); }

 private:
  // Decides which layers stage their attention's pages in `step` and appends the runs of their
  // pools (after the tokens' arrays, each pool's at its fixed offset).
  void pack_staging(const StepLayout& step, const ModelTopology& topology, const DeviceCaches& caches);

  int64_t max_tokens_ = 0, max_context_ = 0;
  // The layers whose attention a step runs (not the draft layers': their attention is
  // run_draft_block's), in layer order, with their pools; staging_ and stageable_pools_ use it.
  std::vector<AttendedPools> attended_;
  AttentionStaging staging_;
  std::vector<bool> stageable_pools_;  // by pool index: a window or compressed pool an attention reads
  TensorView step_sequence_;
  int64_t sequences_ = 0;
  std::vector<StagedPool> staged_pools_;
  uint64_t staging_key_ = 0;  // the staging's part of graph_key_
  StepUpload upload_;     // the tokens' arrays, at fixed offsets
  DeviceBuffer slots_;    // [pools, max_tokens] i64
  DeviceBuffer slot_pointers_;  // [pools] i64*: the rows of slots_
  int64_t tokens_ = 0;
  TensorView token_sequence_, token_position_, window_first_, window_last_;
  int64_t max_window_rows_ = 0;
  uint64_t graph_key_ = 0;
  std::vector<LayerStep> layers_;
};

// The metadata of one DSpark draft block call (run_draft_block, outside a step): blocks of B rows,
// one per sequence, block b's row j at position length_b + j, attending the draft layer's
// committed window rows up to p0 = length_b - 1 and the B rows of its block (SPEC §13.1). Packed
// and uploaded per call, like a step's metadata, through a staging buffer of its own.
class DraftBlockMetadata {
 public:
  // Capacity for calls of at most max_tokens rows of at most max_sequences sequences over any
  // draft layer of `topology`.
  DraftBlockMetadata(const ModelTopology& topology, const DeviceCaches& caches, int64_t max_tokens,
                     int64_t max_sequences, int64_t block_size);

  // Packs the blocks of `sequences` (committed lengths `lengths`, each >= 1) for draft layer
  // `layer` and queues the upload on `stream` (waiting until the previous call's upload has left
  // the staging buffer).
  void pack(int layer, const std::vector<SequenceId>& sequences, const std::vector<int64_t>& lengths,
            int64_t block_size, const DeviceCaches& caches, cudaStream_t stream);

  int64_t tokens() const { return tokens_; }
  // [tokens] i32: the token's block (= row of the window's block table), its position, and the
  // last window row it attends (its block's p0).
  const TensorView& token_sequence() const { return token_sequence_; }
  const TensorView& token_position() const { return token_position_; }
  const TensorView& window_last() const { return window_last_; }
  // [tokens, B] i32: the rows of the token's block, b·B … b·B + B − 1, which are the slots of the
  // block's keys in the workspace's flat block-key cache.
  const TensorView& block_rows() const { return block_rows_; }
  // [tokens] i64: the token's own slot there (t), where its key is inserted.
  const TensorView& block_slot() const { return block_slot_; }
  // The draft layer's window pool with the blocks' sequences' tables.
  const PagedCache& window() const { return window_; }
  size_t device_bytes() const { return upload_.capacity(); }

 private:
  StepUpload upload_;
  int64_t tokens_ = 0;
  TensorView token_sequence_, token_position_, window_last_, block_rows_, block_slot_;
  PagedCache window_;
};

}  // namespace dsv4::cuda

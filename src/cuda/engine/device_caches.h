// The KV caches of the CUDA engine: a KvCacheManager does the page bookkeeping (allocation, block
// tables, slots, fork sharing, copy-on-write, all-or-nothing reserve) and this class keeps the
// pool bytes on the device, one arena per pool with the manager's page geometry, the compressor
// rings (the projected rows of still-open groups) of every sequence slot, and a mirror of every
// block table by sequence slot, updated with what changed (block_tables.h). Every device change the manager's
// bookkeeping implies (a page copied on write, a state zeroed or copied) is queued on the
// engine's stream, so it is ordered with the kernels that read and write the pages.
//
// The manager runs without host storage: it keeps no pool bytes and no compressor state.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "cuda/engine/block_tables.h"
#include "cuda/engine/step_upload.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/kv_cache.h"

namespace dsv4::cuda {

class DeviceCaches {
 public:
  // Allocates every arena and compressor ring (zeroed). `ring_floats[layer]` lists the floats per
  // sequence of each compressor ring of the layer (empty for layers without a compressor); the
  // manager accounts their sum as the layer's compressor state.
  // Tables are sized for sequences of at most max_context tokens growing by at most
  // max_step_tokens per step.
  DeviceCaches(const ModelConfig& config, const ModelTopology& topology, KvCacheOptions options,
               const std::vector<std::vector<int64_t>>& ring_floats, int64_t max_context, int64_t max_step_tokens,
               cudaStream_t stream);

  const KvCacheManager& manager() const { return manager_; }

  void add_sequence(SequenceId id);
  void fork_sequence(SequenceId parent, SequenceId child);
  void release_sequence(SequenceId id);
  // KvCacheManager::reserve, then the device copies of the pages it copied on write.
  void reserve(const std::vector<CacheStepEntry>& step);
  void commit(SequenceId id, int64_t new_length) { manager_.commit(id, new_length); }
  // The rows stay where they are on the device (position-addressed): only the pages change hands.
  void rollback(SequenceId id, int64_t new_length) { manager_.rollback(id, new_length); }

  bool has_pool(CacheKind kind, int layer) const { return manager_.has_pool(kind, layer); }
  // The pool's device arena [num_pages, page_stride] u8 and its geometry.
  TensorView pages(CacheKind kind, int layer) const;
  // The pool as kernels read it: its arena and the mirror of its block tables, rows by sequence
  // slot (block_table [max_sequences, width] i32, first_logical_page [max_sequences] i32). The
  // views stay the same for the engine's lifetime.
  PagedCache paged(CacheKind kind, int layer) const;
  // Queues on the stream the upload of every block table changed since the last call. Host work
  // and bytes are proportional to the changed tables.
  void upload_table_changes();
  // The mirrors of every pool, in KvCacheManager::pools() order: on the host, and the same array
  // on the device.
  const std::vector<DevicePoolTable>& pool_tables() const { return pool_tables_; }
  const DevicePoolTable* device_pool_tables() const { return static_cast<const DevicePoolTable*>(pool_table_array_.data()); }
  const PageGeometry& geometry(CacheKind kind, int layer) const { return manager_.pool(kind, layer).geometry(); }
  // Ring `ring` of the layer's compressors: [max_sequences, ring_rows, row_width] f32, indexed by
  // KvCacheManager::sequence_slot; ring_rows · row_width must be the ring's floats per sequence.
  TensorView compressor_ring(int layer, int ring, int64_t ring_rows, int64_t row_width) const;

  // Device bytes of all arenas and state slabs.
  int64_t device_bytes() const;

 private:
  struct Arena {
    CacheKind kind;
    int layer;
    DeviceBuffer bytes;
  };
  const Arena& arena(CacheKind kind, int layer) const;

  KvCacheManager manager_;
  cudaStream_t stream_;
  std::vector<Arena> arenas_;
  std::vector<std::array<int, 3>> arena_of_layer_;  // [layer][kind] -> index in arenas_, -1 if none
  struct Ring {
    int64_t floats = 0;  // per sequence
    DeviceBuffer slab;   // [max_sequences, floats]
  };
  std::vector<std::vector<Ring>> rings_;            // per layer
  DeviceBuffer tables_;                             // every pool's mirror
  std::vector<DevicePoolTable> pool_tables_;        // per pool
  DeviceBuffer pool_table_array_;                   // pool_tables_ on the device
  StepUpload table_upload_;                         // staging of the changed tables
};

}  // namespace dsv4::cuda

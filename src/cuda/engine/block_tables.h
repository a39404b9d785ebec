// The device mirror of the cache manager's block tables, kept by sequence slot so that kernels
// find a sequence's pages at the same address every step (a step graph replays), and the kernels
// that update it: the tables a step changed (KvCacheManager::take_table_changes) and the slots
// the step's tokens write, computed on the device from the tables and the tokens' positions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dsv4::cuda {

// One pool's mirror, as the kernels see it.
struct DevicePoolTable {
  int32_t* table = nullptr;  // [max_sequences, width] physical pages, -1 padded
  int32_t* first = nullptr;  // [max_sequences] first logical page of each table
  int32_t width = 0;         // pages a table holds at most
  int32_t rows_per_page = 0;
  int32_t tokens_per_row = 1;  // 1: window rows (row = position); r: compressed rows (row = entry)
};

// A changed table: pool `pool`'s row `slot` becomes pages [offset, offset + count) of the
// change's page list, logical pages from `first`.
struct TableChangeRecord {
  int32_t pool;
  int32_t slot;
  int32_t first;
  int32_t count;
  int32_t offset;
  int32_t unused;
};

// Applies `n` records (device memory) to the pools' mirrors `pools` [pools] (device memory).
void launch_apply_table_changes(const TableChangeRecord* records, int64_t n, const int32_t* pages,
                                const DevicePoolTable* pools, cudaStream_t stream);

// slots[p][t] for every pool p < n_pools and token t < tokens: the slot token t writes in pool p
// (window: its position's row; compressed: the entry of the group it closes, else -1), from the
// token's sequence slot and position. slots: [n_pools] device pointers to [tokens] i64 each.
void launch_step_slots(const DevicePoolTable* pools, int64_t* const* slots, int n_pools, const int32_t* token_slot,
                       const int32_t* token_position, int64_t tokens, cudaStream_t stream);

// One sequence's pages of a pool in a step whose attention reads staged pages (StepMetadata):
// staged pages first … first + pages - 1 hold the pool's pages of table row `slot`, in order.
struct StagedRun {
  int32_t slot;
  int32_t first;
  int32_t pages;  // <= the pool's table width
};

// A pool's pages staged for the step's `n_runs` sequences (runs: device memory), which take
// staged pages 0 … P - 1 together: source_pages [P] gets the pool page each staged page is decoded
// from (-1 where the table has no page of the pool's `pool_pages`), staged_table [n_runs,
// pool.width] the staged page of each table entry (-1 where it has none) and staged_first
// [n_runs] the first logical page of each row: the block table of the staged pages, whose rows
// are the sequences' indices among the runs.
void launch_staged_pages(const DevicePoolTable& pool, int64_t pool_pages, const StagedRun* runs, int64_t n_runs,
                         int32_t* source_pages, int32_t* staged_table, int32_t* staged_first, cudaStream_t stream);

}  // namespace dsv4::cuda

#include "cuda/engine/block_tables.h"
#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void apply_table_changes_kernel(const TableChangeRecord* records, const int32_t* pages,
                                           const DevicePoolTable* pools) {
  const TableChangeRecord r = records[blockIdx.x];
  const DevicePoolTable p = pools[r.pool];
  int32_t* row = p.table + int64_t{r.slot} * p.width;
  for (int i = threadIdx.x; i < p.width; i += blockDim.x) row[i] = i < r.count ? pages[r.offset + i] : -1;
  if (threadIdx.x == 0) p.first[r.slot] = r.first;
}

__global__ void step_slots_kernel(const DevicePoolTable* pools, int64_t* const* slots, const int32_t* token_slot,
                                  const int32_t* token_position, int64_t tokens) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= tokens) return;
  const DevicePoolTable p = pools[blockIdx.y];
  const int64_t position = token_position[t], s = token_slot[t];
  int64_t slot = -1;
  // A compressed pool's row is the group the token closes, if it closes one.
  if ((position + 1) % p.tokens_per_row == 0) {
    const int64_t row = p.tokens_per_row == 1 ? position : (position + 1) / p.tokens_per_row - 1;
    const int64_t k = row / p.rows_per_page - p.first[s];
    const int64_t page = k >= 0 && k < p.width ? p.table[s * p.width + k] : -1;
    if (page >= 0) slot = page * p.rows_per_page + row % p.rows_per_page;
  }
  slots[blockIdx.y][t] = slot;
}

// A thread per entry (i / width, i % width) of the staged table.
__global__ void staged_pages_kernel(DevicePoolTable pool, int64_t pool_pages, const StagedRun* runs, int64_t n_runs,
                                    int32_t* source_pages, int32_t* staged_table, int32_t* staged_first) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= n_runs * pool.width) return;
  const int64_t run = i / pool.width, j = i % pool.width;
  const StagedRun r = runs[run];
  int32_t staged = -1;
  if (j < r.pages) {
    const int32_t page = pool.table[int64_t{r.slot} * pool.width + j];
    const bool valid = page >= 0 && page < pool_pages;
    staged = valid ? r.first + static_cast<int32_t>(j) : -1;
    source_pages[r.first + j] = valid ? page : -1;
  }
  staged_table[i] = staged;
  if (j == 0) staged_first[run] = pool.first[r.slot];
}

}  // namespace

void launch_staged_pages(const DevicePoolTable& pool, int64_t pool_pages, const StagedRun* runs, int64_t n_runs,
                         int32_t* source_pages, int32_t* staged_table, int32_t* staged_first, cudaStream_t stream) {
  const int64_t entries = n_runs * pool.width;
  if (entries == 0) return;
  staged_pages_kernel<<<static_cast<unsigned>((entries + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      pool, pool_pages, runs, n_runs, source_pages, staged_table, staged_first);
  check_launch("staged_pages");
}

void launch_apply_table_changes(const TableChangeRecord* records, int64_t n, const int32_t* pages,
                                const DevicePoolTable* pools, cudaStream_t stream) {
  if (n == 0) return;
  apply_table_changes_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(records, pages, pools);
  check_launch("apply_table_changes");
}

void launch_step_slots(const DevicePoolTable* pools, int64_t* const* slots, int n_pools, const int32_t* token_slot,
                       const int32_t* token_position, int64_t tokens, cudaStream_t stream) {
  if (tokens == 0 || n_pools == 0) return;
  const dim3 grid(static_cast<unsigned>((tokens + kThreads - 1) / kThreads), static_cast<unsigned>(n_pools));
  step_slots_kernel<<<grid, kThreads, 0, stream>>>(pools, slots, token_slot, token_position, tokens);
  check_launch("step_slots");
}

}  // namespace dsv4::cuda

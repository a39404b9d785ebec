// What the commands that drive an Engine need around it: which backend can run here, and f32 rows
// on the engine's device staged from and to host memory.
#pragma once

#include <cstdint>
#include <string>

#include "dsv4/engine.h"
#include "dsv4/tensor.h"

namespace dsv4::cli {

// Whether this binary was built with the CUDA backend (DSV4_WITH_CUDA).
bool built_with_cuda();

// Whether this binary has the CUDA backend, a CUDA device is present and an engine can be created
// on it. When not, `why` says which of the three is missing.
bool cuda_backend_usable(std::string* why);

// `requested` when it can run here; otherwise cpu, after a note on stderr that names `command`
// and the reason.
Backend usable_backend(Backend requested, const std::string& command);

// The --kv-format flag of the commands: "float" keeps float rows (CacheStorage::float_rows, cpu
// only), any other value pages in that kv_format_set ("" : default_kv_formats).
void apply_kv_format_flag(EngineOptions& options, const std::string& flag);
// How `options` stores the caches, for the commands' summaries: "float" or the set's name.
std::string cache_storage_label(const EngineOptions& options);

// Waits until the work the engine queued has finished (its stream; nothing to wait for on the CPU).
void wait_for_engine(const Engine& engine);

// Bytes of memory in use on the current GPU (all allocations, as cudaMemGetInfo sees them); 0 for
// the cpu backend.
int64_t device_memory_in_use(Backend backend);

// Diagnostics: every device buffer allocated from now on is filled with `byte` first (a binary
// without CUDA has none to fill). Two runs with different bytes agree unless something reads
// device memory that nothing wrote.
void fill_device_allocations(uint8_t byte);

// f32 [capacity_rows, cols] on the device of `engine` (host memory for the cpu backend); copies
// are ordered on the engine's stream.
class DeviceRows {
 public:
  DeviceRows(const Engine& engine, int64_t capacity_rows, int64_t cols);
  ~DeviceRows();
  DeviceRows(const DeviceRows&) = delete;
  DeviceRows& operator=(const DeviceRows&) = delete;

  // [rows, cols] view of the first `rows` rows.
  TensorView view(int64_t rows) const;
  // Both are queued on the engine's stream after the work it already holds, and finished on return.
  void upload(const float* host, int64_t rows);
  // Copies the first `rows` rows to `host`.
  void download(float* host, int64_t rows) const;
  // Rows [source_row, source_row + rows) of `source`, all its columns, into rows [row, row + rows)
  // at columns [col, col + source columns) of these; queued on the engine's stream, not waited
  // for (host rows: copied at once).
  void copy_rows_from(const DeviceRows& source, int64_t source_row, int64_t row, int64_t rows, int64_t col = 0);
  // The engine's stream (nullptr: host rows).
  CUstream_st* stream() const { return stream_; }

 private:
  void check_rows(int64_t rows, const char* what) const;
  CUstream_st* stream_;  // nullptr: host rows
  int64_t capacity_rows_;
  int64_t cols_;
  int device_index_ = 0;
  float* data_ = nullptr;
};

}  // namespace dsv4::cli

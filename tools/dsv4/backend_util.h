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

// Waits until work queued on the backend's device has finished (nothing to wait for on the CPU).
void wait_for_device(Backend backend);

// Bytes of memory in use on the current GPU (all allocations, as cudaMemGetInfo sees them); 0 for
// the cpu backend.
int64_t device_memory_in_use(Backend backend);

// Diagnostics: every device buffer allocated from now on is filled with `byte` first (a binary
// without CUDA has none to fill). Two runs with different bytes agree unless something reads
// device memory that nothing wrote.
void fill_device_allocations(uint8_t byte);

// f32 [capacity_rows, cols] on the backend's device.
class DeviceRows {
 public:
  DeviceRows(Backend backend, int64_t capacity_rows, int64_t cols);
  ~DeviceRows();
  DeviceRows(const DeviceRows&) = delete;
  DeviceRows& operator=(const DeviceRows&) = delete;

  // [rows, cols] view of the first `rows` rows.
  TensorView view(int64_t rows) const;
  // Both wait for the device first, so that rows the engine still reads or writes are safe.
  void upload(const float* host, int64_t rows);
  // Copies the first `rows` rows to `host`.
  void download(float* host, int64_t rows) const;

 private:
  void check_rows(int64_t rows, const char* what) const;
  Backend backend_;
  int64_t capacity_rows_;
  int64_t cols_;
  int device_index_ = 0;
  float* data_ = nullptr;
};

}  // namespace dsv4::cli

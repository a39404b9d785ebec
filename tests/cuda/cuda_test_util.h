// Shared helpers of the CUDA kernel tests: a fixture that skips without a device, tolerance checks,
// graph capture, host-built paged caches; random inputs and device tensors come from
// bench/device_inputs.h (shared with the benchmarks).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/device_inputs.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"
#include "dsv4/tensor.h"
#include "test_util.h"

namespace dsv4::cuda::testing {

// Tests that launch kernels derive from this; without a device they are skipped.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Holds up the default stream for `duration` (a host function that sleeps there): what is queued
// on it afterwards runs late, as when another process holds the GPU, while work on non-blocking
// streams (the engines') goes on. Catches work on the default stream that nothing orders with them.
inline void hold_default_stream(std::chrono::milliseconds duration) {
  DSV4_CUDA_CHECK(cudaLaunchHostFunc(
      nullptr,
      [](void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms))); },
      reinterpret_cast<void*>(static_cast<intptr_t>(duration.count()))));
}

// Random values, host and device tensors, poisoned outputs, downloads: shared with the benchmarks.
using inputs::device_array;
using inputs::device_tensor;
using inputs::DeviceTensor;
using inputs::download_as;
using inputs::download_floats;
using inputs::host_tensor;
using inputs::poisoned_tensor;
using inputs::random_floats;
using inputs::to_floats;

inline std::vector<float> rounded_to_bf16(std::vector<float> v) {
  for (float& x : v) x = round_to_bf16(x);
  return v;
}

// Every actual[i] must equal expected[i] (infinities included) or be finite and within
// atol + rtol·|expected[i]| (+ extra[i] when `extra` is given); reports the worst element. Prints the measured error ("measured
// <what>: ...": the largest |Δ|, the largest |Δ| / |expected| and the largest fraction of the
// bound used) and records it as a test property, so that one GPU run gives the numbers the bounds
// are set from (docs/testing.md).
inline void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, float atol, float rtol,
                         const std::string& what, std::span<const float> extra = {}) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  ASSERT_TRUE(extra.empty() || extra.size() == expected.size()) << what;
  size_t worst = 0, failures = 0, differing = 0;
  double worst_excess = -1.0, max_abs = 0.0, max_rel = 0.0, max_used = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] == expected[i]) continue;
    const double bound = atol + rtol * std::fabs(expected[i]) + (extra.empty() ? 0.0 : extra[i]);
    const double err = std::fabs(static_cast<double>(actual[i]) - expected[i]);
    ++differing;
    max_abs = std::max(max_abs, err);
    if (expected[i] != 0.0f) max_rel = std::max(max_rel, err / std::fabs(expected[i]));
    if (bound > 0.0) max_used = std::max(max_used, err / bound);
    const bool bad = !std::isfinite(actual[i]) || !(err <= bound);
    if (bad) ++failures;
    const double excess = bad ? (std::isfinite(err) ? err - bound + 1e-30 : 1e30) : err - bound;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  char line[256];
  std::snprintf(line, sizeof line, "max |d| %.3g, max |d|/|expected| %.3g, %.3g of the bound, %zu of %zu differ (atol %.3g, rtol %.3g)",
                max_abs, max_rel, max_used, differing, actual.size(), static_cast<double>(atol), static_cast<double>(rtol));
  std::cout << "measured " << what << ": " << line << "\n";
  std::string key = "measured_" + what;
  for (char& ch : key)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  ::testing::Test::RecordProperty(key, line);
  EXPECT_EQ(failures, 0u) << what << ": " << failures << " of " << actual.size() << " elements outside atol " << atol
                          << " + rtol " << rtol << "; worst at " << worst << ": got " << actual[worst] << ", expected "
                          << expected[worst];
}

// Validation tests catch the expected dsv4::Error's message with test::error_of (test_util.h).
using test::error_of;

// Tests whose ops project through cuBLASLt: the handle is made only where a device is.
class BlasCudaTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (!IsSkipped()) blas_.emplace();
  }
  std::optional<BlasLt> blas_;
};

// Runs `step(stream)` once as a captured and instantiated CUDA graph, and waits for it.
template <class Step>
void run_as_graph(Stream& stream, Step&& step) {
  cudaGraph_t graph = nullptr;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
  step(stream.get());
  DSV4_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  DSV4_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize("graph launch");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// A cuda view with a dummy (never dereferenced) pointer, for validation tests that need no device.
inline TensorView fake_device_view(DType dtype, std::vector<int64_t> shape) {
  alignas(16) static char dummy[16];  // aligned as the kernels' 16-byte copies need
  return TensorView::contiguous(dummy, dtype, shape, Device::cuda);
}

}  // namespace dsv4::cuda::testing

// ---------------------------------------------------------------------------------------------
// Paged caches built on the host with kv_format's encode_rows (the CPU implementation of the byte
// formats), then copied to the device.

namespace dsv4::cuda::testing {

struct HostPagedCache {
  PageGeometry geometry;
  int64_t num_sequences = 0, blocks_per_sequence = 0;
  std::vector<std::byte> pages;
  std::vector<int32_t> block_table;          // [num_sequences, blocks_per_sequence], -1: no page
  std::vector<int32_t> first_logical_page;   // [num_sequences]
  float tensor_scale = 1.0f;

  int64_t num_pages() const { return static_cast<int64_t>(pages.size()) / geometry.page_stride; }
  // The slot of row `row` of sequence s, or -1 when the row has no page.
  int64_t slot(int64_t s, int64_t row) const {
    const int64_t block = row / geometry.rows_per_page - first_logical_page[s];
    if (row < 0 || block < 0 || block >= blocks_per_sequence) return -1;
    const int32_t page = block_table[s * blocks_per_sequence + block];
    return page < 0 ? -1 : page * geometry.rows_per_page + row % geometry.rows_per_page;
  }
  void write(int64_t s, int64_t row, const float* x) {
    const int64_t sl = slot(s, row);
    encode_rows(geometry, x, 1, &sl, std::span<std::byte>(pages), tensor_scale);
  }
  std::vector<float> read(int64_t s, int64_t row) const {
    std::vector<float> out(static_cast<size_t>(geometry.row.dims));
    const int64_t sl = slot(s, row);
    decode_rows(geometry, std::span<const std::byte>(pages), &sl, 1, out.data(), tensor_scale);
    return out;
  }
};

// Sequence s gets `blocks` logical pages starting at first_logical_page[s], mapped to distinct
// physical pages in a shuffled order; `spare_pages` more pages stay unused.
inline HostPagedCache make_host_cache(KvRowFormat format, int64_t dims, int64_t rows_per_page, PagePlacement placement,
                                      const std::vector<int32_t>& first_logical_page, int64_t blocks,
                                      int64_t spare_pages, uint32_t seed) {
  HostPagedCache c;
  c.geometry = page_geometry(format, dims, rows_per_page, placement);
  c.num_sequences = static_cast<int64_t>(first_logical_page.size());
  c.blocks_per_sequence = blocks;
  c.first_logical_page = first_logical_page;
  const int64_t num_pages = c.num_sequences * blocks + spare_pages;
  c.pages.assign(static_cast<size_t>(num_pages * c.geometry.page_stride), std::byte{0});
  std::vector<int32_t> ids(static_cast<size_t>(num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
  c.block_table.assign(ids.begin(), ids.begin() + c.num_sequences * blocks);
  return c;
}

// The device copy of a host cache and the PagedCache view of it.
struct DevicePagedCache {
  DeviceTensor pages, block_table, first_logical_page;
  PagedCache view;
};

inline DevicePagedCache to_device_cache(const HostPagedCache& c) {
  DevicePagedCache d;
  d.pages = device_array(c.pages, DType::u8, {c.num_pages(), c.geometry.page_stride});
  d.block_table = device_array(c.block_table, DType::i32, {c.num_sequences, c.blocks_per_sequence});
  d.first_logical_page = device_array(c.first_logical_page, DType::i32, {c.num_sequences});
  d.view = PagedCache{.pages = d.pages.view, .block_table = d.block_table.view,
                      .first_logical_page = d.first_logical_page.view, .geometry = c.geometry,
                      .tensor_scale = c.tensor_scale};
  return d;
}

}  // namespace dsv4::cuda::testing

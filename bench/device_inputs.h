// Device inputs shared by the CUDA tests (tests/cuda/cuda_test_util.h) and the benchmarks
// (bench/): random values, host tensors in the kernels' dtypes, device tensors with their buffers,
// poisoned outputs and downloads, caches staged to bf16 pages. Free of gtest.
#pragma once

#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "dsv4/cuda/cache.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/error.h"
#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda::inputs {

// n values uniform in [lo, hi), the same sequence for the same seed.
inline std::vector<float> random_floats(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

inline int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// A host tensor of dtype bf16 or f32 holding `values` (bf16: rounded to nearest even).
inline HostTensor host_tensor(const std::vector<float>& values, DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  DSV4_CHECK(t.numel() == static_cast<int64_t>(values.size()), "inputs: ", values.size(), " values for a tensor of ",
             t.numel(), " elements");
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::bf16) t.as<uint16_t>()[i] = float_to_bf16_bits(values[i]);
    else t.as<float>()[i] = values[i];
  }
  return t;
}

// bf16 / f32 host tensor -> floats.
inline std::vector<float> to_floats(const HostTensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = t.dtype() == DType::bf16 ? bf16_bits_to_float(t.as<uint16_t>()[i]) : t.as<float>()[i];
  return v;
}

// A device tensor: the buffer and its view.
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};

inline DeviceTensor device_tensor(const HostTensor& host) {
  DeviceTensor d{to_device(host), {}};
  d.view = d.buffer.view(host.dtype(), host.shape());
  return d;
}

inline DeviceTensor device_tensor(const std::vector<float>& values, DType dtype, std::vector<int64_t> shape) {
  return device_tensor(host_tensor(values, dtype, std::move(shape)));
}

// A bf16 / f32 device tensor of random values in [-1, 1).
inline DeviceTensor random_device_tensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  // Counted before the shape is moved: the order in which arguments are evaluated is unspecified.
  const int64_t n = element_count(shape);
  return device_tensor(random_floats(n, seed), dtype, std::move(shape));
}

// An output tensor filled with 0xff bytes (NaN in bf16 / f32 / e4m3, -1 in integers), so that
// elements a kernel forgets to write show up.
inline DeviceTensor poisoned_tensor(DType dtype, std::vector<int64_t> shape) {
  HostTensor host(dtype, shape);
  DeviceTensor d{DeviceBuffer(host.nbytes()), {}};
  d.buffer.fill_bytes(0xff);
  d.view = d.buffer.view(dtype, std::move(shape));
  return d;
}

template <class T>
DeviceTensor device_array(const std::vector<T>& values, DType dtype, std::vector<int64_t> shape) {
  HostTensor host(dtype, std::move(shape));
  DSV4_CHECK(host.nbytes() == values.size() * sizeof(T), "inputs: ", values.size() * sizeof(T),
             " bytes for a tensor of ", host.nbytes());
  std::memcpy(host.data(), values.data(), host.nbytes());
  return device_tensor(host);
}

inline std::vector<float> download_floats(const TensorView& v) { return to_floats(to_host(v)); }

template <class T>
std::vector<T> download_as(const TensorView& v) {
  const HostTensor h = to_host(v);
  std::vector<T> out(static_cast<size_t>(h.nbytes() / sizeof(T)));
  std::memcpy(out.data(), h.data(), out.size() * sizeof(T));
  return out;
}

// A cache's pages staged to bf16 pages (run_cache_stage's params: page i into staged page i, so the
// staged view keeps the source's block table), poisoned until run_cache_stage fills them.
struct StagedCache {
  DeviceTensor pages, ids;
  CacheStageParams stage;
};

inline StagedCache staged_cache(const PagedCache& source) {
  const PageGeometry g = staged_page_geometry(source.geometry);
  const int64_t n = source.pages.shape[0];
  std::vector<int32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 0);
  StagedCache st;
  st.pages = poisoned_tensor(DType::u8, {n, g.page_stride});
  st.ids = device_array(ids, DType::i32, {n});
  st.stage.source = source;
  st.stage.pages = st.ids.view;
  st.stage.staged = source;  // its block table and first logical pages, bf16 pages
  st.stage.staged.pages = st.pages.view;
  st.stage.staged.geometry = g;
  return st;
}

}  // namespace dsv4::cuda::inputs

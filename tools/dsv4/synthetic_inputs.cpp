#include "dsv4/synthetic_inputs.h"

#include <array>

#include "dsv4/error.h"

#ifdef DSV4_WITH_CUDA
#include <cuda_runtime.h>

#include "dsv4/cuda/runtime.h"
#endif

namespace dsv4::cli {
namespace {

// Host work this large is spread over threads; below it, waking the thread team (which then spins,
// taking cores from the engine) costs more than it saves.
constexpr int64_t kParallelElements = int64_t{1} << 22;

}  // namespace

void fill_token_inputs(uint64_t seed, const std::vector<TokenKey>& keys, float* rows, int64_t hidden) {
  const int64_t n = static_cast<int64_t>(keys.size());
  const UniformScale u;
#pragma omp parallel for schedule(static) if (n * hidden >= kParallelElements)
  for (int64_t r = 0; r < n; ++r) {
    const uint64_t state = token_state(seed, keys[static_cast<size_t>(r)]);
    for (int64_t h = 0; h < hidden; ++h) rows[r * hidden + h] = token_value(state, h, u);
  }
}

void chain_residual(float* hidden, const float* attn_out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    float* h = hidden + r * cols;
    const float* a = attn_out + r * cols;
    // The order of the warp reduction of the kernel: lane j sums columns j, j + 32, ...; then
    // lane i adds lane i + width for width 16, 8, 4, 2, 1 (a butterfly's lane 0).
    std::array<double, kNormLanes> lane{};
    for (int64_t c = 0; c < cols; ++c) {
      h[c] += a[c];
      lane[static_cast<size_t>(c % kNormLanes)] += static_cast<double>(h[c]) * h[c];
    }
    for (int width = kNormLanes / 2; width >= 1; width /= 2)
      for (int i = 0; i < width; ++i) lane[static_cast<size_t>(i)] += lane[static_cast<size_t>(i + width)];
    const float inv_rms = inverse_rms(lane[0], cols);
    for (int64_t c = 0; c < cols; ++c) h[c] *= inv_rms;
  }
}

TokenInputs::TokenInputs(const Engine& engine, int64_t capacity_rows)
    : stream_(engine.cuda_stream()), capacity_rows_(capacity_rows) {
  if (stream_ == nullptr) return;
#ifdef DSV4_WITH_CUDA
  DSV4_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_keys_), static_cast<size_t>(capacity_rows) * sizeof(TokenKey)));
#else
  fail("token inputs: backend cuda is not built into this binary");
#endif
}

TokenInputs::~TokenInputs() {
#ifdef DSV4_WITH_CUDA
  if (device_keys_) cudaFree(device_keys_);
#endif
}

void TokenInputs::fill(uint64_t seed, const std::vector<TokenKey>& keys, DeviceRows& rows) {
  const int64_t n = static_cast<int64_t>(keys.size());
  DSV4_CHECK(n <= capacity_rows_, "token inputs: ", n, " rows, capacity is ", capacity_rows_);
  const TensorView view = rows.view(n);
  if (stream_ == nullptr) {
    fill_token_inputs(seed, keys, view.ptr<float>(), view.shape[1]);
    return;
  }
#ifdef DSV4_WITH_CUDA
  // Waits until the keys have landed: the host vector may go after the return.
  cuda::copy_to_device(device_keys_, keys.data(), keys.size() * sizeof(TokenKey), stream_);
  launch_fill_token_inputs(seed, device_keys_, n, view.ptr<float>(), view.shape[1], stream_);
#endif
}

void chain_residual(DeviceRows& hidden, const DeviceRows& attn_out, int64_t rows) {
  const TensorView h = hidden.view(rows), a = attn_out.view(rows);
  DSV4_CHECK(h.shape[1] == a.shape[1] && h.device == a.device, "chain_residual: rows of ", h.shape[1], " and ",
             a.shape[1], " columns on ", device_name(h.device), " and ", device_name(a.device),
             ", expected the same columns on one device");
  if (h.device == Device::cpu) {
    chain_residual(h.ptr<float>(), a.ptr<float>(), rows, h.shape[1]);
    return;
  }
#ifdef DSV4_WITH_CUDA
  launch_chain_residual(h.ptr<float>(), a.ptr<float>(), rows, h.shape[1], hidden.stream());
#endif
}

int backbone_layer_count(const ModelConfig& config) {
  return config.has_dspark() ? config.num_layers : config.total_layers();
}

void keep_draft_inputs(const ModelConfig& config, int layer, const DeviceRows& inputs, int64_t rows,
                       DeviceRows& main_hidden) {
  const std::vector<int>& targets = config.dspark_target_layer_ids;
  for (size_t j = 0; j < targets.size(); ++j)
    if (targets[j] == layer) main_hidden.copy_rows_from(inputs, 0, 0, rows, static_cast<int64_t>(j) * config.hidden_size);
}

}  // namespace dsv4::cli

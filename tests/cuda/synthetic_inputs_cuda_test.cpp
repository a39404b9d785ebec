// The synthetic residual stream of `dsv4 run` and `dsv4 bench --op step` (tools/dsv4/synthetic_inputs.h):
// the kernels of the cuda backend compute the host loops' bits, so that CPU and GPU runs get the
// same layer inputs from the same layer outputs (the run's checksum and check depend on it).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "dsv4/backend_util.h"
#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/synthetic_inputs.h"
#include "dsv4/weights.h"

namespace dsv4::cli {
namespace {

using cuda::testing::CudaTest;

// A small cuda engine: the stream and device the rows live on.
std::unique_ptr<Engine> small_cuda_engine() {
  const ModelConfig config = preset_config("tiny-v4.1");
  auto weights = std::make_shared<const ModelWeights>(random_weights(config, resolve_topology(config), 0, false));
  EngineOptions options;
  options.backend = Backend::cuda;
  options.max_sequences = 1;
  options.max_tokens_per_step = 16;
  options.max_context = 16;
  return Engine::create(config, weights, options);
}

// Bit patterns, so that -0.0 / 0.0 and NaNs compare as bits.
std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> bits(v.size());
  std::memcpy(bits.data(), v.data(), v.size() * sizeof(float));
  return bits;
}

TEST_F(CudaTest, TokenInputsKernelGivesTheHostBits) {
  const std::unique_ptr<Engine> engine = small_cuda_engine();
  constexpr int64_t kHidden = 5120;
  std::vector<TokenKey> keys;
  for (int64_t i = 0; i < 37; ++i) keys.push_back({i % 5, 1000 * i + 3, i % 3});  // attempts 0 and > 0
  std::vector<float> host(keys.size() * kHidden), device(host.size());
  fill_token_inputs(7, keys, host.data(), kHidden);
  DeviceRows rows(*engine, static_cast<int64_t>(keys.size()), kHidden);
  TokenInputs inputs(*engine, static_cast<int64_t>(keys.size()));
  inputs.fill(7, keys, rows);
  rows.download(device.data(), static_cast<int64_t>(keys.size()));
  EXPECT_EQ(bits_of(device), bits_of(host));
}

TEST_F(CudaTest, ChainResidualKernelGivesTheHostBits) {
  const std::unique_ptr<Engine> engine = small_cuda_engine();
  for (const int64_t cols : {int64_t{256}, int64_t{5120}, int64_t{100}}) {  // 100: lanes with fewer columns
    constexpr int64_t kRows = 45;  // not a multiple of the 8 rows of a block
    std::vector<float> hidden = cuda::testing::random_floats(kRows * cols, 1, -1.7f, 1.7f);
    const std::vector<float> attn_out = cuda::testing::random_floats(kRows * cols, 2, -3.0f, 3.0f);
    DeviceRows device_hidden(*engine, kRows, cols), device_out(*engine, kRows, cols);
    device_hidden.upload(hidden.data(), kRows);
    device_out.upload(attn_out.data(), kRows);
    chain_residual(hidden.data(), attn_out.data(), kRows, cols);
    chain_residual(device_hidden, device_out, kRows);
    std::vector<float> device(hidden.size());
    device_hidden.download(device.data(), kRows);
    EXPECT_EQ(bits_of(device), bits_of(hidden)) << cols << " columns";
  }
}

}  // namespace
}  // namespace dsv4::cli

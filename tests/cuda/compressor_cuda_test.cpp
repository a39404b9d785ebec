// run_compressor_pool against reference::pool_compressed_entry + rms_norm over several steps, so
// that entries pool rows of earlier steps from the device ring state.
//
// Tolerance: the softmax weights use the device expf (within 2 ulp of std::exp), so pooled
// values may differ by a few fp32 ulp: bf16 latents may land on the neighbouring bf16 (rtol
// 2^-7), f32 latents within 1e-6 + 1e-5 relative. Measured on an H200: bf16 latents at most one
// bf16 ulp on 2 of 40 rows (0.34 of the bound), f32 latents |Δ| <= 2.4e-7 (0.11 of the bound; the
// absolute floor covers latents near zero). Tokens that close no group must get exact zeros, and
// the ring must hold exactly the projected rows of the latest positions.
#include <gtest/gtest.h>

#include <map>

#include "cuda/cuda_test_util.h"
#include "dsv4/cuda/compressor.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;
using testing::DeviceTensor;

struct CompressorCase {
  int ratio;
  bool overlap, gated, bias;
  int64_t dim;
  DType latent_dtype;
  float eps;
  const char* what;
};

// A step: (sequence, first position, tokens) chunks in step order.
struct Chunk {
  int sequence;
  int32_t first, tokens;
};

void check_compressor(const CompressorCase& c, uint32_t seed) {
  const CompressorGeometry g{.ratio = c.ratio, .overlap = c.overlap, .gated = c.gated, .dim = c.dim};
  const int64_t width = g.row_width(), span = g.span(), coff = c.overlap ? 2 : 1;
  const std::vector<int32_t> ring_of_sequence = {3, 0};  // sequence -> state slot
  const int64_t slots = 5;
  const std::vector<std::vector<Chunk>> steps = {
      {{0, 0, 13}, {1, 0, 7}}, {{1, 7, 1}, {0, 13, 1}}, {{0, 14, 7}, {1, 8, 2}}, {{0, 21, 19}}};
  const bool bf16 = c.latent_dtype == DType::bf16;

  const auto norm = testing::rounded_to_bf16(testing::random_floats(c.dim, seed, 0.5f, 1.5f));
  const auto bias = testing::random_floats(c.ratio * coff * c.dim, seed + 1, -1.0f, 1.0f);
  DeviceTensor dnorm = testing::device_tensor(norm, DType::bf16, {c.dim});
  DeviceTensor dbias = testing::device_tensor(bias, DType::f32, {c.ratio, coff * c.dim});
  DeviceTensor dstate = testing::poisoned_tensor(DType::f32, {slots, span, width});
  std::map<std::pair<int, int64_t>, std::vector<float>> history;  // (sequence, position) -> projected row
  Stream stream;
  uint32_t step_seed = seed + 2;
  for (const auto& step : steps) {
    std::vector<int32_t> position, slot, sequence;
    for (const Chunk& ch : step)
      for (int32_t i = 0; i < ch.tokens; ++i) {
        position.push_back(ch.first + i);
        slot.push_back(ring_of_sequence[ch.sequence]);
        sequence.push_back(ch.sequence);
      }
    const int64_t tokens = static_cast<int64_t>(position.size());
    const auto rows = testing::random_floats(tokens * width, ++step_seed, -2.0f, 2.0f);
    for (int64_t t = 0; t < tokens; ++t)
      history[{sequence[t], position[t]}] = std::vector<float>(rows.begin() + t * width, rows.begin() + (t + 1) * width);

    DeviceTensor drows = testing::device_tensor(rows, DType::f32, {tokens, width});
    DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
    DeviceTensor dslot = testing::device_array(slot, DType::i32, {tokens});
    DeviceTensor dlatent = testing::poisoned_tensor(c.latent_dtype, {tokens, c.dim});
    run_compressor_pool({.rows = drows.view, .token_position = dpos.view, .state_slot = dslot.view,
                         .state = dstate.view, .position_bias = c.bias ? dbias.view : TensorView{},
                         .norm_weight = dnorm.view, .eps = c.eps, .ratio = c.ratio, .overlap = c.overlap,
                         .gated = c.gated, .latent = dlatent.view},
                        stream.get());
    stream.synchronize("compressor test");
    const auto latent = testing::download_floats(dlatent.view);
    for (int64_t t = 0; t < tokens; ++t) {
      const std::vector<float> got(latent.begin() + t * c.dim, latent.begin() + (t + 1) * c.dim);
      std::vector<float> expected(static_cast<size_t>(c.dim), 0.0f);
      if ((position[t] + 1) % c.ratio == 0) {
        const auto row_at = [&](int64_t pos) { return history.at({sequence[t], pos}).data(); };
        std::vector<float> pooled(static_cast<size_t>(c.dim));
        reference::pool_compressed_entry(g, (position[t] + 1) / c.ratio - 1, row_at, c.bias ? bias.data() : nullptr,
                                         pooled.data());
        reference::round_bf16(pooled.data(), c.dim, bf16);
        reference::rms_norm(pooled.data(), 1, c.dim, norm.data(), c.eps, expected.data(), bf16);
      }
      testing::expect_close(got, expected, 1e-6f, bf16 ? 0x1p-7f : 1e-5f,
                            std::string(c.what) + " latent at position " + std::to_string(position[t]));
    }
  }
  // Each ring row holds the latest position mapping to it.
  const auto state = testing::download_floats(dstate.view);
  for (int s = 0; s < 2; ++s) {
    int64_t last = 0;
    for (const auto& [key, row] : history)
      if (key.first == s) last = std::max(last, key.second);
    for (int64_t q = std::max<int64_t>(0, last - span + 1); q <= last; ++q) {
      const auto& want = history.at({s, q});
      const float* got = state.data() + (ring_of_sequence[s] * span + q % span) * width;
      EXPECT_TRUE(std::equal(want.begin(), want.end(), got)) << c.what << ": ring of sequence " << s << " at " << q;
    }
  }
}

TEST_F(CudaTest, CompressorPoolMatchesReference) {
  const CompressorCase cases[] = {
      {2, false, true, false, 512, DType::bf16, 1e-20f, "V4.1 ratio 2"},
      {1, false, false, false, 512, DType::bf16, 1e-20f, "V4.1 ratio 1"},
      {4, true, true, true, 128, DType::f32, 1e-6f, "V4.0 CSA (indexer compressor)"},
      {16, false, true, true, 512, DType::bf16, 1e-6f, "V4.0 HCA"},
  };
  uint32_t seed = 1;
  for (const CompressorCase& c : cases) check_compressor(c, seed += 100);
}

TEST(CompressorCudaValidation, ReportsTheFirstBadArgument) {
  using testing::error_of;
  using testing::fake_device_view;
  const CompressorPoolParams p{.rows = fake_device_view(DType::f32, {6, 1024}),
                               .token_position = fake_device_view(DType::i32, {6}),
                               .state_slot = fake_device_view(DType::i32, {6}),
                               .state = fake_device_view(DType::f32, {4, 2, 1024}),
                               .norm_weight = fake_device_view(DType::bf16, {512}),
                               .latent = fake_device_view(DType::bf16, {6, 512})};
  EXPECT_NO_THROW(validate_compressor_pool(p));
  CompressorPoolParams bad = p;
  bad.state = fake_device_view(DType::f32, {4, 2, 512});
  EXPECT_EQ(error_of([&] { validate_compressor_pool(bad); }),
            "dsv4: compressor_pool: argument 'state' has shape [4, 2, 512], expected [4, 2, 1024]");
  bad.state = fake_device_view(DType::f32, {4, 1, 1024});
  EXPECT_EQ(error_of([&] { validate_compressor_pool(bad); }),
            "dsv4: compressor_pool: argument 'state' has 1 rows per sequence, expected at least the span 2");
  // A ring longer than the span (rows kept for rollbacks) is fine.
  bad.state = fake_device_view(DType::f32, {4, 7, 1024});
  EXPECT_NO_THROW(validate_compressor_pool(bad));
  bad = p;
  bad.rows = fake_device_view(DType::f32, {6, 512});
  EXPECT_EQ(error_of([&] { validate_compressor_pool(bad); }),
            "dsv4: compressor_pool: argument 'rows' has shape [6, 512], expected [6, 1024]");
  bad = p;
  bad.gated = false;
  EXPECT_EQ(error_of([&] { validate_compressor_pool(bad); }),
            "dsv4: compressor_pool: an ungated compressor has ratio 1 without overlap, got ratio 2");
}

}  // namespace
}  // namespace dsv4::cuda

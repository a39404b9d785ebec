// The run_* functions are CUDA-graph capturable (no allocation, no synchronization): a V4.1 layer
// step's op sequence — q RoPE, window insert, compressor pooling, compressed and index-key
// inserts, index scores, candidate blocks, top-k, sparse attention, output projection — is
// captured into one graph, replayed, and must reproduce the eagerly run results bit for bit.
#include <gtest/gtest.h>


#include "cuda/cuda_test_util.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/compressor.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/output.h"
#include "dsv4/cuda/qkv.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

using testing::DeviceTensor;

constexpr int64_t kTokens = 12, kHeads = 8, kDim = 512, kIndexHeads = 4, kIndexDim = 128, kRatio = 2;
constexpr int64_t kEntries = 8, kTopk = 4, kGroups = 2, kRank = 32, kRopeDim = 64;

using GraphCudaTest = testing::BlasCudaTest;

TEST_F(GraphCudaTest, LayerStepReplaysBitForBit) {
  const RopeParams rope{.theta = 160000.0, .yarn = true, .factor = 16.0, .original_max_position = 64};
  DeviceTensor table = testing::device_tensor(rope_table(rope_frequencies(rope, kRopeDim), 64));
  // One sequence, a 12-token prefill chunk at positions 0..11 (state slot 0, pages in order).
  std::vector<int32_t> position(kTokens), zeros(kTokens, 0);
  std::vector<int64_t> window_slot(kTokens), entry_slot(kTokens);
  for (int64_t t = 0; t < kTokens; ++t) {
    position[t] = static_cast<int32_t>(t);
    window_slot[t] = t;
    entry_slot[t] = (t + 1) % kRatio == 0 ? (t + 1) / kRatio - 1 : -1;
  }
  DeviceTensor dpos = testing::device_array(position, DType::i32, {kTokens});
  DeviceTensor dseq = testing::device_array(zeros, DType::i32, {kTokens});
  DeviceTensor dwindow_slot = testing::device_array(window_slot, DType::i64, {kTokens});
  DeviceTensor dentry_slot = testing::device_array(entry_slot, DType::i64, {kTokens});
  DeviceTensor table1 = testing::device_array(std::vector<int32_t>{0}, DType::i32, {1, 1});

  const PageGeometry wg = page_geometry(KvRowFormat::v41_fp8, kDim, 32);
  const PageGeometry cg = page_geometry(KvRowFormat::v41_fp4, kDim, 64);
  const PageGeometry kg = page_geometry(KvRowFormat::index_mxfp4, kIndexDim, 64);
  DeviceTensor window_pages = testing::poisoned_tensor(DType::u8, {1, wg.page_stride});
  DeviceTensor compressed_pages = testing::poisoned_tensor(DType::u8, {1, cg.page_stride});
  DeviceTensor key_pages = testing::poisoned_tensor(DType::u8, {1, kg.page_stride});
  const PagedCache window{.pages = window_pages.view, .block_table = table1.view, .geometry = wg};
  const PagedCache compressed{.pages = compressed_pages.view, .block_table = table1.view, .geometry = cg};
  const PagedCache keys{.pages = key_pages.view, .block_table = table1.view, .geometry = kg};

  DeviceTensor q_raw = testing::device_tensor(testing::random_floats(kTokens * kHeads * kDim, 1), DType::bf16, {kTokens, kHeads, kDim});
  DeviceTensor kv_raw = testing::device_tensor(testing::random_floats(kTokens * kDim, 2), DType::bf16, {kTokens, kDim});
  DeviceTensor kv_norm = testing::device_tensor(testing::random_floats(kDim, 3, 0.5f, 1.5f), DType::bf16, {kDim});
  DeviceTensor k_norm = testing::device_tensor(testing::random_floats(kIndexDim, 10, 0.5f, 1.5f), DType::bf16, {kIndexDim});
  DeviceTensor rows = testing::device_tensor(testing::random_floats(kTokens * 2 * kDim, 4), DType::f32, {kTokens, 2 * kDim});
  DeviceTensor state = testing::poisoned_tensor(DType::f32, {1, kRatio, 2 * kDim});
  DeviceTensor iq_raw = testing::device_tensor(testing::random_floats(kTokens * kIndexHeads * kIndexDim, 5), DType::bf16,
                                               {kTokens, kIndexHeads, kIndexDim});
  DeviceTensor iweights = testing::device_tensor(testing::random_floats(kTokens * kIndexHeads, 6, 0.0f, 0.2f), DType::f32,
                                                 {kTokens, kIndexHeads});
  DeviceTensor latent_keys = testing::device_tensor(testing::random_floats(kTokens * kIndexDim, 7), DType::bf16,
                                                    {kTokens, kIndexDim});
  DeviceTensor sink = testing::device_tensor(testing::random_floats(kHeads, 8), DType::f32, {kHeads});
  DeviceTensor wo_a = testing::device_tensor(testing::random_floats(kGroups * kRank * kHeads / kGroups * kDim, 9, -0.05f, 0.05f),
                                             DType::bf16, {kGroups, kRank, kHeads / kGroups * kDim});

  DeviceTensor q = testing::poisoned_tensor(DType::bf16, {kTokens, kHeads, kDim});
  DeviceTensor iq = testing::poisoned_tensor(DType::bf16, {kTokens, kIndexHeads, kIndexDim});
  DeviceTensor latent = testing::poisoned_tensor(DType::bf16, {kTokens, kDim});
  DeviceTensor scores = testing::poisoned_tensor(DType::f32, {kTokens, kEntries});
  DeviceTensor block_scores = testing::poisoned_tensor(DType::f32, {kTokens, kEntries / 2});
  DeviceTensor candidates = testing::poisoned_tensor(DType::i32, {kTokens, 2});
  DeviceTensor picks = testing::poisoned_tensor(DType::i32, {kTokens, kTopk});
  DeviceTensor o = testing::poisoned_tensor(DType::bf16, {kTokens, kHeads, kDim});
  DeviceTensor y = testing::poisoned_tensor(DType::bf16, {kTokens, kGroups, kRank});
  const OutputProjectionParams output{.o = o.view, .token_position = dpos.view, .rope_table = table.view,
                                      .wo_a = wo_a.view, .y = y.view, .blas = &*blas_};
  DeviceBuffer workspace(output_projection_workspace_bytes(output));

  const auto step = [&](cudaStream_t s) {
    run_rope_heads({.x = q_raw.view, .token_position = dpos.view, .rope_table = table.view, .out = q.view}, s);
    run_cache_insert({.rows = kv_raw.view, .norm_weight = kv_norm.view, .eps = 1e-20f, .token_position = dpos.view,
                      .rope_table = table.view, .quant = RowQuantizer::fp8_e4m3_32, .slots = dwindow_slot.view,
                      .cache = window}, s);
    run_compressor_pool({.rows = rows.view, .token_position = dpos.view, .state_slot = dseq.view, .state = state.view,
                         .norm_weight = kv_norm.view, .eps = 1e-20f, .ratio = kRatio, .latent = latent.view}, s);
    run_cache_insert({.rows = latent.view, .token_position = dpos.view, .position_offset = 1 - kRatio,
                      .rope_table = table.view, .quant = RowQuantizer::fp4_e4m3_16, .slots = dentry_slot.view,
                      .cache = compressed}, s);
    run_cache_insert({.rows = latent_keys.view, .norm_weight = k_norm.view, .eps = 1e-20f, .token_position = dpos.view,
                      .position_offset = 1 - kRatio, .rope_table = table.view, .quant = RowQuantizer::fp4_ue8m0_32,
                      .slots = dentry_slot.view, .cache = keys}, s);
    run_rope_heads({.x = iq_raw.view, .token_position = dpos.view, .rope_table = table.view,
                    .quant = RowQuantizer::fp4_ue8m0_32, .out = iq.view}, s);
    run_index_scores({.q = iq.view, .weights = iweights.view, .keys = keys, .token_sequence = dseq.view,
                      .token_position = dpos.view, .compress_ratio = kRatio, .scores = scores.view}, s);
    run_candidate_block_scores({.scores = scores.view, .token_position = dpos.view, .compress_ratio = kRatio,
                                .block_size = 2, .block_scores = block_scores.view}, s);
    run_topk({.scores = block_scores.view, .token_position = dpos.view, .compress_ratio = kRatio, .group_size = 2,
              .picks = candidates.view}, s);
    run_topk({.scores = scores.view, .token_position = dpos.view, .compress_ratio = kRatio, .picks = picks.view}, s);
    run_sparse_attention({.q = q.view, .token_sequence = dseq.view, .token_position = dpos.view, .window = window,
                          .window_size = 4, .compressed = compressed, .picks = picks.view, .compress_ratio = kRatio,
                          .sink = sink.view, .scale = 0.044f, .out = o.view}, s);
    run_output_projection(output, workspace.data(), s);
  };
  const std::vector<DeviceTensor*> outputs = {&window_pages, &compressed_pages, &key_pages, &latent, &scores,
                                                    &candidates, &picks, &o, &y};
  Stream stream;
  step(stream.get());
  stream.synchronize("eager step");
  std::vector<std::vector<std::byte>> eager;
  for (DeviceTensor* t : outputs) eager.push_back(testing::download_as<std::byte>(t->view));
  for (DeviceTensor* t : outputs) t->buffer.fill_bytes(0xff);
  state.buffer.fill_bytes(0xff);  // the eager step filled the ring: start from the same state

  testing::run_as_graph(stream, step);
  for (size_t i = 0; i < outputs.size(); ++i)
    EXPECT_EQ(testing::download_as<std::byte>(outputs[i]->view), eager[i]) << "output " << i << " differs after replay";
  // The step computed something: every token attended at least its own window row.
  for (float v : testing::download_floats(y.view)) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace dsv4::cuda

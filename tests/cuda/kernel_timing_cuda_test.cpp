// Timings of the CUDA ops at V4.1-Flash sizes (64 heads × 512, window 128, top-k 512, 32 index
// heads × 128, context 16K / 64K). A measurement harness, not a correctness test: disabled by
// default, run with --gtest_also_run_disabled_tests on a machine with a GPU. Each case prints the
// mean time of 10 launches after 2 warm-up launches and checks that the outputs are finite.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <optional>

#include "cuda/cuda_test_util.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/indexer.h"
#include "dsv4/cuda/projection.h"
#include "dsv4/cuda/qkv.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

using testing::DeviceTensor;

constexpr int64_t kHeads = 64, kDim = 512, kWindow = 128, kTopk = 512, kRatio = 2;
constexpr int64_t kIndexHeads = 32, kIndexDim = 128;

// Mean milliseconds of one launch of f.
double time_ms(const std::function<void(cudaStream_t)>& f, const Stream& stream) {
  for (int i = 0; i < 2; ++i) f(stream.get());
  cudaEvent_t start, stop;
  DSV4_CUDA_CHECK(cudaEventCreate(&start));
  DSV4_CUDA_CHECK(cudaEventCreate(&stop));
  constexpr int kRuns = 10;
  DSV4_CUDA_CHECK(cudaEventRecord(start, stream.get()));
  for (int i = 0; i < kRuns; ++i) f(stream.get());
  DSV4_CUDA_CHECK(cudaEventRecord(stop, stream.get()));
  stream.synchronize("timing");
  float ms = 0.0f;
  DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / kRuns;
}

void report(const char* what, double ms) { std::printf("[ timing ] %-62s %9.1f us\n", what, ms * 1e3); }

void expect_finite(const TensorView& v, const char* what) {
  const auto values = testing::download_floats(v);
  size_t bad = 0;
  for (float x : values) bad += !std::isfinite(x);
  EXPECT_EQ(bad, 0u) << what;
}

// A cache of `rows` rows per sequence, every byte `fill` (a finite value in every format used).
struct UniformCache {
  DeviceTensor pages, table;
  PagedCache view;
  UniformCache(KvRowFormat format, int64_t dims, int64_t sequences, int64_t rows, uint8_t fill) {
    const PageGeometry g = page_geometry(format, dims, default_rows_per_page(format));
    const int64_t blocks = (rows + g.rows_per_page - 1) / g.rows_per_page;
    std::vector<int32_t> ids(static_cast<size_t>(sequences * blocks));
    std::iota(ids.begin(), ids.end(), 0);
    pages = testing::poisoned_tensor(DType::u8, {sequences * blocks, g.page_stride});
    pages.buffer.fill_bytes(fill);
    table = testing::device_array(ids, DType::i32, {sequences, blocks});
    view = {.pages = pages.view, .block_table = table.view, .geometry = g};
  }
};

struct Step {
  int64_t sequences, tokens_per_sequence, last_position;
  std::vector<int32_t> sequence, position;
  DeviceTensor dsequence, dposition;
  Step(int64_t sequences_, int64_t tokens, int64_t last) : sequences(sequences_), tokens_per_sequence(tokens), last_position(last) {
    for (int64_t s = 0; s < sequences; ++s)
      for (int64_t i = 0; i < tokens; ++i) {
        sequence.push_back(static_cast<int32_t>(s));
        position.push_back(static_cast<int32_t>(last - tokens + 1 + i));
      }
    dsequence = testing::device_array(sequence, DType::i32, {tokens_count()});
    dposition = testing::device_array(position, DType::i32, {tokens_count()});
  }
  int64_t tokens_count() const { return sequences * tokens_per_sequence; }
};

void time_attention_and_indexer(const char* label, const Step& step) {
  const int64_t tokens = step.tokens_count(), entries = (step.last_position + 1) / kRatio;
  UniformCache window(KvRowFormat::v41_fp8, kDim, step.sequences, step.last_position + 1, 0x38);
  UniformCache compressed(KvRowFormat::v41_fp4, kDim, step.sequences, entries, 0x22);
  UniformCache keys(KvRowFormat::index_mxfp4, kIndexDim, step.sequences, entries, 0x7a);
  DeviceTensor q = testing::device_tensor(testing::random_floats(tokens * kHeads * kDim, 1), DType::bf16, {tokens, kHeads, kDim});
  DeviceTensor sink = testing::device_tensor(testing::random_floats(kHeads, 2), DType::f32, {kHeads});
  std::vector<int32_t> picks(static_cast<size_t>(tokens * kTopk));
  std::mt19937 rng(3);
  for (auto& p : picks) p = static_cast<int32_t>(rng() % (entries - kRatio * step.tokens_per_sequence));
  DeviceTensor dpicks = testing::device_array(picks, DType::i32, {tokens, kTopk});
  DeviceTensor out = testing::poisoned_tensor(DType::bf16, {tokens, kHeads, kDim});
  DeviceTensor iq = testing::device_tensor(testing::random_floats(tokens * kIndexHeads * kIndexDim, 4), DType::bf16,
                                           {tokens, kIndexHeads, kIndexDim});
  DeviceTensor iw = testing::device_tensor(testing::random_floats(tokens * kIndexHeads, 5, 0.0f, 0.1f), DType::f32,
                                           {tokens, kIndexHeads});
  DeviceTensor scores = testing::poisoned_tensor(DType::f32, {tokens, entries});
  DeviceTensor topk = testing::poisoned_tensor(DType::i32, {tokens, kTopk});
  Stream stream;
  char what[160];

  const SparseAttentionParams attention{
      .q = q.view, .token_sequence = step.dsequence.view, .token_position = step.dposition.view,
      .window = window.view, .window_size = kWindow, .compressed = compressed.view, .picks = dpicks.view,
      .compress_ratio = kRatio, .sink = sink.view, .scale = 0.0442f, .out = out.view};
  std::snprintf(what, sizeof what, "sparse_attention %s: %lld tokens x %lld heads x %lld rows", label,
                static_cast<long long>(tokens), static_cast<long long>(kHeads), static_cast<long long>(kWindow + kTopk));
  report(what, time_ms([&](cudaStream_t s) { run_sparse_attention(attention, s); }, stream));
  expect_finite(out.view, "attention output");
  const size_t split_bytes = sparse_attention_workspace_bytes(attention);
  if (split_bytes > 0) {
    DeviceBuffer workspace(split_bytes);
    std::snprintf(what, sizeof what, "sparse_attention %s, rows split", label);
    report(what, time_ms([&](cudaStream_t s) { run_sparse_attention(attention, workspace.data(), s); }, stream));
    expect_finite(out.view, "split attention output");
  }

  const IndexScoresParams index{.q = iq.view, .weights = iw.view, .keys = keys.view,
                                .token_sequence = step.dsequence.view, .token_position = step.dposition.view,
                                .compress_ratio = kRatio, .scores = scores.view};
  std::snprintf(what, sizeof what, "index_scores %s: %lld tokens x %lld entries x %lld heads", label,
                static_cast<long long>(tokens), static_cast<long long>(entries), static_cast<long long>(kIndexHeads));
  report(what, time_ms([&](cudaStream_t s) { run_index_scores(index, s); }, stream));
  const TopkParams select{.scores = scores.view, .token_position = step.dposition.view, .compress_ratio = kRatio,
                          .picks = topk.view};
  std::snprintf(what, sizeof what, "topk %s: %lld rows of %lld, k %lld", label, static_cast<long long>(tokens),
                static_cast<long long>(entries), static_cast<long long>(kTopk));
  report(what, time_ms([&](cudaStream_t s) { run_topk(select, s); }, stream));
  for (int32_t p : testing::download_as<int32_t>(topk.view)) ASSERT_TRUE(p >= 0 && p < entries);
}

TEST(KernelTimingCudaTest, DISABLED_DecodeAndPrefillAtFlashSizes) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  time_attention_and_indexer("decode, 1 seq at 16K", Step(1, 1, 16383));
  time_attention_and_indexer("decode, 64 seqs at 16K", Step(64, 1, 16383));
  time_attention_and_indexer("decode, 8 seqs at 64K", Step(8, 1, 65535));
  time_attention_and_indexer("prefill chunk of 2048 at 16K", Step(1, 2048, 16383));
}

TEST(KernelTimingCudaTest, DISABLED_ProjectionsAndRowOpsAtFlashSizes) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  BlasLt blas;
  Stream stream;
  char what[160];
  const int64_t out = kHeads * kDim, in = 1280;  // wq_b
  HostTensor codes(DType::e4m3, {out, in}), scales(DType::ue8m0, {out / 32, in / 32});
  std::mt19937 rng(7);
  for (int64_t i = 0; i < codes.numel(); ++i) codes.as<uint8_t>()[i] = static_cast<uint8_t>(rng() % 0x70);
  for (int64_t i = 0; i < scales.numel(); ++i) scales.as<uint8_t>()[i] = static_cast<uint8_t>(110 + rng() % 8);
  DeviceTensor w = testing::device_tensor(codes), ws = testing::device_tensor(scales);
  DeviceTensor w_bf16 = testing::poisoned_tensor(DType::bf16, {out, in});
  run_dequantize_weight({.weight = w.view, .weight_scale = ws.view, .block_out = 32, .block_in = 32, .out = w_bf16.view},
                        stream.get());
  for (int64_t rows : {64, 2048}) {
    DeviceTensor x = testing::device_tensor(testing::random_floats(rows * in, 8), DType::bf16, {rows, in});
    DeviceTensor y = testing::poisoned_tensor(DType::bf16, {rows, out});
    for (const bool fp8 : {true, false}) {
      const LinearParams p{.x = x.view, .weight = fp8 ? w.view : w_bf16.view, .weight_scale = fp8 ? ws.view : TensorView{},
                           .block_out = 32, .block_in = 32, .activation_block = 32, .y = y.view, .blas = &blas};
      DeviceBuffer workspace(linear_workspace_bytes(p));
      std::snprintf(what, sizeof what, "linear wq_b %lld x %lld <- %lld, %s", static_cast<long long>(rows),
                    static_cast<long long>(out), static_cast<long long>(in),
                    fp8 ? "fp8 weight (dequantized per call)" : "bf16 weight");
      report(what, time_ms([&](cudaStream_t s) { run_linear(p, workspace.data(), s); }, stream));
      expect_finite(y.view, "linear output");
    }
  }
  const int64_t tokens = 2048;
  const RopeParams rope{.theta = 160000.0, .yarn = true, .factor = 16.0, .original_max_position = 65536};
  DeviceTensor table = testing::device_tensor(rope_table(rope_frequencies(rope, 64), 65536));
  Step step(1, tokens, 16383);
  DeviceTensor q = testing::device_tensor(testing::random_floats(tokens * kHeads * kDim, 9), DType::bf16, {tokens, kHeads, kDim});
  const RopeHeadsParams rope_q{.x = q.view, .token_position = step.dposition.view, .rope_table = table.view, .out = q.view};
  report("rope_heads q: 2048 tokens x 64 heads x 512", time_ms([&](cudaStream_t s) { run_rope_heads(rope_q, s); }, stream));
  UniformCache window(KvRowFormat::v41_fp8, kDim, 1, 16384, 0);
  std::vector<int64_t> slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) slots[t] = step.position[t];
  DeviceTensor dslots = testing::device_array(slots, DType::i64, {tokens});
  DeviceTensor kv = testing::device_tensor(testing::random_floats(tokens * kDim, 10), DType::bf16, {tokens, kDim});
  DeviceTensor norm = testing::device_tensor(testing::random_floats(kDim, 11, 0.5f, 1.5f), DType::bf16, {kDim});
  const CacheInsertParams insert{.rows = kv.view, .norm_weight = norm.view, .eps = 1e-20f,
                                 .token_position = step.dposition.view, .rope_table = table.view,
                                 .quant = RowQuantizer::fp8_e4m3_32, .slots = dslots.view, .cache = window.view};
  report("cache_insert window (norm, RoPE, fp8 QAT, v41_fp8): 2048 rows",
         time_ms([&](cudaStream_t s) { run_cache_insert(insert, s); }, stream));
  expect_finite(q.view, "rotated q");
}

}  // namespace
}  // namespace dsv4::cuda

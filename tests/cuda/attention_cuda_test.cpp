// run_sparse_attention against reference::sparse_attention on random caches in every format, with
// and without splitting a token's rows over several blocks, in every implementation that runs the
// call on this device (sparse_attention_implementations(), run directly, not through the chooser);
// where wgmma runs a call over quantized rows, the same call over its caches' pages staged to bf16
// (run_cache_stage) gives the same bits.
//
// The reference gets the rows the kernel must attend (window rows that have a page, valid picks),
// decoded on the host by kv_format's decode_rows. Tolerance: both compute in fp32 (the reference
// with bf16 = false: no rounding of e_i); they differ in summation order and exp implementation,
// |Δ| <= 4e-6 + 1e-4·|out| (measured on an H200: |Δ| <= 1.3e-6, at most 0.16 of the bound, over
// every f32 case, split or not). bf16 outputs may also land on the neighbouring bf16: rtol 2^-7
// (measured: one bf16 ulp, 0.995 of the bound). With bf16_rounding the reference rounds e_i
// relative to the final max, the kernels relative to a running max (and a split's own max), so
// each e_i may round to the neighbouring bf16: the bound adds 2^-7·Σ_i e_i·|row_i[c]| / denominator
// (recomputed in double), and a case whose rows fit one tile checks that the output follows the
// rounded e_i (measured on an H200, mma_bf16 and SIMT alike: max |Δ| 0.0077 = 0.33 of the bound;
// mean |Δ| 5.6e-8 to the rounded-e_i recomputation against 3.2e-4 to the unrounded one). decode_mma
// computes a tile as mma_bf16 does, over 32 rows instead of 64, and wgmma over 64 (warpgroup MMAs):
// the same bounds hold (measured on an H200: wgmma at most 0.66 of the bound with a 2^-8 slack on
// random rows, mean |Δ| 8.2e-8 to the rounded-e_i recomputation; 1.02–1.05 of it on the rows of
// SparseAttentionBf16RoundingRaisesTheRunningMax, hence 2^-7). lse is checked against a double
// recomputation (measured: |Δ| <= 9.5e-7, 0.015 of the bound).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>

#include "cuda/cuda_test_util.h"
#include "cuda/late_writer.h"
#include "cuda/ops/attention/mma/mma_fragment_probe.h"
#include "cuda/ops/attention/row_decode_check.h"
#include "cuda/ops/attention/sparse_attention_implementations.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/cache.h"
#include "dsv4/numeric.h"
#include "reference/ops.h"
#include "test_seed.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;
using testing::DeviceTensor;
using testing::HostPagedCache;

constexpr int64_t kHeadDim = 512;

struct Token {
  int32_t sequence;
  int32_t position;
};

struct AttentionCase {
  KvRowFormat window_format = KvRowFormat::v41_fp8;
  std::optional<KvRowFormat> compressed_format;  // nullopt: window only
  PagePlacement placement = PagePlacement::segregated;
  int64_t heads = 16;
  int64_t window = 128;
  int ratio = 0;  // 0 with a compressed cache: picks are not bounded by the position
  int64_t num_picks = 0;
  std::vector<Token> tokens;
  std::vector<int32_t> window_last;  // per token, optional: the last window row it attends
  std::vector<int32_t> picks;        // [tokens, num_picks], optional: else random
  std::vector<int32_t> first_window_page;  // per sequence; rows on earlier pages are gone
  DType out_dtype = DType::f32;
  DType q_dtype = DType::bf16;  // f32: Precision::fp32's queries, not rounded
  bool bf16_rounding = false;
  // Every token attends at most 32 rows (one tile of every implementation) and nothing splits: e_i
  // is relative to the final max as in the reference, so the output must be much closer to the
  // one with e_i rounded as the reference rounds it (bf16_rounding) or not rounded (without).
  bool rows_in_one_tile = false;
  // The compressed rows' values lie in [-m, m] (the window rows': [-2, 2]). Larger, the picks'
  // scores exceed the window rows' by more than the kernels' slack for their running max
  // (mma::kMaxSlack), so the max is raised and the accumulators rescaled past the first tile.
  float compressed_magnitude = 2.0f;
  uint32_t seed = 1;
};

void fill_rows(HostPagedCache& cache, int64_t rows, std::mt19937& rng, float magnitude = 2.0f) {
  std::uniform_real_distribution<float> dist(-magnitude, magnitude);
  std::vector<float> row(kHeadDim);
  for (int64_t s = 0; s < cache.num_sequences; ++s)
    for (int64_t r = 0; r < rows; ++r) {
      if (cache.slot(s, r) < 0) continue;
      for (float& v : row) v = dist(rng);
      cache.write(s, r, row.data());
    }
}

// What the test derives from one token's attended rows in double precision, per head.
struct Recomputed {
  std::vector<float> lse;  // [heads]: m + log Σ_i e_i, -inf without rows
  // [heads, dim]: the most that rounding e_i to bf16 relative to another max than the reference's
  // (a running max, a split's max) may move the output: each rounding is within half a bf16 ulp,
  // at most 2^-8 of the value, so the two e_i differ by at most 2^-7·e_i, and the output by
  // 2^-7 · Σ_i e_i·|row_i[c]| / denominator. (2^-8 held while the kernels' largest e_i of a tile
  // was exactly 1; relative to a lazily raised max (mma::kMaxSlack) a dominant row's e_i is not,
  // and SparseAttentionBf16RoundingRaisesTheRunningMax measured 1.04 of the 2^-8 bound.)
  std::vector<float> rounding_slack;
  // [heads, dim]: the output with e_i rounded to bf16 relative to the final max (as the reference
  // rounds) and without, neither output rounded: how far apart rounding e_i puts the two.
  std::vector<double> rounded, unrounded;
};

Recomputed recompute(const float* q, int64_t heads, const std::vector<std::vector<float>>& rows, const float* sink,
                     float scale) {
  const size_t n = rows.size();
  Recomputed r{std::vector<float>(heads, -INFINITY), std::vector<float>(heads * kHeadDim, 0.0f),
               std::vector<double>(heads * kHeadDim, 0.0), std::vector<double>(heads * kHeadDim, 0.0)};
  if (n == 0) return r;
  std::vector<double> logit(n);
  for (int64_t h = 0; h < heads; ++h) {
    double m = -INFINITY;
    for (size_t i = 0; i < n; ++i) {
      double dot = 0.0;
      for (int64_t c = 0; c < kHeadDim; ++c) dot += static_cast<double>(q[h * kHeadDim + c]) * rows[i][c];
      logit[i] = dot * scale;
      m = std::max(m, logit[i]);
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += std::exp(logit[i] - m);
    r.lse[h] = static_cast<float>(m + std::log(sum));
    const double denominator = sum + std::exp(static_cast<double>(sink[h]) - m);
    for (size_t i = 0; i < n; ++i) {
      const double e = std::exp(logit[i] - m), e_bf16 = round_to_bf16(static_cast<float>(e));
      for (int64_t c = 0; c < kHeadDim; ++c) {
        const double v = rows[i][c];
        r.rounding_slack[h * kHeadDim + c] += static_cast<float>(0x1p-7 * e * std::fabs(v) / denominator);
        r.rounded[h * kHeadDim + c] += e_bf16 * v / denominator;
        r.unrounded[h * kHeadDim + c] += e * v / denominator;
      }
    }
  }
  return r;
}

// A view of token t of a [tokens, ...] view.
TensorView token_view(TensorView v, int64_t t) {
  v.data = static_cast<std::byte*>(v.data) + t * v.stride[0] * static_cast<int64_t>(dtype_size(v.dtype));
  v.shape[0] = 1;
  return v;
}

double mean_abs_difference(const std::vector<float>& a, const std::vector<double>& b) {
  double total = 0.0;
  for (size_t i = 0; i < a.size(); ++i) total += std::fabs(a[i] - b[i]);
  return total / static_cast<double>(a.size());
}

void check_attention(const AttentionCase& c) {
  std::mt19937 rng(c.seed);
  const int64_t tokens = static_cast<int64_t>(c.tokens.size());
  int64_t max_position = 0;
  for (const Token& t : c.tokens) max_position = std::max<int64_t>(max_position, t.position);
  for (const int32_t last : c.window_last) max_position = std::max<int64_t>(max_position, last);

  const int64_t window_rows_per_page = default_rows_per_page(c.window_format);
  HostPagedCache window = testing::make_host_cache(
      c.window_format, kHeadDim, window_rows_per_page, c.placement, c.first_window_page,
      max_position / window_rows_per_page + 1, 3, c.seed + 1);
  if (c.window_format == KvRowFormat::fp8_per_tensor) window.tensor_scale = 0.0078125f;
  fill_rows(window, max_position + 1, rng);

  // Entries beyond the visible ones exist too: the kernel must not attend them. Without a ratio
  // every entry the picks name exists.
  int64_t entries = c.ratio > 0 ? (max_position + 1) / c.ratio + 4 : c.num_picks + 4;
  for (const int32_t e : c.picks) entries = std::max<int64_t>(entries, e + 1);
  std::optional<HostPagedCache> compressed;
  if (c.compressed_format) {
    compressed = testing::make_host_cache(*c.compressed_format, kHeadDim, 64, c.placement,
                                          std::vector<int32_t>(c.first_window_page.size(), 0), entries / 64 + 1, 2,
                                          c.seed + 2);
    fill_rows(*compressed, entries, rng, c.compressed_magnitude);
  }

  std::vector<float> q = testing::random_floats(tokens * c.heads * kHeadDim, c.seed + 3, -3.0f, 3.0f);
  if (c.q_dtype == DType::bf16) q = testing::rounded_to_bf16(q);
  const auto sink = testing::random_floats(c.heads, c.seed + 4, -1.0f, 3.0f);
  std::vector<int32_t> sequence(tokens), position(tokens), picks(static_cast<size_t>(tokens * c.num_picks));
  for (int64_t t = 0; t < tokens; ++t) {
    sequence[t] = c.tokens[t].sequence;
    position[t] = c.tokens[t].position;
    for (int64_t i = 0; i < c.num_picks; ++i) {
      // -1, visible entries, and a few not yet visible ones (with a ratio).
      const int64_t highest = c.ratio > 0 ? (position[t] + 1) / c.ratio + 2 : entries - 1;
      picks[t * c.num_picks + i] = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(-1, highest)(rng));
    }
  }
  if (!c.picks.empty()) picks = c.picks;
  // The window ends at the token's window_last when given, else at its position.
  const auto window_end = [&](int64_t t) { return c.window_last.empty() ? position[t] : c.window_last[t]; };
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));

  // Reference, token by token, on the rows the kernel must attend, and the double recomputation.
  const size_t outputs = static_cast<size_t>(tokens * c.heads * kHeadDim);
  std::vector<float> expected(outputs), expected_lse(static_cast<size_t>(tokens * c.heads)), rounding_slack(outputs);
  std::vector<double> rounded(outputs), unrounded(outputs);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<std::vector<float>> rows;
    for (int64_t p = std::max<int64_t>(0, window_end(t) - c.window + 1); p <= window_end(t); ++p)
      if (window.slot(sequence[t], p) >= 0) rows.push_back(window.read(sequence[t], p));
    for (int64_t i = 0; i < c.num_picks; ++i) {
      const int64_t e = picks[t * c.num_picks + i];
      const bool visible = c.ratio == 0 || e < (position[t] + 1) / c.ratio;
      if (e >= 0 && visible && compressed->slot(sequence[t], e) >= 0)
        rows.push_back(compressed->read(sequence[t], e));
    }
    std::vector<const float*> pointers;
    for (const auto& r : rows) pointers.push_back(r.data());
    const float* qt = q.data() + t * c.heads * kHeadDim;
    reference::sparse_attention(qt, c.heads, kHeadDim, pointers.data(), static_cast<int64_t>(pointers.size()),
                                sink.data(), scale, c.bf16_rounding, expected.data() + t * c.heads * kHeadDim);
    const Recomputed r = recompute(qt, c.heads, rows, sink.data(), scale);
    std::copy(r.lse.begin(), r.lse.end(), expected_lse.begin() + t * c.heads);
    std::copy(r.rounding_slack.begin(), r.rounding_slack.end(), rounding_slack.begin() + t * c.heads * kHeadDim);
    std::copy(r.rounded.begin(), r.rounded.end(), rounded.begin() + t * c.heads * kHeadDim);
    std::copy(r.unrounded.begin(), r.unrounded.end(), unrounded.begin() + t * c.heads * kHeadDim);
  }
  if (c.out_dtype == DType::bf16) expected = testing::rounded_to_bf16(expected);

  DeviceTensor dq = testing::device_tensor(q, c.q_dtype, {tokens, c.heads, kHeadDim});
  DeviceTensor dsequence = testing::device_array(sequence, DType::i32, {tokens});
  DeviceTensor dposition = testing::device_array(position, DType::i32, {tokens});
  DeviceTensor dsink = testing::device_tensor(sink, DType::f32, {c.heads});
  DeviceTensor dout = testing::poisoned_tensor(c.out_dtype, {tokens, c.heads, kHeadDim});
  DeviceTensor dlse = testing::poisoned_tensor(DType::f32, {tokens, c.heads});
  testing::DevicePagedCache dwindow = testing::to_device_cache(window);
  SparseAttentionParams p{.q = dq.view, .token_sequence = dsequence.view, .token_position = dposition.view,
                          .window = dwindow.view, .window_size = c.window, .sink = dsink.view, .scale = scale,
                          .out = dout.view, .lse = dlse.view, .bf16_rounding = c.bf16_rounding};
  DeviceTensor dwindow_last;
  if (!c.window_last.empty()) {
    dwindow_last = testing::device_array(c.window_last, DType::i32, {tokens});
    p.window_last = dwindow_last.view;
  }
  testing::DevicePagedCache dcompressed;
  DeviceTensor dpicks;
  if (compressed) {
    dcompressed = testing::to_device_cache(*compressed);
    dpicks = testing::device_array(picks, DType::i32, {tokens, c.num_picks});
    p.compressed = dcompressed.view;
    p.picks = dpicks.view;
    p.compress_ratio = c.ratio;
  }
  validate_sparse_attention(p);

  // Both outputs in f32; rtol: bf16 outputs may land on the neighbouring bf16, and with rounding
  // the reference's output is bf16. With rounding, e_i relative to another max may round the other
  // way: rounding_slack.
  const float rtol = c.out_dtype == DType::bf16 || c.bf16_rounding ? 0x1p-7f : 1e-4f;
  const std::span<const float> slack = c.bf16_rounding ? std::span<const float>(rounding_slack) : std::span<const float>();
  // lse: |Δ| <= 1e-5 + 1e-5·|lse| (the logits' fp32 error; -inf exactly).
  constexpr float kLseTolerance = 1e-5f;
  // Every implementation that runs this call on this device (the chooser takes the first).
  Stream stream;
  int implementations_run = 0;
  for (const SparseAttentionImplementation* implementation : sparse_attention_implementations()) {
    if (!implementation->supports(p, device_info()).empty()) continue;
    ++implementations_run;
    const std::string name = implementation->name;
    // Once with one block per (token, head group), once with the rows split over several blocks
    // (every case but the one-tile ones splits: few blocks, several tiles of rows).
    HostTensor results[2];  // unsplit, split
    for (const bool split : {false, true}) {
      const std::string what = name + (split ? " attention output, split rows" : " attention output");
      // What the implementation asks for: a token where it merges in its clusters and may split.
      DeviceBuffer workspace(split ? implementation->workspace_bytes(p) : 0);
      if (split) workspace.fill_bytes(0xa5);  // stale partials: every split writes its own
      dout.buffer.fill_bytes(0xff);
      dlse.buffer.fill_bytes(0xff);
      implementation->run(p, workspace.data(), stream.get());
      stream.synchronize(what.c_str());
      const std::vector<float> out = testing::download_floats(dout.view);
      testing::expect_close(out, expected, 4e-6f, rtol, what, slack);
      testing::expect_close(testing::download_floats(dlse.view), expected_lse, kLseTolerance, kLseTolerance,
                            name + (split ? " lse, split rows" : " lse"));
      if (c.rows_in_one_tile) {
        // e_i is relative to the final max as in the reference: the output follows the rounded e_i.
        const double to_rounded = mean_abs_difference(out, rounded), to_unrounded = mean_abs_difference(out, unrounded);
        std::cout << "measured " << what << ": mean |d| " << to_rounded << " to the rounded-e_i output, "
                  << to_unrounded << " to the unrounded one\n";
        if (c.bf16_rounding) EXPECT_LT(to_rounded, 0.25 * to_unrounded) << what;
        else EXPECT_LT(to_unrounded, 0.25 * to_rounded) << what;
      }
      results[split] = to_host(dout.view);
      // The call reads nothing before the kernel ahead of it is done (the tensor-core kernel is a
      // dependent launch): with Q poisoned and written back 50 us into a kernel that lets the next
      // one be scheduled at once, the same bits. (The splits are merged in a fixed order: a second
      // split run gives the same bits.)
      DeviceBuffer q_kept(dq.buffer.bytes());
      DSV4_CUDA_CHECK(cudaMemcpy(q_kept.data(), dq.buffer.data(), dq.buffer.bytes(), cudaMemcpyDeviceToDevice));
      dq.buffer.fill_bytes(0xff);
      dout.buffer.fill_bytes(0xff);
      testing::copy_late(dq.buffer.data(), q_kept.data(), dq.buffer.bytes(), 50'000, stream.get());
      implementation->run(p, workspace.data(), stream.get());
      stream.synchronize(what.c_str());
      const HostTensor again = to_host(dout.view);
      EXPECT_EQ(std::memcmp(results[split].data(), again.data(), again.nbytes()), 0)
          << what << ": Q written by the kernel before the call gave other bits";
    }
    const HostTensor& unsplit = results[0];
    // A token's result does not depend on the rest of the batch: the middle token alone gives the
    // same bits as in the batch, both unsplit. (How many splits a step gets depends on its size, and
    // the split changes the bits: each split rounds e_i relative to its own max.)
    const int64_t t = tokens / 2;
    SparseAttentionParams alone = p;
    alone.q = token_view(p.q, t);
    alone.token_sequence = token_view(p.token_sequence, t);
    alone.token_position = token_view(p.token_position, t);
    if (!c.window_last.empty()) alone.window_last = token_view(p.window_last, t);
    if (compressed) alone.picks = token_view(p.picks, t);
    DeviceTensor alone_out = testing::poisoned_tensor(c.out_dtype, {1, c.heads, kHeadDim});
    alone.out = alone_out.view;
    alone.lse = {};
    implementation->run(alone, nullptr, stream.get());
    stream.synchronize("attention of one token");
    const HostTensor single = to_host(alone_out.view);
    const size_t token_bytes = single.nbytes();
    EXPECT_EQ(std::memcmp(static_cast<const std::byte*>(unsplit.data()) + t * token_bytes, single.data(), token_bytes), 0)
        << name << ": token " << t << " alone gave other bits than in its batch";
  }
  EXPECT_GT(implementations_run, 0);

  // Where wgmma runs the call on quantized rows: its caches' pages staged to bf16 (run_cache_stage)
  // hold the values the kernel decodes into its tiles, so attending them gives the same bits,
  // unsplit and split.
  const bool quantized = c.window_format != KvRowFormat::bf16 || (compressed && *c.compressed_format != KvRowFormat::bf16);
  if (!quantized || std::string(choose_sparse_attention(p, device_info()).name) != "wgmma") return;
  const inputs::StagedCache staged_window = inputs::staged_cache(p.window);
  std::optional<inputs::StagedCache> staged_compressed;
  SparseAttentionParams from_staged = p;
  run_cache_stage(staged_window.stage, stream.get());
  from_staged.window = staged_window.stage.staged;
  if (compressed) {
    staged_compressed = inputs::staged_cache(p.compressed);
    run_cache_stage(staged_compressed->stage, stream.get());
    from_staged.compressed = staged_compressed->stage.staged;
  }
  EXPECT_STREQ(choose_sparse_attention(from_staged, device_info()).name, "wgmma");
  for (const bool split : {false, true}) {
    DeviceBuffer workspace(split ? sparse_attention_workspace_bytes(p) : 0);
    HostTensor outputs[2];
    for (const bool staged : {false, true}) {
      dout.buffer.fill_bytes(0xff);
      if (split) run_sparse_attention(staged ? from_staged : p, workspace.data(), stream.get());
      else run_sparse_attention(staged ? from_staged : p, stream.get());
      stream.synchronize("attention of staged pages");
      outputs[staged] = to_host(dout.view);
    }
    EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[1].data(), outputs[0].nbytes()), 0)
        << "the staged bf16 pages gave other bits than the quantized rows" << (split ? ", split rows" : "");
  }
}

TEST_F(CudaTest, SparseAttentionDecodeNativeFormats) {
  // One token per sequence at window edges (0, W-1, W, past W) with V4.1 native caches.
  check_attention({.window_format = KvRowFormat::v41_fp8, .compressed_format = KvRowFormat::v41_fp4, .heads = 64,
                   .window = 128, .ratio = 2, .num_picks = 24,
                   .tokens = {{0, 0}, {1, 127}, {2, 128}, {3, 301}, {4, 6}},
                   .first_window_page = {0, 0, 0, 5, 0}, .seed = 10});
}

TEST_F(CudaTest, SparseAttentionDecodeReleasedShape) {
  // V4.1-Flash decode at batch 16: 64 heads, window 128 + 512 picks, so the split gives each
  // block several tiles of rows (5 splits of 4 tiles), some splits only compressed rows.
  AttentionCase c{.window_format = KvRowFormat::v41_fp8, .compressed_format = KvRowFormat::v41_fp4, .heads = 64,
                  .window = 128, .ratio = 1, .num_picks = 512, .out_dtype = DType::bf16, .seed = 50};
  for (int32_t s = 0; s < 16; ++s) {
    c.tokens.push_back({s, 1000 + 7 * s});
    c.first_window_page.push_back(0);
  }
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionPrefillChunksFp8DsMla) {
  // Two prefill chunks (one from position 0, one continuing at 83) with a small window, ratio 1,
  // 20 heads (a partial head group), fp8_ds_mla caches, bf16 output.
  AttentionCase c{.window_format = KvRowFormat::fp8_ds_mla, .compressed_format = KvRowFormat::fp8_ds_mla,
                  .heads = 20, .window = 16, .ratio = 1, .num_picks = 13, .first_window_page = {0, 1},
                  .out_dtype = DType::bf16, .seed = 20};
  for (int32_t p = 0; p < 37; ++p) c.tokens.push_back({0, p});
  for (int32_t p = 83; p < 128; ++p) c.tokens.push_back({1, p});
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionBf16RoundingPrefillChunksBf16Rows) {
  // Prefill chunks over bf16 rows in reference precision (wgmma copies them straight into its
  // tiles): one chunk from position 0 (rows before the window is full), one continuing at 300
  // (several tiles per token, the last one partial), 64 heads, window 128, 200 picks with -1s.
  AttentionCase c{.window_format = KvRowFormat::bf16, .compressed_format = KvRowFormat::bf16, .heads = 64,
                  .window = 128, .ratio = 1, .num_picks = 200, .first_window_page = {0, 1}, .out_dtype = DType::bf16,
                  .bf16_rounding = true, .seed = 25};
  for (int32_t p = 0; p < 23; ++p) c.tokens.push_back({0, p});
  for (int32_t p = 300; p < 341; ++p) c.tokens.push_back({1, p});
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionBf16InterleavedPages) {
  AttentionCase c{.window_format = KvRowFormat::bf16, .compressed_format = KvRowFormat::v41_fp4,
                  .placement = PagePlacement::interleaved, .heads = 8, .window = 40, .ratio = 2, .num_picks = 33,
                  .first_window_page = {0}, .seed = 30};
  for (int32_t p = 50; p < 61; ++p) c.tokens.push_back({0, p});
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionFp32QueriesAndRows) {
  // What the engine runs in Precision::fp32: f32 queries over f32 window and compressed rows (the
  // SIMT kernel; the tensor-core ones take bf16 q), prefill and decode tokens of two sequences.
  AttentionCase c{.window_format = KvRowFormat::f32, .compressed_format = KvRowFormat::f32, .heads = 20,
                  .window = 16, .ratio = 4, .num_picks = 9, .first_window_page = {0, 0}, .q_dtype = DType::f32,
                  .seed = 35};
  for (int32_t p = 0; p < 40; ++p) c.tokens.push_back({0, p});
  for (int32_t p : {70, 95, 130}) c.tokens.push_back({1, p});
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionWindowOnlyPerTensorFp8) {
  // No compressed cache; the sequence's first window page is gone, so early window rows are
  // skipped rather than read (position 100 of sequence 1 attends none: zeros, lse -inf).
  AttentionCase c{.window_format = KvRowFormat::fp8_per_tensor, .heads = 17, .window = 128,
                  .first_window_page = {0, 2}, .seed = 40};
  for (int32_t p : {0, 1, 63, 64, 65}) c.tokens.push_back({0, p});
  for (int32_t p : {100, 130, 150, 191, 200}) c.tokens.push_back({1, p});
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionBf16RoundingDecodeReleasedShape) {
  // What the engine runs in reference precision: the released decode shape with e_i rounded.
  AttentionCase c{.window_format = KvRowFormat::v41_fp8, .compressed_format = KvRowFormat::v41_fp4, .heads = 64,
                  .window = 128, .ratio = 1, .num_picks = 512, .out_dtype = DType::bf16, .bf16_rounding = true,
                  .seed = 60};
  for (int32_t s = 0; s < 16; ++s) {
    c.tokens.push_back({s, 900 + 11 * s});
    c.first_window_page.push_back(0);
  }
  check_attention(c);
}

TEST_F(CudaTest, SparseAttentionBf16RoundingFollowsTheReferenceInOneTile) {
  // At most 32 rows per token (window 16 + 13 picks), f32 output: with the rows in one tile the
  // rounding of e_i is the reference's, and without bf16_rounding nothing is rounded.
  for (const bool rounding : {true, false}) {
    SCOPED_TRACE(rounding ? "bf16_rounding" : "no rounding");
    AttentionCase c{.window_format = KvRowFormat::fp8_ds_mla, .compressed_format = KvRowFormat::v41_fp4,
                    .heads = 32, .window = 16, .ratio = 1, .num_picks = 13, .first_window_page = {0, 0},
                    .bf16_rounding = rounding, .rows_in_one_tile = true, .seed = 70};
    for (int32_t p = 0; p < 20; ++p) c.tokens.push_back({p % 2, 3 * p});
    check_attention(c);
  }
}

TEST_F(CudaTest, SparseAttentionBf16RoundingHeadsFormatsAndTopK) {
  // The shapes tensor-parallel shards and both model sizes give (16, 32, 64, 128 heads and a
  // partial head group), top-k 512 and 1024, every cache format exact in bf16 (bf16 rows too),
  // tokens before, at and past the window, row counts that are not multiples of a tile.
  struct Shape {
    int64_t heads;
    KvRowFormat window_format, compressed_format;
    int64_t num_picks;
    int ratio;
    DType out_dtype;
  };
  for (const Shape& shape : {Shape{16, KvRowFormat::bf16, KvRowFormat::v41_fp4, 1024, 1, DType::bf16},
                             Shape{32, KvRowFormat::v41_fp8, KvRowFormat::fp8_ds_mla, 100, 2, DType::f32},
                             Shape{128, KvRowFormat::fp8_ds_mla, KvRowFormat::v41_fp4, 512, 1, DType::bf16},
                             Shape{64, KvRowFormat::v41_fp8, KvRowFormat::bf16, 512, 1, DType::bf16},
                             Shape{20, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, 77, 1, DType::bf16},
                             Shape{128, KvRowFormat::bf16, KvRowFormat::bf16, 1024, 2, DType::f32},
                             Shape{20, KvRowFormat::bf16, KvRowFormat::bf16, 77, 1, DType::bf16}}) {
    SCOPED_TRACE(std::to_string(shape.heads) + " heads, " + kv_row_format_name(shape.window_format) + " + " +
                 kv_row_format_name(shape.compressed_format) + ", " + std::to_string(shape.num_picks) + " picks");
    AttentionCase c{.window_format = shape.window_format, .compressed_format = shape.compressed_format,
                    .heads = shape.heads, .window = 128, .ratio = shape.ratio, .num_picks = shape.num_picks,
                    .out_dtype = shape.out_dtype, .bf16_rounding = true, .seed = static_cast<uint32_t>(80 + shape.heads)};
    int32_t s = 0;
    for (int32_t p : {0, 5, 63, 64, 127, 700, 1500}) {
      c.tokens.push_back({s++, p});
      c.first_window_page.push_back(0);
    }
    check_attention(c);
  }
}

TEST_F(CudaTest, SparseAttentionBf16RoundingRaisesTheRunningMax) {
  // Window rows in [-2, 2] come first, picks in [-6, 6] after them: a pick tile's max exceeds the
  // window tiles' by well over 8 log2 units (logits' standard deviation ≈ 2 against ≈ 6), so the
  // tensor-core kernels raise their running max and rescale the accumulators after the first
  // tiles, where random rows alike almost never do; between the picks' tiles the max moves by
  // less, within the slack (exp-scores above 1). Every wgmma format pair, decode tokens and a
  // prefill chunk, split and unsplit. f32 outputs, so that the bound is the e_i rounding's slack
  // and rtol alone, with no rounding of the output on top.
  for (const auto& [window_format, compressed_format] :
       {std::pair{KvRowFormat::v41_fp8, KvRowFormat::v41_fp4}, std::pair{KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla},
        std::pair{KvRowFormat::bf16, KvRowFormat::bf16}}) {
    SCOPED_TRACE(std::string(kv_row_format_name(window_format)) + " + " + kv_row_format_name(compressed_format));
    AttentionCase c{.window_format = window_format, .compressed_format = compressed_format, .heads = 64,
                    .window = 128, .ratio = 1, .num_picks = 512, .bf16_rounding = true, .compressed_magnitude = 6.0f,
                    .seed = 95};
    for (int32_t s = 0; s < 3; ++s) {
      c.tokens.push_back({s, 900 + 61 * s});
      c.first_window_page.push_back(0);
    }
    for (int32_t p = 600; p < 640; ++p) c.tokens.push_back({3, p});
    c.first_window_page.push_back(0);
    check_attention(c);
  }
}

TEST_F(CudaTest, SparseAttentionBf16RoundingDecodeBatches) {
  // Decode steps as the tensor-core kernels plan them: batch 1 and 3 (every token's rows split over
  // many blocks, one tile each, in narrower head groups), batch 64 (two splits). V4.1-Flash rows (window 128 + 512
  // picks, 64 heads) in the native formats, fp8_ds_mla and bf16; 128 heads and a padded shard of
  // 16; tokens before the window is full (row counts that are not multiples of a tile), -1 picks
  // and picks not yet visible.
  struct Shape {
    int64_t batch, heads;
    KvRowFormat window_format, compressed_format;
    DType out_dtype;
  };
  for (const Shape& shape : {Shape{1, 64, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::bf16},
                             Shape{3, 64, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::f32},
                             Shape{64, 64, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::bf16},
                             Shape{1, 64, KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, DType::bf16},
                             Shape{3, 64, KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, DType::bf16},
                             Shape{3, 64, KvRowFormat::bf16, KvRowFormat::bf16, DType::f32},
                             Shape{3, 128, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::bf16},
                             Shape{3, 16, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::bf16},
                             // More two-split steps: two head groups, fp8_ds_mla, bf16 rows, a
                             // shard, an odd head count (the blocks' halves of the merge meet
                             // inside a head).
                             Shape{32, 128, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::f32},
                             Shape{64, 64, KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, DType::f32},
                             Shape{64, 64, KvRowFormat::bf16, KvRowFormat::bf16, DType::bf16},
                             Shape{48, 16, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::bf16},
                             Shape{48, 13, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::f32},
                             // Narrower head groups (batch 1: 16 heads a block, batch 3: 32), one
                             // of them partial (20 heads: 16 + 4).
                             Shape{1, 20, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, DType::f32},
                             Shape{1, 64, KvRowFormat::bf16, KvRowFormat::bf16, DType::bf16}}) {
    SCOPED_TRACE("batch " + std::to_string(shape.batch) + ", " + std::to_string(shape.heads) + " heads, " +
                 kv_row_format_name(shape.window_format) + " + " + kv_row_format_name(shape.compressed_format));
    AttentionCase c{.window_format = shape.window_format, .compressed_format = shape.compressed_format,
                    .heads = shape.heads, .window = 128, .ratio = 1, .num_picks = 512, .out_dtype = shape.out_dtype,
                    .bf16_rounding = true, .seed = static_cast<uint32_t>(100 + shape.batch + shape.heads)};
    for (int32_t s = 0; s < shape.batch; ++s) {
      // Batch 1: a full window; else positions 0, 77, ... (every fifth before the window is full).
      const int32_t position = shape.batch == 1 ? 600 : (s % 5 == 1 ? (s * 37) % 128 : 128 + (s * 97) % 500);
      c.tokens.push_back({s, position});
      c.first_window_page.push_back(0);
    }
    check_attention(c);
  }
}

// Random valid configurations (a fixed seed: DSV4_TEST_SEED replays another or draws a fresh one):
// head counts of tensor-parallel shards and odd ones, windows, top-k, every format of each cache
// (none for the compressed one), ratios, tokens before, in and past the window, f32 and bf16
// queries and outputs, with and without the reference's rounding; every implementation the device
// runs for the call against the reference, with the bounds and checks of check_attention.
TEST_F(CudaTest, SparseAttentionRandomConfigurations) {
  SEED_TRACE();
  std::mt19937_64 rng(test::test_seed());
  auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  auto one_of = [&](const auto& values) { return values[static_cast<size_t>(uniform(0, std::size(values) - 1))]; };
  constexpr int64_t kHeads[] = {1, 8, 16, 20, 32, 64, 65, 128};
  constexpr KvRowFormat kWindowFormats[] = {KvRowFormat::bf16,       KvRowFormat::v41_fp8, KvRowFormat::v41_fp4,
                                            KvRowFormat::fp8_ds_mla, KvRowFormat::f32,     KvRowFormat::fp8_per_tensor};
  constexpr KvRowFormat kCompressedFormats[] = {KvRowFormat::bf16, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4,
                                                KvRowFormat::fp8_ds_mla, KvRowFormat::f32};
  constexpr int kRatios[] = {0, 1, 2, 4};
  for (int trial = 0; trial < 12; ++trial) {
    AttentionCase c;
    c.heads = one_of(kHeads);
    c.window_format = one_of(kWindowFormats);
    if (uniform(0, 4) > 0) {
      c.compressed_format = one_of(kCompressedFormats);
      c.ratio = one_of(kRatios);
      c.num_picks = uniform(1, 1100);
    }
    c.window = uniform(1, 256);
    c.out_dtype = uniform(0, 1) ? DType::bf16 : DType::f32;
    c.q_dtype = uniform(0, 3) ? DType::bf16 : DType::f32;
    c.bf16_rounding = uniform(0, 2) > 0;
    const int64_t tokens = uniform(1, 5), sequences = uniform(1, tokens);
    for (int64_t t = 0; t < tokens; ++t)
      c.tokens.push_back({static_cast<int32_t>(t % sequences), static_cast<int32_t>(uniform(0, 1500))});
    c.first_window_page.assign(static_cast<size_t>(sequences), 0);
    c.seed = static_cast<uint32_t>(rng());
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(c.heads) + " heads, window " +
                 std::to_string(c.window) + " (" + kv_row_format_name(c.window_format) + "), " +
                 (c.compressed_format ? std::to_string(c.num_picks) + " picks (" +
                                            kv_row_format_name(*c.compressed_format) + ", ratio " +
                                            std::to_string(c.ratio) + ")"
                                      : std::string("no picks")) +
                 ", " + std::to_string(tokens) + " tokens, " + (c.bf16_rounding ? "rounding" : "fp32"));
    check_attention(c);
  }
}

TEST_F(CudaTest, SparseAttentionWindowLastDraftBlocks) {
  // DSpark draft blocks (SPEC §13.1): block b of B = 5 rows at p0 + 1 ... p0 + 5 attends the window
  // rows p0 - W + 1 ... p0 (window_last = p0, not its position) and the 5 rows of its block, picked
  // from a second cache in the window's format with ratio 0 (not bounded by the position). Blocks
  // after p0 = 0, inside the window, at its edge and past it (the early pages gone). Every
  // implementation, with and without the reference's rounding.
  for (const bool rounding : {false, true}) {
    SCOPED_TRACE(rounding ? "bf16_rounding" : "no rounding");
    constexpr int64_t kBlock = 5;
    AttentionCase c{.window_format = KvRowFormat::v41_fp8, .compressed_format = KvRowFormat::v41_fp8, .heads = 64,
                    .window = 128, .ratio = 0, .num_picks = kBlock, .out_dtype = DType::bf16,
                    .bf16_rounding = rounding, .seed = 90};
    int32_t b = 0;
    for (const int32_t p0 : {0, 40, 127, 300}) {
      c.first_window_page.push_back(p0 > 128 ? 6 : 0);  // 32 rows per page: rows < 192 are gone
      for (int32_t j = 0; j < kBlock; ++j) {
        c.tokens.push_back({b, p0 + 1 + j});
        c.window_last.push_back(p0);
        // The block keys of sequence b are its entries b·B ... b·B + B - 1, in order.
        for (int32_t i = 0; i < kBlock; ++i) c.picks.push_back(b * kBlock + i);
      }
      ++b;
    }
    check_attention(c);
  }
}

TEST_F(CudaTest, SparseAttentionWindowLastAnywhere) {
  // window_last before, at and after the token's own position (a later row: the window may reach
  // ahead), and negative (no window row); window only, bf16 rows.
  AttentionCase c{.window_format = KvRowFormat::bf16, .heads = 20, .window = 16, .first_window_page = {0, 0},
                  .seed = 95};
  for (const auto& [sequence, position, last] : {std::tuple{0, 10, 3}, std::tuple{0, 11, 11}, std::tuple{0, 12, 20},
                                                 std::tuple{1, 0, 7}, std::tuple{1, 50, -1}, std::tuple{1, 51, 70}}) {
    c.tokens.push_back({sequence, position});
    c.window_last.push_back(last);
  }
  check_attention(c);
}

// The fragment layouts of mma_fragments.cuh on one 16 x 16 x 16 product and its P·V, exact with
// small integers: a layout bug shows here as wrong elements (printed) before any attention test.
TEST_F(CudaTest, SparseAttentionMmaFragmentLayouts) {
  if (device_info().compute_capability < 80) GTEST_SKIP() << "mma.sync bf16 needs compute capability 8.0";
  std::mt19937 rng(5);
  auto small_integers = [&](int bound) {
    std::vector<float> m(256);
    for (float& x : m) x = static_cast<float>(std::uniform_int_distribution<int>(-bound, bound)(rng));
    return m;
  };
  const std::vector<float> a = small_integers(2), k = small_integers(2), v = small_integers(3);
  std::vector<float> s(256, 0.0f), o(256, 0.0f);
  for (int h = 0; h < 16; ++h)
    for (int j = 0; j < 16; ++j)
      for (int c = 0; c < 16; ++c) s[h * 16 + j] += a[h * 16 + c] * k[j * 16 + c];  // |s| <= 64: exact in bf16
  for (int h = 0; h < 16; ++h)
    for (int c = 0; c < 16; ++c)
      for (int j = 0; j < 16; ++j) o[h * 16 + c] += s[h * 16 + j] * v[j * 16 + c];
  DeviceTensor da = testing::device_tensor(a, DType::bf16, {16, 16}), dk = testing::device_tensor(k, DType::bf16, {16, 16}),
               dv = testing::device_tensor(v, DType::bf16, {16, 16});
  DeviceTensor ds = testing::poisoned_tensor(DType::f32, {16, 16}), dout = testing::poisoned_tensor(DType::f32, {16, 16});
  Stream stream;
  run_mma_fragment_probe(da.view.ptr<const uint16_t>(), dk.view.ptr<const uint16_t>(), dv.view.ptr<const uint16_t>(),
                         ds.view.ptr<float>(), dout.view.ptr<float>(), stream.get());
  stream.synchronize("mma fragment probe");
  for (const auto& [name, expected, actual] : {std::tuple{"s = a·kᵀ", &s, testing::download_floats(ds.view)},
                                               std::tuple{"o = s·v", &o, testing::download_floats(dout.view)}}) {
    int wrong = 0;
    for (int i = 0; i < 256; ++i)
      if (actual[i] != (*expected)[i] && ++wrong <= 8)
        ADD_FAILURE() << name << ": element (" << i / 16 << ", " << i % 16 << ") is " << actual[i] << ", expected "
                      << (*expected)[i];
    EXPECT_EQ(wrong, 0) << name;
  }
}

// Valid arguments of 3 tokens x 8 heads over a v41_fp8 window cache, on fake device views.
SparseAttentionParams fake_params() {
  using testing::fake_device_view;
  const PageGeometry g = page_geometry(KvRowFormat::v41_fp8, kHeadDim, 32);
  const PagedCache window{.pages = fake_device_view(DType::u8, {4, g.page_stride}),
                          .block_table = fake_device_view(DType::i32, {2, 2}), .geometry = g};
  return {.q = fake_device_view(DType::bf16, {3, 8, kHeadDim}),
          .token_sequence = fake_device_view(DType::i32, {3}),
          .token_position = fake_device_view(DType::i32, {3}),
          .window = window,
          .sink = fake_device_view(DType::f32, {8}),
          .scale = 0.04f,
          .out = fake_device_view(DType::f32, {3, 8, kHeadDim})};
}

// Validation needs no device.
TEST(SparseAttentionCudaValidation, ReportsTheFirstBadArgument) {
  using testing::error_of;
  using testing::fake_device_view;
  const SparseAttentionParams p = fake_params();
  const PagedCache window = p.window;
  EXPECT_NO_THROW(validate_sparse_attention(p));
  auto message = [](SparseAttentionParams bad) { return error_of([&] { validate_sparse_attention(bad); }); };

  SparseAttentionParams bad = p;
  bad.q = fake_device_view(DType::bf16, {3, 8, 256});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'q' has shape [3, 8, 256], expected [3, 8, 512]");
  bad = p;
  bad.token_position = fake_device_view(DType::i64, {3});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'token_position' has dtype I64, expected I32");
  bad = p;
  bad.window.pages = fake_device_view(DType::u8, {4, 100});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'window.pages' has shape [4, 100], expected [4, 16896]");
  bad = p;
  bad.sink = fake_device_view(DType::f32, {9});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'sink' has shape [9], expected [8]");
  bad = p;
  bad.out = fake_device_view(DType::f32, {3, 8});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'out' has rank 2, expected 3");
  bad = p;
  bad.picks = fake_device_view(DType::i32, {3, 4});
  EXPECT_EQ(message(bad),
            "dsv4: sparse_attention: argument 'picks' or 'pick_count' is given without a 'compressed' cache to read "
            "them from");
  bad = p;
  bad.compressed = window;
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'picks' has rank 0, expected 2");
  bad = p;
  bad.window.geometry = page_geometry(KvRowFormat::index_mxfp4, 128, 64);
  bad.window.pages = fake_device_view(DType::u8, {4, bad.window.geometry.page_stride});
  EXPECT_EQ(message(bad),
            "dsv4: sparse_attention: cache 'window' has format index_mxfp4, expected one of bf16, fp8_per_tensor, "
            "v41_fp8, v41_fp4, fp8_ds_mla, f32");
  bad = p;
  bad.window.geometry.page_stride += 512;
  bad.window.pages = fake_device_view(DType::u8, {4, bad.window.geometry.page_stride});
  EXPECT_EQ(message(bad),
            "dsv4: sparse_attention: cache 'window' has page stride 17408 with 512+16 bytes per row, expected 16896 "
            "with 512+16 (build the geometry with page_geometry())");
  bad = p;
  bad.window.geometry = page_geometry(KvRowFormat::f32, kHeadDim, 32);
  bad.window.pages = fake_device_view(DType::u8, {4, bad.window.geometry.page_stride});
  bad.window.pages.data = static_cast<std::byte*>(bad.window.pages.data) + 2;
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: cache 'window' has f32 pages that are not 4-byte aligned");
  bad = p;
  bad.lse = fake_device_view(DType::f32, {3, 9});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'lse' has shape [3, 9], expected [3, 8]");
  bad = p;
  bad.lse = fake_device_view(DType::bf16, {3, 8});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'lse' has dtype BF16, expected F32");
  bad = p;
  bad.window_last = fake_device_view(DType::i32, {4});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'window_last' has shape [4], expected [3]");
  bad = p;
  bad.window_size = -1;
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: window_size is -1, expected >= 0");
  // Sequences and positions may be left out only where nothing needs them: a cache with a block
  // table needs the sequence, a window or a causal bound the position.
  bad = p;
  bad.token_sequence = {};
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'token_sequence' has rank 0, expected 1");
  bad = p;
  bad.token_position = {};
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'token_position' has rank 0, expected 1");
  bad = p;
  bad.compressed = window;
  bad.picks = fake_device_view(DType::i32, {3, 4});
  bad.pick_count = fake_device_view(DType::i32, {4});
  EXPECT_EQ(message(bad), "dsv4: sparse_attention: argument 'pick_count' has shape [4], expected [3]");
  // Flat caches (no block table), no window, no sink: nothing else is needed.
  SparseAttentionParams flat = p;
  flat.window = {};
  flat.window_size = 0;
  flat.token_sequence = flat.token_position = flat.sink = {};
  flat.compressed = window;
  flat.compressed.block_table = {};
  flat.picks = fake_device_view(DType::i32, {3, 4});
  EXPECT_NO_THROW(validate_sparse_attention(flat));
}

// The V4.1 native rows' e2m1 decode by moving bits (row_decode.cuh), on the host, so that it runs
// without a GPU too: every code in every position of the paired order, times every e4m3 scale but
// NaN, is the codec's value times 2^-7, bit for bit, -0 included. The neighbouring codes differ from
// the one checked, so a bit that leaks between them shows.
TEST(SparseAttentionRowDecode, PairedE2m1BitsAreTheCodecsValues) {
  int checked = 0;
  for (int scale_code = 0; scale_code < 256; ++scale_code) {
    const float scale = e4m3_to_float(static_cast<uint8_t>(scale_code));
    if (std::isnan(scale)) continue;
    for (int shift = 0; shift < 16; ++shift) {
      uint32_t codes = 0;
      for (int p = 0; p < 8; ++p) codes |= static_cast<uint32_t>((shift + 5 * p) & 15) << (4 * p);
      const std::array<uint32_t, 4> pairs = cuda::decode_e2m1x8_paired_on_host(codes, static_cast<uint8_t>(scale_code));
      for (int p = 0; p < 8; ++p) {
        const uint8_t code = static_cast<uint8_t>((codes >> (4 * p)) & 15);
        const float expected = e2m1_to_float(code) * scale * 0x1p-7f;
        ASSERT_EQ(float_bits(expected) & 0xffffu, 0u) << "the codec's value is exact in bf16";
        const uint32_t got = (pairs[static_cast<size_t>(p % 4)] >> (16 * (p / 4))) & 0xffffu;
        ASSERT_EQ(got, float_bits(expected) >> 16) << "code " << int{code} << " at position " << p << ", scale code " << scale_code;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 254 * 16 * 8);
}

// The dispatch seam (sparse_attention_implementations.h): without bf16_rounding the SIMT kernel runs
// every call on every device the library supports; the choice needs no device.
TEST(SparseAttentionCudaDispatch, ChoosesSimtOnEveryDevice) {
  for (const int compute_capability : {80, 86, 89, 90, 100, 120})
    EXPECT_STREQ(choose_sparse_attention(fake_params(), DeviceInfo{compute_capability, 232448}).name, "simt")
        << "compute capability " << compute_capability;
}

TEST_F(CudaTest, SparseAttentionChoosesSimtOnThisDevice) {
  EXPECT_STREQ(sparse_attention_implementation(fake_params()), "simt");
}

// Reference precision (bf16_rounding) over rows exact in bf16 goes to the tensor cores where the
// block's shared memory fits; everything else stays on SIMT.
TEST(SparseAttentionCudaDispatch, ChoosesMmaForReferencePrecision) {
  SparseAttentionParams p = fake_params();
  p.bf16_rounding = true;
  const DeviceInfo h200{90, 232448}, a100{80, 166912}, ada{89, 101376}, turing{75, 65536};
  EXPECT_STREQ(choose_sparse_attention(p, h200).name, "wgmma");
  EXPECT_EQ(kSparseAttentionDecodeMma.supports(p, h200), "");
  EXPECT_EQ(kSparseAttentionMmaBf16.supports(p, h200), "");
  EXPECT_STREQ(choose_sparse_attention(p, a100).name, "simt");
  EXPECT_STREQ(choose_sparse_attention(p, ada).name, "simt");
  EXPECT_EQ(kSparseAttentionMmaBf16.supports(p, turing), "needs compute capability >= 8.0, the device has 7.5");
  EXPECT_EQ(kSparseAttentionMmaBf16.supports(p, a100),
            "needs 231440 bytes of shared memory per block, the device has 166912");
  SparseAttentionParams unrounded = fake_params();
  EXPECT_EQ(kSparseAttentionMmaBf16.supports(unrounded, h200),
            "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)");
  EXPECT_EQ(kSparseAttentionWgmma.supports(p, a100), "needs compute capability 9.0, the device has 8.0");
  EXPECT_EQ(kSparseAttentionWgmma.supports(p, DeviceInfo{100, 232448}), "needs compute capability 9.0, the device has 10.0");
  EXPECT_EQ(kSparseAttentionWgmma.supports(unrounded, h200), "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)");
  EXPECT_EQ(kSparseAttentionDecodeMma.supports(p, a100), "needs compute capability 9.0, the device has 8.0");
  EXPECT_EQ(kSparseAttentionDecodeMma.supports(p, DeviceInfo{100, 232448}),
            "needs compute capability 9.0, the device has 10.0");
  EXPECT_STREQ(choose_sparse_attention(p, DeviceInfo{100, 232448}).name, "mma_bf16");
  EXPECT_EQ(kSparseAttentionDecodeMma.supports(unrounded, h200),
            "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)");
  // Calls both tensor-core implementations refuse for the same reason go to SIMT.
  auto expect_simt_only = [&](const SparseAttentionParams& call, const std::string& why,
                              const std::string& wgmma_why) {
    EXPECT_EQ(kSparseAttentionMmaBf16.supports(call, h200), why);
    EXPECT_EQ(kSparseAttentionDecodeMma.supports(call, h200), why);
    EXPECT_EQ(kSparseAttentionWgmma.supports(call, h200), wgmma_why);
    EXPECT_STREQ(choose_sparse_attention(call, h200).name, "simt") << why;
  };
  SparseAttentionParams per_tensor = p;
  per_tensor.window.geometry = page_geometry(KvRowFormat::fp8_per_tensor, kHeadDim, 32);
  expect_simt_only(per_tensor, "cache 'window' has format fp8_per_tensor, whose values need not be exact in bf16",
                   "cache 'window' has format fp8_per_tensor, expected v41_fp8, v41_fp4, fp8_ds_mla or bf16 rows");
  // Precision::fp32's f32 rows and f32 queries stay on SIMT, even with bf16_rounding.
  SparseAttentionParams f32_rows = p;
  f32_rows.window.geometry = page_geometry(KvRowFormat::f32, kHeadDim, 64);
  expect_simt_only(f32_rows, "cache 'window' has format f32, whose values need not be exact in bf16",
                   "cache 'window' has format f32, expected v41_fp8, v41_fp4, fp8_ds_mla or bf16 rows");
  SparseAttentionParams f32_q = p;
  f32_q.q.dtype = DType::f32;
  expect_simt_only(f32_q, "needs bf16 q (the tensor cores read q as bf16)", "needs bf16 q (the tensor cores read q as bf16)");
  // wgmma takes the V4.1 native pair, fp8_ds_mla rows and bf16 rows; other pairs go to decode_mma.
  SparseAttentionParams ds_mla = p;
  ds_mla.window.geometry = page_geometry(KvRowFormat::fp8_ds_mla, kHeadDim, 32);
  EXPECT_STREQ(choose_sparse_attention(ds_mla, h200).name, "wgmma");
  SparseAttentionParams fp4_window = p;
  fp4_window.window.geometry = page_geometry(KvRowFormat::v41_fp4, kHeadDim, 32);
  EXPECT_EQ(kSparseAttentionWgmma.supports(fp4_window, h200),
            "needs window v41_fp8 with compressed v41_fp4, or fp8_ds_mla or bf16 for both");
  EXPECT_STREQ(choose_sparse_attention(fp4_window, h200).name, "decode_mma");
  SparseAttentionParams bf16_rows = p;
  bf16_rows.window.geometry = page_geometry(KvRowFormat::bf16, kHeadDim, 32);
  EXPECT_STREQ(choose_sparse_attention(bf16_rows, h200).name, "wgmma");
  SparseAttentionParams bf16_with_fp4 = bf16_rows;
  bf16_with_fp4.compressed = bf16_rows.window;
  bf16_with_fp4.compressed.geometry = page_geometry(KvRowFormat::v41_fp4, kHeadDim, 32);
  EXPECT_EQ(kSparseAttentionWgmma.supports(bf16_with_fp4, h200),
            "needs window v41_fp8 with compressed v41_fp4, or fp8_ds_mla or bf16 for both");
  EXPECT_STREQ(choose_sparse_attention(bf16_with_fp4, h200).name, "decode_mma");
}

// On an H100 / H200 reference precision over the V4.1 native rows goes to wgmma (what dsv4 bench
// --op attention-decode then reports).
TEST_F(CudaTest, SparseAttentionChoosesWgmmaOnHopper) {
  if (device_info().compute_capability != 90) GTEST_SKIP() << "wgmma needs compute capability 9.0";
  SparseAttentionParams p = fake_params();
  p.bf16_rounding = true;
  EXPECT_STREQ(sparse_attention_implementation(p), "wgmma");
}

// The split of a kernel whose split blocks merge in their cluster, planned from the device's cluster
// capacity: an H200-like one (132 SMs, clusters of s blocks in 8 GPCs of 16) and one that runs only
// the portable sizes (up to 8). Needs no device.
TEST(SparseAttentionCudaValidation, ClusterSplitPlan) {
  std::vector<int> h200(17), portable(17);
  for (int s = 1; s <= 16; ++s) h200[s] = s == 1 ? 132 : 8 * (16 / s), portable[s] = s <= 8 ? h200[s] : 0;
  auto expect_plan = [](const SplitKvPlan& plan, int splits, int64_t per_split, const std::string& what) {
    EXPECT_EQ(plan.splits, splits) << what;
    EXPECT_EQ(plan.tiles_per_split, per_split) << what;
  };
  expect_plan(plan_split_kv_clusters(1, 10, h200), 10, 1, "batch 1: a tile per block");
  expect_plan(plan_split_kv_clusters(1, 10, portable), 5, 2, "batch 1, portable clusters");
  expect_plan(plan_split_kv_clusters(64, 10, h200), 2, 5, "batch 64: pairs");
  expect_plan(plan_split_kv_clusters(128, 10, h200), 1, 10, "batch 128: a wave without splits");
  expect_plan(plan_split_kv_clusters(16, 10, h200), 5, 2, "batch 16: as fast as 10 splits, fewer to merge");
  expect_plan(plan_split_kv_clusters(1, 1, h200), 1, 1, "one tile");
  expect_plan(plan_split_kv_clusters(300, 10, h200), 1, 10, "more than a wave");
  expect_plan(plan_split_kv_clusters(0, 0, h200), 1, 1, "an empty step");
  expect_plan(plan_split_kv_clusters(4, 40, std::vector<int>{0, 132}), 1, 40, "no clusters");
  // Every plan covers the rows, no split without a tile, no cluster the device cannot place.
  for (int64_t blocks = 1; blocks <= 300; ++blocks)
    for (int64_t tiles = 1; tiles <= 40; ++tiles)
      for (const std::vector<int>* capacity : {&h200, &portable}) {
        const SplitKvPlan plan = plan_split_kv_clusters(blocks, tiles, *capacity);
        ASSERT_GE(plan.splits * plan.tiles_per_split, tiles) << blocks << " blocks, " << tiles << " tiles";
        ASSERT_LT((plan.splits - 1) * plan.tiles_per_split, tiles) << blocks << " blocks, " << tiles << " tiles";
        ASSERT_GT((*capacity)[plan.splits], 0) << blocks << " blocks, " << tiles << " tiles";
      }
}

// The same planner with narrower head groups: at batch 1 to 4 the merge of 64-head partials costs
// more than the padded MMAs of a narrower group; from batch 8 on the groups stay whole. Needs no
// device.
TEST(SparseAttentionCudaValidation, ClusterSplitPlanWithHeadGroups) {
  std::vector<int> h200(17), portable(17);
  for (int s = 1; s <= 16; ++s) h200[s] = s == 1 ? 132 : 8 * (16 / s), portable[s] = s <= 8 ? h200[s] : 0;
  auto expect_plan = [](const ClusterSplitPlan& plan, int splits, int64_t per_split, int heads_per_block,
                        const std::string& what) {
    EXPECT_EQ(plan.split.splits, splits) << what;
    EXPECT_EQ(plan.split.tiles_per_split, per_split) << what;
    EXPECT_EQ(plan.heads_per_block, heads_per_block) << what;
  };
  expect_plan(plan_split_kv_clusters(1, 64, 64, 10, h200), 10, 1, 16, "batch 1: 4 groups of 16 heads, a tile per block");
  expect_plan(plan_split_kv_clusters(3, 64, 64, 10, h200), 10, 1, 32, "batch 3: 2 groups of 32");
  expect_plan(plan_split_kv_clusters(8, 64, 64, 10, h200), 10, 1, 64, "batch 8: whole groups");
  expect_plan(plan_split_kv_clusters(16, 64, 64, 10, h200), 5, 2, 64, "batch 16");
  expect_plan(plan_split_kv_clusters(64, 64, 64, 10, h200), 2, 5, 64, "batch 64: pairs");
  // The pairs of SparseAttentionBf16RoundingDecodeBatches (on a device like this one).
  expect_plan(plan_split_kv_clusters(48, 13, 64, 10, h200), 2, 5, 64, "48 tokens of 13 heads: pairs");
  expect_plan(plan_split_kv_clusters(48, 16, 64, 10, h200), 2, 5, 64, "48 tokens of 16 heads: pairs");
  expect_plan(plan_split_kv_clusters(32, 128, 64, 10, h200), 2, 5, 64, "32 tokens of 128 heads: pairs");
  expect_plan(plan_split_kv_clusters(128, 64, 64, 10, h200), 1, 10, 64, "batch 128: no split");
  expect_plan(plan_split_kv_clusters(1, 20, 64, 10, h200), 10, 1, 16, "a shard of 20 heads: groups of 16 and 4");
  expect_plan(plan_split_kv_clusters(1, 16, 64, 10, h200), 10, 1, 64, "16 heads: one group already");
  expect_plan(plan_split_kv_clusters(1, 64, 64, 1, h200), 1, 1, 64, "one tile: nothing to merge, whole groups");
  expect_plan(plan_split_kv_clusters(1, 64, 64, 10, portable), 5, 2, 16, "batch 1, portable clusters");
  // Every plan fills at most one wave when it splits, with groups of 64, 32 or 16 heads.
  for (int64_t tokens = 1; tokens <= 300; ++tokens)
    for (const int64_t heads : {1, 16, 20, 64, 128})
      for (const std::vector<int>* capacity : {&h200, &portable}) {
        const ClusterSplitPlan plan = plan_split_kv_clusters(tokens, heads, 64, 10, *capacity);
        const std::string what = std::to_string(tokens) + " tokens, " + std::to_string(heads) + " heads";
        ASSERT_TRUE(plan.heads_per_block == 64 || plan.heads_per_block == 32 || plan.heads_per_block == 16) << what;
        const int64_t blocks = tokens * ((heads + plan.heads_per_block - 1) / plan.heads_per_block);
        if (plan.split.splits > 1) ASSERT_LE(blocks, (*capacity)[plan.split.splits]) << what;
        ASSERT_GE(plan.split.splits * plan.split.tiles_per_split, 10) << what;
      }
}

// The engine sizes the row split's workspace ahead with sparse_attention_max_workspace_bytes: it
// must cover every step it may run (any token count up to the maximum, fewer rows per token) and
// be no larger than the largest of them. Needs no device.
TEST(SparseAttentionCudaValidation, MaxWorkspaceCoversEveryStep) {
  using testing::fake_device_view;
  const PageGeometry g = page_geometry(KvRowFormat::v41_fp8, kHeadDim, 64);
  const PagedCache cache{.pages = fake_device_view(DType::u8, {8, g.page_stride}),
                         .block_table = fake_device_view(DType::i32, {2, 4}), .geometry = g};
  for (const auto& [heads, window, picks, max_tokens] :
       {std::tuple{64, 128, 512, 300}, std::tuple{20, 40, 33, 7}, std::tuple{128, 128, 0, 40}}) {
    const size_t bound = sparse_attention_max_workspace_bytes(max_tokens, heads, window + picks);
    size_t largest = 0;
    for (int64_t tokens = 1; tokens <= max_tokens; ++tokens)
      for (const int64_t step_picks : {int64_t{0}, int64_t{picks / 2}, int64_t{picks}}) {
        SparseAttentionParams p{.q = fake_device_view(DType::bf16, {tokens, heads, kHeadDim}),
                                .token_sequence = fake_device_view(DType::i32, {tokens}),
                                .token_position = fake_device_view(DType::i32, {tokens}),
                                .window = cache,
                                .window_size = window,
                                .sink = fake_device_view(DType::f32, {heads}),
                                .scale = 0.04f,
                                .out = fake_device_view(DType::bf16, {tokens, heads, kHeadDim})};
        if (step_picks > 0) {
          p.compressed = cache;
          p.picks = fake_device_view(DType::i32, {tokens, step_picks});
        }
        const size_t bytes = sparse_attention_workspace_bytes(p);
        EXPECT_LE(bytes, bound) << tokens << " tokens, " << heads << " heads, " << step_picks << " picks";
        largest = std::max(largest, bytes);
        // wgmma merges its splits in clusters and uses no bytes, but asks for some exactly where it
        // may split (it splits only when given a workspace): fewer blocks than clusters of two fill
        // an H200's wave, more than one tile of rows.
        const int64_t blocks = tokens * ((heads + 63) / 64), tiles = (window + step_picks + 63) / 64;
        const size_t wgmma_bytes = kSparseAttentionWgmma.workspace_bytes(p);
        EXPECT_EQ(wgmma_bytes > 0, blocks <= 66 && tiles > 1)
            << tokens << " tokens, " << heads << " heads, " << step_picks << " picks: wgmma asks for " << wgmma_bytes;
        EXPECT_LE(wgmma_bytes, kSparseAttentionWgmma.max_workspace_bytes(max_tokens, heads, window + picks));
      }
    EXPECT_EQ(largest, bound) << heads << " heads";
    EXPECT_GT(bound, 0u) << heads << " heads: small steps split";
  }
  EXPECT_EQ(sparse_attention_max_workspace_bytes(0, 64, 640), 0u);
  const SparseAttentionParams empty{.q = fake_device_view(DType::bf16, {0, 64, kHeadDim}),
                                    .token_sequence = fake_device_view(DType::i32, {0}),
                                    .token_position = fake_device_view(DType::i32, {0}),
                                    .window = cache,
                                    .window_size = 128,
                                    .sink = fake_device_view(DType::f32, {64}),
                                    .scale = 0.04f,
                                    .out = fake_device_view(DType::bf16, {0, 64, kHeadDim})};
  EXPECT_EQ(sparse_attention_workspace_bytes(empty), 0u) << "a step without tokens";
}

}  // namespace
}  // namespace dsv4::cuda

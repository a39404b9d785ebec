// The golden sets (tests/data/golden) replayed on the CUDA engine, every call through every layer
// with the recorded inputs, compared per call and layer with the recorded outputs:
//  * v41a (DeepSeek's official V4.1 code, reference precision, default formats = v4.1-native);
//  * v40a (transformers V4.0 in float64, Precision::fp32: fp32 throughout on the GPU, GEMMs, the
//    attention's and indexer's queries and the caches' rows (the f32 row format) included);
//  * v40o_a (DeepSeek's official V4.0 code, reference precision with its indexer QAT: Hadamard +
//    FP4 index queries and keys; every float tensor stored as bf16);
//  * v41ds_a (DeepSeek's official V4.1 DSpark draft layers) through a drafter, per call and stage
//    (CudaTest.GoldenV41DsparkDraftLayers below).
// Relative L2 over the rows the golden selection leaves unambiguous and whose picks the GPU
// reproduces: <= 2e-2 (the README's acceptance bound) for the reference-precision sets, <= 1e-4 for
// v40a (the CPU's bound for it, cli_replay_test). In reference precision the GPU indexer scores in
// fp32 where the v41a reference sums bf16, so a near-tie at the cut may select another entry and
// change the row's output. Such rows are counted; the GPU picks must still be a top-k of the
// recorded scores up to 2^-5 of the row's largest score (v41a records them), and most rows must
// agree exactly; v40a's and v40o_a's picks must agree on every unambiguous row.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "cuda/engine/cuda_engine.h"
#include "golden_util.h"

namespace dsv4 {
namespace {

using cuda::testing::CudaTest;
using golden::GoldenSet;

// Measured on an H200 (docs/cuda.md, 2026-11-29): worst relative L2 per call and layer 0.0045
// (v41a); picks equal on 400 of 400 unambiguous rows. Bounds: about 4x the measured error (GPU
// index scores are fp32 where the reference's are bf16, so outputs move with any FP8 / FP4 code
// that rounds the other way) and a tenth of the rows for the picks.
constexpr double kAcceptance = 2e-2;       // measured 0.0045
constexpr double kMinPickAgreement = 0.9;  // of the unambiguous rows of index-source layers; measured 1.0
// v40a in Precision::fp32 against a float64 run: only fp32 roundings differ (the CPU engine
// measures 2.4e-7, golden_v40_test), so the bound is the one the CPU replay of v40a is held to
// (cli_replay_test), and every unambiguous row (the set flags 3 of 150 whose float64 scores tie
// within 1e-6 at the cut) picks what transformers picked.
constexpr double kFp32Acceptance = 1e-4;

// The valid picks of a row as a sorted set.
std::vector<int32_t> pick_set(const float* values, int64_t n) {
  std::vector<int32_t> s;
  for (int64_t i = 0; i < n; ++i)
    if (values[i] >= 0) s.push_back(static_cast<int32_t>(values[i]));
  std::sort(s.begin(), s.end());
  return s;
}

std::vector<int32_t> pick_set(const int32_t* values, int64_t n) {
  std::vector<int32_t> s;
  for (int64_t i = 0; i < n; ++i)
    if (values[i] >= 0) s.push_back(values[i]);
  std::sort(s.begin(), s.end());
  return s;
}

// Whether `picks` are a top-k of `scores` [n] (-inf: not eligible) up to `slack` below the cut.
bool valid_topk(const std::vector<int32_t>& picks, int64_t k, const float* scores, int64_t n, double slack) {
  std::vector<float> eligible;
  for (int64_t j = 0; j < n; ++j)
    if (scores[j] != -std::numeric_limits<float>::infinity()) eligible.push_back(scores[j]);
  const size_t take = std::min(static_cast<size_t>(k), eligible.size());
  if (picks.size() != take) return false;
  std::sort(eligible.begin(), eligible.end(), std::greater<>());
  for (int32_t j : picks)
    if (j >= n || scores[j] == -std::numeric_limits<float>::infinity() || scores[j] < eligible[take - 1] - slack)
      return false;
  return true;
}

struct GoldenCase {
  std::string name;
  Precision precision;
  std::string picks_field;  // "topk_pos" (v41, v40o_a) or "topk" (v40a)
  // Of the unambiguous rows of index-source layers. v40o_a: every one (issue 15's requirement;
  // its scores have no near-ties but the 9 flagged rows, the official code on an H200 picks the
  // same on 183 of 183); v40a: every one (fp32 scores against float64 ones, ties flagged).
  double min_pick_agreement = kMinPickAgreement;
  double acceptance = kAcceptance;  // relative L2 per call and layer
};

class GoldenCuda : public CudaTest, public ::testing::WithParamInterface<GoldenCase> {};

TEST_P(GoldenCuda, OutputsMatchPerCallAndLayer) {
  const GoldenCase& gc = GetParam();
  const GoldenSet g = golden::load_golden_set(gc.name);
  int64_t longest_call = 0, positions = 0;
  for (int c = 0; c < g.num_calls; ++c) {
    longest_call = std::max(longest_call, g.call_tokens(c));
    positions += g.call_tokens(c);
  }
  EngineOptions options;
  options.backend = Backend::cuda;
  options.precision = gc.precision;
  options.max_sequences = g.batch;
  options.max_context = positions;
  options.max_tokens_per_step = g.batch * longest_call;
  auto engine = Engine::create(g.config, g.weights, options);
  std::vector<SequenceId> sequences;
  for (int64_t b = 0; b < g.batch; ++b) sequences.push_back(engine->add_sequence());

  const int64_t H = g.config.hidden_size, k = g.config.index_topk;
  double worst = 0;
  int worst_call = -1, worst_layer = -1;
  int64_t rows_compared = 0, rows_other_picks = 0, pick_rows = 0, picks_equal = 0;
  for (int c = 0; c < g.num_calls; ++c) {
    const golden::CallOutputs out = golden::replay_call(*engine, g, c, sequences);
    const int64_t rows = g.batch * g.call_tokens(c);
    // Per index-source layer and row: the golden selection is unambiguous and the GPU's equals it.
    std::vector<std::vector<uint8_t>> same_picks(static_cast<size_t>(g.config.num_layers));
    const auto unambiguous = [&](int l) {
      std::vector<uint8_t> usable(static_cast<size_t>(rows), 1);
      const std::string name = GoldenSet::layer_name(c, l, "ambiguous");
      if (!g.has(name)) return usable;
      const std::vector<float> flags = g.floats(name);
      for (int64_t r = 0; r < rows; ++r) usable[static_cast<size_t>(r)] = flags[static_cast<size_t>(r)] == 0.0f;
      return usable;
    };
    for (int l = 0; l < g.config.num_layers; ++l) {
      if (!g.topology[l].owns_indexer) continue;
      const std::string name = GoldenSet::layer_name(c, l, gc.picks_field);
      const int64_t width = g.shape(name)[2];
      const std::vector<float> expected = g.floats(name);
      const std::string score_name = GoldenSet::layer_name(c, l, "index_score");
      const std::vector<float> scores = g.has(score_name) ? g.floats(score_name) : std::vector<float>{};
      const int64_t n = scores.empty() ? 0 : g.shape(score_name)[2];
      const std::vector<uint8_t> usable = unambiguous(l);
      same_picks[static_cast<size_t>(l)].assign(static_cast<size_t>(rows), 0);
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<int32_t> mine = pick_set(out.picks[l].data() + r * k, k);
        const bool equal = mine == pick_set(expected.data() + r * width, width);
        same_picks[static_cast<size_t>(l)][static_cast<size_t>(r)] = equal && usable[static_cast<size_t>(r)];
        if (!usable[static_cast<size_t>(r)]) continue;
        ++pick_rows;
        picks_equal += equal;
        if (scores.empty() || g.topology[l].uses_candidates) continue;
        const float* row_scores = scores.data() + r * n;
        double largest = 0;
        for (int64_t j = 0; j < n; ++j)
          if (std::isfinite(row_scores[j])) largest = std::max(largest, std::abs(static_cast<double>(row_scores[j])));
        EXPECT_TRUE(valid_topk(mine, k, row_scores, n, std::ldexp(largest, -5) + 1e-6))
            << "call " << c << " layer " << l << " row " << r << ": the GPU picks are no top-" << k
            << " of the recorded scores";
      }
    }
    for (int l = 0; l < g.config.num_layers; ++l) {
      const std::vector<uint8_t> usable = unambiguous(l);
      const int source = g.topology[l].index_source;
      const std::vector<float> expected = g.floats(GoldenSet::layer_name(c, l, "attn_out"));
      std::vector<float> a, b;
      for (int64_t r = 0; r < rows; ++r) {
        if (!usable[static_cast<size_t>(r)]) continue;
        if (source >= 0 && !same_picks[static_cast<size_t>(source)][static_cast<size_t>(r)]) {
          ++rows_other_picks;
          continue;
        }
        a.insert(a.end(), out.attn_out[l].begin() + r * H, out.attn_out[l].begin() + (r + 1) * H);
        b.insert(b.end(), expected.begin() + r * H, expected.begin() + (r + 1) * H);
        ++rows_compared;
      }
      if (a.empty()) continue;
      const double err = golden::relative_l2(a.data(), b.data(), static_cast<int64_t>(a.size()));
      EXPECT_LE(err, gc.acceptance) << "call " << c << " layer " << l;
      if (!(err <= worst)) worst = err, worst_call = c, worst_layer = l;
    }
  }
  std::printf("%s on cuda (%s): worst relative L2 %.3g (call %d, layer %d) over %lld rows, %lld rows left out "
              "for other picks; picks equal on %lld of %lld unambiguous index rows\n",
              gc.name.c_str(), precision_name(gc.precision), worst, worst_call, worst_layer,
              static_cast<long long>(rows_compared), static_cast<long long>(rows_other_picks),
              static_cast<long long>(picks_equal), static_cast<long long>(pick_rows));
  RecordProperty("measured_worst_rel_l2", std::to_string(worst));
  RecordProperty("measured_pick_agreement", std::to_string(static_cast<double>(picks_equal) / std::max<int64_t>(pick_rows, 1)));
  EXPECT_GT(pick_rows, 100);
  EXPECT_GE(static_cast<double>(picks_equal), gc.min_pick_agreement * static_cast<double>(pick_rows));
  EXPECT_GE(rows_compared, 4 * rows_other_picks);
}

INSTANTIATE_TEST_SUITE_P(Sets, GoldenCuda,
                         ::testing::Values(GoldenCase{"v41a", Precision::reference, "topk_pos"},
                                           GoldenCase{"v40a", Precision::fp32, "topk", 1.0, kFp32Acceptance},
                                           GoldenCase{"v40o_a", Precision::reference, "topk_pos", 1.0}),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) { return info.param.name; });

// v41ds_a (DeepSeek's official V4.1 DSpark draft layers, SPEC §13.1) through a CUDA drafter in
// reference precision with the default (v4.1-native) formats: every call's context rows, then each
// draft call's block through the three stages, as tests/golden_v41ds_test.cpp replays it on the
// CPU. Outputs per call and stage within the acceptance bound of the golden set and of a CPU
// drafter over the same paged formats; the final window rings equal the recorded ones.
std::unique_ptr<Engine> dspark_drafter(const GoldenSet& g, Backend backend) {
  EngineOptions options;
  options.backend = backend;
  options.precision = Precision::reference;
  options.layers = LayerSet::draft;
  options.max_sequences = g.batch;
  options.max_context = 128;
  options.max_tokens_per_step = 128;
  return Engine::create(g.config, g.weights, options);
}

TEST_F(CudaTest, GoldenV41DsparkDraftLayers) {
  const GoldenSet g = golden::load_golden_set("v41ds_a");
  const std::unique_ptr<Engine> gpu = dspark_drafter(g, Backend::cuda), cpu = dspark_drafter(g, Backend::cpu);
  std::vector<SequenceId> gpu_sequences, cpu_sequences;
  double worst_golden = 0, sum_golden = 0, worst_cpu = 0;
  int compared = 0;
  for (int c = 0; c < g.num_calls; ++c) {
    const std::vector<std::vector<float>> mine = golden::replay_dspark_call(*gpu, g, c, gpu_sequences);
    const std::vector<std::vector<float>> cpu_out = golden::replay_dspark_call(*cpu, g, c, cpu_sequences);
    ASSERT_EQ(mine.size(), cpu_out.size()) << "call " << c;
    for (int s = 0; s < static_cast<int>(mine.size()); ++s) {
      const std::vector<float> expected = g.floats(GoldenSet::layer_name(c, s, "attn_out"));
      ASSERT_EQ(mine[s].size(), expected.size());
      const int64_t n = static_cast<int64_t>(expected.size());
      const double to_golden = golden::relative_l2(mine[s].data(), expected.data(), n);
      const double to_cpu = golden::relative_l2(mine[s].data(), cpu_out[s].data(), n);
      EXPECT_LE(to_golden, kAcceptance) << "call " << c << " stage " << s;
      EXPECT_LE(to_cpu, kAcceptance) << "call " << c << " stage " << s << " against the CPU drafter";
      worst_golden = std::max(worst_golden, to_golden);
      sum_golden += to_golden;
      worst_cpu = std::max(worst_cpu, to_cpu);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 15 * 3);
  std::printf("v41ds_a on cuda: %d call x stage outputs, relative L2 to the golden set mean %.3g, worst %.3g; "
              "to the CPU drafter worst %.3g\n",
              compared, sum_golden / std::max(compared, 1), worst_golden, worst_cpu);
  RecordProperty("measured_worst_rel_l2", std::to_string(worst_golden));
  RecordProperty("measured_worst_rel_l2_to_cpu", std::to_string(worst_cpu));

  // The rings after the last call: the FP8 context rows of each sequence's last W positions
  // (slot = position % W in the recorded ring); the blocks' keys never entered them. The CPU
  // drafter reproduces them bit for bit (golden_v41ds_test). Here main_proj is a cuBLASLt GEMM that
  // sums in another order than the official code, so a row whose value sits on an FP8 rounding
  // boundary may take the neighbouring code: a handful of values in a stage's batch x W x head_dim
  // = 2 x 16 x 512 (measured on an H200: 2 values, both in stage 1), each one FP8 step from the
  // recorded one. Allowed: at most 1 in 4096 values per stage (4), each within one e4m3 step (2^-3
  // relative).
  const auto& engine = dynamic_cast<const cuda::CudaEngine&>(*gpu);
  const int64_t W = g.config.sliding_window, D = g.config.head_dim;
  int64_t differing_in_all = 0;
  for (int s = 0; s < g.config.num_mtp_layers; ++s) {
    const std::vector<float> expected = g.floats("state.layers." + std::to_string(s) + ".window_kv");
    ASSERT_EQ(static_cast<int64_t>(expected.size()), g.batch * W * D);
    int64_t differing = 0;
    for (int64_t b = 0; b < g.batch; ++b) {
      const SequenceId id = gpu_sequences[static_cast<size_t>(b)];
      const int64_t length = gpu->sequence_length(id);
      ASSERT_GE(length, W);
      const std::vector<float> rows = engine.window_rows(id, g.config.num_layers + s, length - W, W);
      for (int64_t pos = length - W; pos < length; ++pos)
        for (int64_t d = 0; d < D; ++d) {
          const float mine = rows[(pos - length + W) * D + d], recorded = expected[(b * W + pos % W) * D + d];
          if (mine == recorded) continue;
          ++differing;
          EXPECT_LE(std::abs(mine - recorded), 0.125f * std::abs(recorded) + 1e-30f)
              << "stage " << s << " sequence " << b << " position " << pos << " channel " << d;
        }
    }
    EXPECT_LE(differing * 4096, g.batch * W * D) << "stage " << s << ": " << differing << " of "
                                                  << g.batch * W * D << " ring values differ";
    differing_in_all += differing;
  }
  std::printf("v41ds_a on cuda: %lld values of the final rings differ from the recorded ones\n",
              static_cast<long long>(differing_in_all));
}

}  // namespace
}  // namespace dsv4

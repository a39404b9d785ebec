// The V4.1 reference against the golden vectors of DeepSeek's official V4.1 inference code
// (tests/data/golden/v41a.*): every call of the schedule through every layer in reference
// precision, compared per call and layer on the rows whose top-k selection is unique.
#include <gtest/gtest.h>

#include <cstdio>
#include <limits>
#include <numeric>
#include <span>

#include "engine/cpu_engine.h"
#include "golden_util.h"

namespace dsv4 {
namespace {

using golden::GoldenSet;
using golden::usable_rows;

// Per call and layer, relative L2 on non-ambiguous rows. README.upstream.md's acceptance bound is
// 2e-2 (what `dsv4 compare` accepts); this test asserts what the reference achieves: measured
// 1.86e-3 (call 10, layer 4), from bf16 roundings that land the other way after the official
// code's GEMMs sum in another order. Bound about twice that: a bug that doubles the error fails.
constexpr double kTolerance = 4e-3;

// Index scores and candidate flags the engine published vs the recorded ones, on rows whose
// selection is unique.
struct IndexAgreement {
  int64_t scores_compared = 0, scores_differing = 0;
  double max_score_difference = 0;
  int64_t flags_compared = 0, flags_differing = 0;
};

void compare_index_diagnostics(const GoldenSet& g, const CpuEngine& engine, int c, IndexAgreement& a) {
  const int64_t rows = g.batch * g.call_tokens(c);
  for (int l = 0; l < g.config.num_layers; ++l) {
    if (!g.topology[l].owns_indexer) continue;
    const std::vector<uint8_t> usable = usable_rows(g, c, l);
    const reference::LayerPublication& p = engine.publication(l);
    const std::string score_name = GoldenSet::layer_name(c, l, "index_score");
    const int64_t n = g.shape(score_name)[2];
    const std::vector<float> scores = g.floats(score_name);
    for (int64_t r = 0; r < rows; ++r) {
      if (!usable[r]) continue;
      ASSERT_EQ(p.index_scores.length(r), n) << "call " << c << " layer " << l << " row " << r;
      for (int64_t j = 0; j < n; ++j) {
        const float mine = p.index_scores.row(r)[j], expected = scores[r * n + j];
        ++a.scores_compared;
        if (mine == expected) continue;
        ++a.scores_differing;
        a.max_score_difference = std::max(a.max_score_difference, std::abs(static_cast<double>(mine) - expected));
      }
    }
    if (!g.topology[l].is_candidate_source) continue;
    // A tie at the candidate cut is flagged on the layers that apply the candidates.
    std::vector<uint8_t> unique_cut(static_cast<size_t>(rows), 1);
    for (int u = 0; u < g.config.num_layers; ++u)
      if (g.topology[u].uses_candidates)
        for (int64_t r = 0; r < rows; ++r) unique_cut[r] &= usable_rows(g, c, u)[r];
    const std::vector<float> mask = g.floats(GoldenSet::call_name(c, "cand_mask"));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; unique_cut[r] && j < n; ++j) {
        ++a.flags_compared;
        if ((p.candidate_mask.row(r)[j] != 0) != (mask[r * n + j] != 0)) ++a.flags_differing;
      }
  }
}

struct Replayed {
  GoldenSet golden;
  std::unique_ptr<Engine> engine;
  std::vector<SequenceId> sequences;
  std::vector<golden::CallOutputs> outputs;  // per call
  IndexAgreement index_agreement;
};

const Replayed& replayed() {
  static const Replayed r = [] {
    Replayed r{golden::load_golden_set("v41a"), nullptr, {}, {}, {}};
    EngineOptions options;
    options.precision = Precision::reference;
    options.cache_storage = CacheStorage::float_rows;
    r.engine = Engine::create(r.golden.config, r.golden.weights, options);
    auto& cpu = dynamic_cast<CpuEngine&>(*r.engine);
    cpu.set_record_index_scores(true);
    for (int64_t b = 0; b < r.golden.batch; ++b) r.sequences.push_back(r.engine->add_sequence());
    for (int c = 0; c < r.golden.num_calls; ++c) {
      r.outputs.push_back(golden::replay_call(*r.engine, r.golden, c, r.sequences));
      compare_index_diagnostics(r.golden, cpu, c, r.index_agreement);
    }
    return r;
  }();
  return r;
}

TEST(GoldenV41, ScheduleShape) {
  const GoldenSet& g = replayed().golden;
  EXPECT_EQ(g.config.family, ModelFamily::v4_1);
  EXPECT_EQ(g.batch, 2);
  EXPECT_EQ(g.num_calls, 34);
  EXPECT_EQ(g.call_tokens(0), 37);
}

TEST(GoldenV41, AttentionOutputsMatchOnNonAmbiguousRows) {
  const Replayed& r = replayed();
  golden::expect_outputs_match(r.golden, r.outputs, kTolerance, "v41a reference precision");
}

TEST(GoldenV41, PicksMatchOnNonAmbiguousRows) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  const int64_t k = g.config.index_topk;
  for (int c = 0; c < g.num_calls; ++c)
    for (int l = 0; l < g.config.num_layers; ++l) {
      if (!g.topology[l].owns_indexer) continue;
      const std::vector<float> expected = g.floats(GoldenSet::layer_name(c, l, "topk_pos"));
      const std::vector<uint8_t> usable = usable_rows(g, c, l);
      ASSERT_EQ(expected.size(), r.outputs[c].picks[l].size()) << "call " << c << " layer " << l;
      for (size_t row = 0; row < usable.size(); ++row) {
        if (!usable[row]) continue;
        for (int64_t i = 0; i < k; ++i)
          ASSERT_EQ(r.outputs[c].picks[l][row * k + i], static_cast<int32_t>(expected[row * k + i]))
              << "call " << c << " layer " << l << " row " << row << " pick " << i;
      }
    }
}

// The reference's index scores are bf16 sums of bf16 terms; computed the same way they agree
// exactly, and so do the candidate flags wherever the block cut is unique.
TEST(GoldenV41, IndexScoresAndCandidatesMatchOnNonAmbiguousRows) {
  const IndexAgreement& a = replayed().index_agreement;
  std::printf("v41a index scores: %lld of %lld differ (max %.3g); candidate flags: %lld of %lld differ\n",
              static_cast<long long>(a.scores_differing), static_cast<long long>(a.scores_compared),
              a.max_score_difference, static_cast<long long>(a.flags_differing),
              static_cast<long long>(a.flags_compared));
  EXPECT_GT(a.scores_compared, 10000);
  EXPECT_EQ(a.scores_differing, 0);
  EXPECT_GT(a.flags_compared, 1000);
  EXPECT_EQ(a.flags_differing, 0);
}

// The batch rows in steps of their own (the second row first) give bitwise the outputs of the
// batched run: nothing of a sequence's computation depends on the other sequences of its step.
TEST(GoldenV41, SequencesInSeparateStepsMatchTheBatchedRun) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  EngineOptions options;
  options.precision = Precision::reference;
  options.cache_storage = CacheStorage::float_rows;
  auto engine = Engine::create(g.config, g.weights, options);
  std::vector<SequenceId> sequences;
  std::vector<std::vector<int64_t>> steps;
  for (int64_t b = 0; b < g.batch; ++b) {
    sequences.push_back(engine->add_sequence());
    steps.insert(steps.begin(), {b});
  }
  for (int c = 0; c < g.num_calls; ++c) {
    const golden::CallOutputs split = golden::replay_call(*engine, g, c, sequences, steps);
    for (int l = 0; l < g.config.num_layers; ++l) {
      ASSERT_EQ(split.attn_out[l], r.outputs[c].attn_out[l]) << "call " << c << " layer " << l;
      ASSERT_EQ(split.picks[l], r.outputs[c].picks[l]) << "call " << c << " layer " << l;
    }
  }
}

// The caches after the last call: window rows (slot = position % window), compressed entries,
// index keys and the ratio-2 compressor state.
TEST(GoldenV41, FinalCachesMatch) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  const auto& cpu = dynamic_cast<const CpuEngine&>(*r.engine);
  const int64_t W = g.config.sliding_window, D = g.config.head_dim, dI = g.config.index_head_dim;
  for (int l = 0; l < g.config.num_layers; ++l) {
    const std::string prefix = "state.layers." + std::to_string(l) + ".";
    std::vector<float> window, compressed, keys, kv_state, score_state;
    const reference::CacheStore& store = cpu.cache_store();
    for (SequenceId s : r.sequences) {
      const int64_t length = store.length(s);
      std::vector<float> rows(static_cast<size_t>(W * D)), ring(rows.size());
      store.read_window_rows(s, l, length - W, W, rows.data());
      for (int64_t i = 0; i < W; ++i)
        std::copy_n(rows.data() + i * D, D, ring.data() + ((length - W + i) % W) * D);
      window.insert(window.end(), ring.begin(), ring.end());
      if (!g.topology[l].owns_compressor) continue;
      const int64_t n = store.compressed_entries(s, l);
      std::vector<int64_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      std::vector<float> entries(static_cast<size_t>(n * D)), k(static_cast<size_t>(n * dI));
      store.read_compressed_entries(s, l, all.data(), n, entries.data());
      store.read_index_keys(s, l, 0, n, k.data());
      compressed.insert(compressed.end(), entries.begin(), entries.end());
      keys.insert(keys.end(), k.begin(), k.end());
      // The ring rows are [kv | score] per slot.
      const std::span<const float> c = store.compressor_state(s, l);
      for (size_t slot = 0; g.topology[l].compress_ratio > 1 && slot < c.size() / (2 * D); ++slot) {
        kv_state.insert(kv_state.end(), c.begin() + slot * 2 * D, c.begin() + slot * 2 * D + D);
        score_state.insert(score_state.end(), c.begin() + slot * 2 * D + D, c.begin() + (slot + 1) * 2 * D);
      }
    }
    const auto check = [&](const std::string& name, const std::vector<float>& mine, double tolerance) {
      const std::vector<float> expected = g.floats(prefix + name);
      ASSERT_EQ(mine.size(), expected.size()) << prefix << name;
      const double err = golden::relative_l2(mine.data(), expected.data(), static_cast<int64_t>(mine.size()));
      EXPECT_LE(err, tolerance) << prefix << name;
      std::printf("v41a %s%s: relative L2 error %.3g\n", prefix.c_str(), name.c_str(), err);
    };
    // Fake-quantized rows: measured 0 on every layer (bit equality with the official code's
    // caches), asserted so; a single flipped FP8 / FP4 code (~1e-3) is a change to look at. The
    // compressor state is fp32: measured 6.1e-8, bound 2e-7 (3x, fp32 summation order).
    check("window_kv", window, 0.0);
    if (!g.topology[l].owns_compressor) continue;
    check("compress_kv", compressed, 0.0);
    check("index_k", keys, 0.0);
    if (g.topology[l].compress_ratio > 1) {
      check("compressor_kv_state", kv_state, 2e-7);
      check("compressor_score_state", score_state, 2e-7);
    }
  }
}

}  // namespace
}  // namespace dsv4

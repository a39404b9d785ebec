// The V4.0 reference against the golden vectors of DeepSeek's official V4.0 inference code
// (tests/data/golden/v40o_a.*, README.upstream.md): sliding, CSA (ratio 4, own indexer) and HCA
// (ratio 16) layers over a 45-token prefill and 51 decode steps, in reference precision with the
// official indexer's QAT (Hadamard + FP4 on index queries and keys, SPEC §15), which its ModelArgs
// config selects. Every float tensor of the set is stored as bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <optional>

#include "engine/cpu_engine.h"
#include "golden_util.h"

namespace dsv4 {
namespace {

using golden::GoldenSet;
using golden::masked_relative_l2;
using golden::usable_rows;

// Per call and layer, relative L2 on non-ambiguous rows. The README's acceptance bound is 2e-2;
// measured 7.4e-3 (call 25, layer 1), about 5e-3 on every layer, sliding ones included: the
// layer's GEMMs round to bf16 after another summation order than the official code's, and V4.0's
// per-head q normalization makes the logits large (|q| = √512), so a 1-ulp change of q moves the
// peaked softmax visibly (the README measures 3.3e-3 for the same model.py under cuBLAS). Bound
// 1.5e-2: under the acceptance bound, and a wrong pick on a non-ambiguous row costs more.
constexpr double kTolerance = 1.5e-2;

struct Replayed {
  GoldenSet golden;
  std::unique_ptr<Engine> engine;
  std::vector<SequenceId> sequences;
  std::vector<golden::CallOutputs> outputs;  // per call
  int64_t scores_compared = 0, scores_differing = 0;
};

// Replays the whole schedule; `indexer_qat` overrides what the config selects.
Replayed replay(std::optional<bool> indexer_qat) {
  Replayed r{golden::load_golden_set("v40o_a"), nullptr, {}, {}};
  ModelConfig config = r.golden.config;
  if (indexer_qat) config.indexer_qat = *indexer_qat;
  EngineOptions options;
  options.precision = Precision::reference;
  options.cache_storage = CacheStorage::float_rows;
  r.engine = Engine::create(config, r.golden.weights, options);
  auto& cpu = dynamic_cast<CpuEngine&>(*r.engine);
  cpu.set_record_index_scores(true);
  for (int64_t b = 0; b < r.golden.batch; ++b) r.sequences.push_back(r.engine->add_sequence());
  const GoldenSet& g = r.golden;
  for (int c = 0; c < g.num_calls; ++c) {
    r.outputs.push_back(golden::replay_call(*r.engine, g, c, r.sequences));
    // The bf16 index scores the official top-k ran on (−inf where masked), on unambiguous rows.
    const int l = 1;
    const std::string name = GoldenSet::layer_name(c, l, "index_score");
    const std::vector<float> expected = g.floats(name);
    const int64_t n = g.shape(name)[2];
    const std::vector<uint8_t> usable = usable_rows(g, c, l);
    const reference::LayerPublication& p = cpu.publication(l);
    for (size_t row = 0; row < usable.size(); ++row) {
      if (!usable[row]) continue;
      EXPECT_EQ(p.index_scores.length(static_cast<int64_t>(row)), n) << "call " << c << " row " << row;
      for (int64_t j = 0; j < std::min(n, p.index_scores.length(static_cast<int64_t>(row))); ++j) {
        ++r.scores_compared;
        r.scores_differing += p.index_scores.row(static_cast<int64_t>(row))[j] != expected[row * n + j];
      }
    }
  }
  return r;
}

const Replayed& replayed() {
  static const Replayed r = replay(std::nullopt);
  return r;
}

TEST(GoldenV40o, ScheduleShapeAndConfig) {
  const GoldenSet& g = replayed().golden;
  EXPECT_EQ(g.config.family, ModelFamily::v4_0);
  EXPECT_TRUE(g.config.indexer_qat);  // the ModelArgs form: DeepSeek's own code
  EXPECT_EQ(g.config.compress_ratios, (std::vector<int>{0, 4, 16}));
  EXPECT_EQ(g.topology[1].kind, AttentionKind::csa);
  EXPECT_EQ(g.topology[2].kind, AttentionKind::hca);
  EXPECT_EQ(g.batch, 2);
  EXPECT_EQ(g.num_calls, 52);
  EXPECT_EQ(g.call_tokens(0), 45);
  EXPECT_EQ(g.calls->at(GoldenSet::layer_name(0, 0, "hidden_in")).dtype, DType::bf16);
}

TEST(GoldenV40o, AttentionOutputsMatchOnNonAmbiguousRows) {
  const Replayed& r = replayed();
  golden::expect_outputs_match(r.golden, r.outputs, kTolerance, "v40o_a reference precision");
}

// topk_pos [B, S, min(8, end / 4)]: ascending, −1 padded; the engine's picks [.., 8] likewise.
TEST(GoldenV40o, PicksEqualOnEveryNonAmbiguousRow) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  const int64_t k = g.config.index_topk;
  int64_t rows = 0;
  for (int c = 0; c < g.num_calls; ++c) {
    const std::string name = GoldenSet::layer_name(c, 1, "topk_pos");
    const int64_t width = g.shape(name)[2];
    const std::vector<float> expected = g.floats(name);
    const std::vector<uint8_t> usable = usable_rows(g, c, 1);
    for (size_t row = 0; row < usable.size(); ++row) {
      if (!usable[row]) continue;
      ++rows;
      for (int64_t i = 0; i < k; ++i)
        ASSERT_EQ(r.outputs[c].picks[1][row * k + i], i < width ? static_cast<int32_t>(expected[row * width + i]) : -1)
            << "call " << c << " row " << row << " pick " << i;
    }
  }
  EXPECT_EQ(rows, 2 * 96 - 9);  // every row but the 9 flagged ambiguous
}

// Computed as the official code computes them (Hadamard, FP4, bf16 einsum and head sum), the index
// scores agree bit for bit but where an index query's bf16 GEMM output rounded the other way
// before its FP4 quantization: measured 6 of 2625 differ; bound 1%.
TEST(GoldenV40o, IndexScoresMatchOnNonAmbiguousRows) {
  const Replayed& r = replayed();
  std::printf("v40o_a index scores: %lld of %lld differ\n", static_cast<long long>(r.scores_differing),
              static_cast<long long>(r.scores_compared));
  EXPECT_GT(r.scores_compared, 2000);
  EXPECT_LE(r.scores_differing * 100, r.scores_compared);
}

// The caches after the last call: window rows (slot = position % window), compressed entries and
// the indexer's keys, all fake-quantized as the official code stores them.
TEST(GoldenV40o, FinalCachesMatch) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  const auto& cpu = dynamic_cast<const CpuEngine&>(*r.engine);
  const reference::CacheStore& store = cpu.cache_store();
  const int64_t W = g.config.sliding_window, D = g.config.head_dim, dI = g.config.index_head_dim;
  for (int l = 0; l < g.config.num_layers; ++l) {
    const std::string prefix = "state.layers." + std::to_string(l) + ".";
    std::vector<float> window, compressed, keys;
    for (SequenceId s : r.sequences) {
      const int64_t length = store.length(s);
      std::vector<float> rows(static_cast<size_t>(W * D)), ring(rows.size());
      store.read_window_rows(s, l, length - W, W, rows.data());
      for (int64_t i = 0; i < W; ++i) std::copy_n(rows.data() + i * D, D, ring.data() + ((length - W + i) % W) * D);
      window.insert(window.end(), ring.begin(), ring.end());
      if (!g.topology[l].owns_compressor) continue;
      const int64_t n = store.compressed_entries(s, l);
      std::vector<int64_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      std::vector<float> entries(static_cast<size_t>(n * D));
      store.read_compressed_entries(s, l, all.data(), n, entries.data());
      compressed.insert(compressed.end(), entries.begin(), entries.end());
      if (!g.topology[l].owns_index_keys) continue;
      std::vector<float> k(static_cast<size_t>(n * dI));
      store.read_index_keys(s, l, 0, n, k.data());
      keys.insert(keys.end(), k.begin(), k.end());
    }
    const auto check = [&](const std::string& name, const std::vector<float>& mine, double tolerance) {
      const std::vector<float> expected = g.floats(prefix + name);
      ASSERT_EQ(mine.size(), expected.size()) << prefix << name;
      const double err = golden::relative_l2(mine.data(), expected.data(), static_cast<int64_t>(mine.size()));
      std::printf("v40o_a %s%s: relative L2 error %.3g\n", prefix.c_str(), name.c_str(), err);
      EXPECT_LE(err, tolerance) << prefix << name;
    };
    // Measured: every ring and the index keys (Hadamard + FP4) bit-exact; the CSA layer's
    // compressed rows 3.1e-5 (an FP8 code of an fp32 pooled sum that rounds the other way).
    check("window_kv", window, 0.0);
    if (g.topology[l].owns_compressor) check("compress_kv", compressed, 1e-4);
    if (g.topology[l].owns_index_keys) check("index_k", keys, 0.0);
  }
}

// Without the QAT (transformers' V4.0 numerics, config.indexer_qat false) the CSA layer's picks
// differ from the official code's on many rows: the option is what makes the set replay.
TEST(GoldenV40o, WithoutIndexerQatTheCsaLayerMisses) {
  const Replayed r = replay(false);
  const GoldenSet& g = r.golden;
  double worst = 0;
  for (int c = 0; c < g.num_calls; ++c)
    worst = std::max(worst, masked_relative_l2(r.outputs[c].attn_out[1], g.floats(GoldenSet::layer_name(c, 1, "attn_out")),
                                               usable_rows(g, c, 1), g.config.hidden_size));
  std::printf("v40o_a without the indexer QAT: worst relative L2 error %.3g on the CSA layer\n", worst);
  EXPECT_GT(worst, 2e-2);
}

}  // namespace
}  // namespace dsv4

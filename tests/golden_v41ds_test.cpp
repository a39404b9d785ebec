// The DSpark draft layers of the CPU reference against the golden vectors of DeepSeek's official
// V4.1 inference code (tests/data/golden/v41ds_a.*, `DSparkAttention` driven as forward_spec
// drives it): every call through a drafter engine in reference precision, compared per call and
// stage, the final window rings bit for bit (SPEC §13.1).
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>

#include "engine/cpu_engine.h"
#include "golden_util.h"
#include "reference/layer.h"

namespace dsv4 {
namespace {

using golden::GoldenSet;

// README.upstream.md: an implementation rounding where the reference rounds lands near 1e-3 (an
// independent replay: mean 3e-4, at most 1.6e-3); 2e-2 is the acceptance bound (`dsv4 compare`).
// This test asserts about twice the worst measured here, so that a real error fails.
constexpr double kTolerance = 4e-3;

struct Replayed {
  GoldenSet golden;
  std::unique_ptr<Engine> engine;
  std::vector<SequenceId> sequences;
  std::vector<std::vector<std::vector<float>>> outputs;  // per call, per stage
};

std::unique_ptr<Engine> drafter(const GoldenSet& g, CacheStorage storage) {
  EngineOptions options;
  options.precision = Precision::reference;
  options.cache_storage = storage;
  options.layers = LayerSet::draft;
  options.max_sequences = g.batch;
  options.max_context = 128;
  options.max_tokens_per_step = 128;
  return Engine::create(g.config, g.weights, options);
}

const Replayed& replayed() {
  static const Replayed r = [] {
    Replayed r{golden::load_golden_set("v41ds_a"), nullptr, {}, {}};
    r.engine = drafter(r.golden, CacheStorage::float_rows);
    for (int c = 0; c < r.golden.num_calls; ++c)
      r.outputs.push_back(golden::replay_dspark_call(*r.engine, r.golden, c, r.sequences));
    return r;
  }();
  return r;
}

TEST(GoldenV41Dspark, Topology) {
  const GoldenSet& g = replayed().golden;
  EXPECT_TRUE(g.config.has_dspark());
  EXPECT_EQ(g.config.dspark_block_size, 5);
  EXPECT_EQ(g.config.dspark_target_layer_ids, (std::vector<int>{1, 2}));
  ASSERT_EQ(g.topology.size(), 6);
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(g.topology[l].kind, l < 3 ? AttentionKind::sliding : AttentionKind::dspark) << l;
    EXPECT_EQ(g.topology[l].dspark_stage, l < 3 ? -1 : l - 3) << l;
    EXPECT_FALSE(g.topology[l].uses_compress_rope);
  }
  EXPECT_EQ(g.layers, LayerSet::draft);
  EXPECT_TRUE(g.weights->layers[3].has(WeightRole::main_proj));
  EXPECT_FALSE(g.weights->layers[4].has(WeightRole::main_proj));
  EXPECT_FALSE(g.weights->layers[0].has(WeightRole::wq_a));  // the backbone is not loaded
}

// main_x = main_norm(main_proj(main_hidden)) is recorded as main_in.
TEST(GoldenV41Dspark, MainInputMatchesTheReference) {
  const GoldenSet& g = replayed().golden;
  const reference::LayerParameters stage0 = reference::prepare_layer(
      g.config, layer_recipe(g.config, g.topology[3], Precision::reference), g.weights->layers[3]);
  int64_t values = 0, differing = 0;
  for (int c = 0; c < g.num_calls; ++c) {
    const std::vector<float> hidden = g.floats(GoldenSet::call_name(c, "main_hidden"));
    const std::vector<float> expected = g.floats(GoldenSet::call_name(c, "main_in"));
    std::vector<float> mine(expected.size());
    const int64_t rows = static_cast<int64_t>(expected.size()) / g.config.hidden_size;
    reference::draft_main_input(g.config, stage0, rows, hidden.data(), mine.data());
    EXPECT_LT(golden::relative_l2(mine.data(), expected.data(), static_cast<int64_t>(mine.size())), 4e-3) << c;
    for (size_t i = 0; i < mine.size(); ++i) differing += mine[i] != expected[i];
    values += static_cast<int64_t>(mine.size());
  }
  std::printf("main_in: %lld of %lld values differ from the reference's\n", static_cast<long long>(differing),
              static_cast<long long>(values));
}

TEST(GoldenV41Dspark, OutputsMatchPerCallAndStage) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  double worst = 0, sum = 0;
  int compared = 0;
  for (int c = 0; c < g.num_calls; ++c) {
    const bool draft = g.has(GoldenSet::layer_name(c, 0, "attn_out"));
    ASSERT_EQ(r.outputs[c].size(), draft ? static_cast<size_t>(g.config.num_mtp_layers) : 0u) << "call " << c;
    for (int s = 0; s < static_cast<int>(r.outputs[c].size()); ++s) {
      const std::vector<float> expected = g.floats(GoldenSet::layer_name(c, s, "attn_out"));
      ASSERT_EQ(expected.size(), r.outputs[c][s].size());
      const double e = golden::relative_l2(r.outputs[c][s].data(), expected.data(), static_cast<int64_t>(expected.size()));
      EXPECT_LT(e, kTolerance) << "call " << c << " stage " << s;
      worst = std::max(worst, e);
      sum += e;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 15 * 3);
  std::printf("v41ds_a: %d call x stage outputs, relative L2 mean %.3g, worst %.3g\n", compared, sum / compared, worst);
}

// The rings after the last call hold the FP8 context rows of the second sequence's last 16
// positions (slot = position % window); the blocks' keys never entered them.
void expect_final_rings_equal(const Replayed& r, const reference::CacheStore& store) {
  const GoldenSet& g = r.golden;
  const int64_t W = g.config.sliding_window, D = g.config.head_dim;
  for (int s = 0; s < g.config.num_mtp_layers; ++s) {
    const std::vector<float> expected = g.floats("state.layers." + std::to_string(s) + ".window_kv");
    ASSERT_EQ(static_cast<int64_t>(expected.size()), g.batch * W * D);
    int64_t differing = 0;
    for (int64_t b = 0; b < g.batch; ++b) {
      const SequenceId id = r.sequences[static_cast<size_t>(b)];
      const int64_t length = store.length(id);
      ASSERT_GE(length, W);
      std::vector<float> rows(static_cast<size_t>(W * D));
      store.read_window_rows(id, g.config.num_layers + s, length - W, W, rows.data());
      for (int64_t pos = length - W; pos < length; ++pos)
        for (int64_t d = 0; d < D; ++d)
          differing += rows[(pos - length + W) * D + d] != expected[(b * W + pos % W) * D + d];
    }
    EXPECT_EQ(differing, 0) << "stage " << s;
  }
}

TEST(GoldenV41Dspark, FinalRingsEqual) {
  const Replayed& r = replayed();
  expect_final_rings_equal(r, dynamic_cast<const CpuEngine&>(*r.engine).cache_store());
}

// The paged caches in the V4.1 formats hold the FP8 rows exactly: the same outputs bit for bit.
TEST(GoldenV41Dspark, PagedCachesGiveTheSameOutputs) {
  const Replayed& r = replayed();
  Replayed paged{golden::load_golden_set("v41ds_a"), drafter(r.golden, CacheStorage::paged), {}, {}};
  for (int c = 0; c < paged.golden.num_calls; ++c)
    EXPECT_EQ(golden::replay_dspark_call(*paged.engine, paged.golden, c, paged.sequences), r.outputs[c]) << c;
  expect_final_rings_equal(paged, dynamic_cast<const CpuEngine&>(*paged.engine).cache_store());
}

// SPEC §13.5 test A: the block is non-causal. Changing the last block row's key changes the
// earlier rows' outputs; a causal variant would leave row 0 unchanged. (Scaling a row would not:
// kv_norm normalizes it away; its negation flips the key.)
TEST(GoldenV41Dspark, LaterBlockRowsReachEarlierOnes) {
  const Replayed& r = replayed();
  const GoldenSet& g = r.golden;
  const int64_t B = g.config.dspark_block_size, H = g.config.hidden_size, rows = g.batch * B;
  const int c = g.num_calls - 1;
  std::vector<float> in = g.floats(GoldenSet::layer_name(c, 0, "hidden_in"));
  std::vector<float> base(static_cast<size_t>(rows * H)), changed(base.size());
  r.engine->run_draft_block(g.config.num_layers, r.sequences, TensorView::contiguous(in.data(), DType::f32, {rows, H}),
                            TensorView::contiguous(base.data(), DType::f32, {rows, H}));
  EXPECT_EQ(base, r.outputs[c][0]);  // a block leaves the caches unchanged: the same again
  for (int64_t i = 0; i < H; ++i) in[(B - 1) * H + i] = -in[(B - 1) * H + i];  // the last row of sequence 0's block
  r.engine->run_draft_block(g.config.num_layers, r.sequences, TensorView::contiguous(in.data(), DType::f32, {rows, H}),
                            TensorView::contiguous(changed.data(), DType::f32, {rows, H}));
  EXPECT_NE(std::vector<float>(base.begin(), base.begin() + H), std::vector<float>(changed.begin(), changed.begin() + H));
  // Sequence 1's block is its own.
  EXPECT_EQ(std::vector<float>(base.begin() + B * H, base.end()), std::vector<float>(changed.begin() + B * H, changed.end()));
}

TEST(GoldenV41Dspark, ProtocolErrors) {
  const GoldenSet& g = replayed().golden;
  const int64_t H = g.config.hidden_size, B = g.config.dspark_block_size;
  const std::unique_ptr<Engine> engine = drafter(g, CacheStorage::float_rows);
  const std::vector<SequenceId> sequences{engine->add_sequence(), engine->add_sequence()};
  std::vector<float> rows(static_cast<size_t>(g.batch * B * g.config.dspark_main_width()));
  const TensorView view = TensorView::contiguous(rows.data(), DType::f32, {g.batch * B, H});
  const auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { engine->run_draft_block(3, sequences, view, view); }).find("has no committed token"),
            std::string::npos);
  engine->begin_step({{sequences[0], 1}, {sequences[1], 1}});
  EXPECT_NE(message([&] { engine->run_draft_block(3, sequences, view, view); }).find("a step is in progress"),
            std::string::npos);
  EXPECT_NE(message([&] { engine->run_layer(3, view, view); }).find("is a DSpark draft layer"), std::string::npos);
  EXPECT_NE(message([&] { engine->run_layer(0, view, view); }).find("drafter engine"), std::string::npos);
  EXPECT_NE(message([&] { engine->run_draft_context(view); }).find("main_hidden has shape [10, 256], expected [2, 512]"),
            std::string::npos);
  engine->run_draft_context(TensorView::contiguous(rows.data(), DType::f32, {2, g.config.dspark_main_width()}));
  engine->end_step();
  EXPECT_NE(message([&] { engine->run_draft_block(0, sequences, view, view); }).find("not a DSpark draft layer"),
            std::string::npos);
  EXPECT_NE(message([&] { engine->run_draft_block(3, {sequences[0]}, view, view); })
                .find("hidden_in has shape [10, 256], expected [5, 256]"),
            std::string::npos);
  EXPECT_NE(message([&] { engine->run_draft_block(3, {sequences[0], sequences[0]}, view, view); }).find("given twice"),
            std::string::npos);
  // A step without the draft context leaves the draft windows incomplete.
  engine->begin_step({{sequences[1], 1}});
  engine->end_step();
  EXPECT_NE(message([&] { engine->run_draft_block(4, {sequences[1]}, view, view); }).find("skipped the draft context"),
            std::string::npos);
  engine->run_draft_block(4, {sequences[0]}, TensorView::contiguous(rows.data(), DType::f32, {B, H}),
                          TensorView::contiguous(rows.data(), DType::f32, {B, H}));
  // The block's positions stay below max_context (128), as a step's do.
  const std::unique_ptr<Engine> full = drafter(g, CacheStorage::float_rows);
  const SequenceId long_sequence = full->add_sequence();
  const int64_t committed = 124;
  std::vector<float> main_hidden(static_cast<size_t>(committed * g.config.dspark_main_width()), 0.5f);
  full->begin_step({{long_sequence, committed}});
  full->run_draft_context(
      TensorView::contiguous(main_hidden.data(), DType::f32, {committed, g.config.dspark_main_width()}));
  full->end_step();
  EXPECT_NE(message([&] {
              full->run_draft_block(3, {long_sequence}, TensorView::contiguous(rows.data(), DType::f32, {B, H}),
                                    TensorView::contiguous(rows.data(), DType::f32, {B, H}));
            }).find("sequence 0's block reaches position 128, beyond max_context 128 (positions 0 ... 127)"),
            std::string::npos);
}

}  // namespace
}  // namespace dsv4

// Tensor parallelism on the CPU (docs/parallel.md), no GPU needed:
//  * shard_config / shard_weights: the rank's heads, groups and index heads, each sliced tensor
//    against an independent slice of the full tensor's values (fp8 through its block scales),
//    replicated tensors shared, and the errors;
//  * tp = 2 and 4 rank engines, one thread each, summing through an in-process communicator,
//    against the unsharded CPU engine on a mixed workload (prefill chunks, decode tokens, a fork, a
//    release), fp32 and reference precision, replicated and split indexer.
// Tolerances (relative L2 per step and layer, worst over all 16 cases): fp32 measured 5.7e-8, bound
// 2e-7 (only the order of the fp32 sums differs); reference measured 1.3e-5, bound 4e-5 (the
// partial wo_b outputs are summed in fp32 and rounded to bf16 once, as the whole output is; a few
// roundings land on the other side). Rounding each rank's partial output to bf16 before the sum
// gives ~3e-3, a bug these bounds catch. The replicated indexer picks the
// same entries everywhere. The split indexer sums its partial scores in another order, so picks
// must be equal wherever the unsharded scores leave the cut wider than twice the largest score
// difference; outputs are compared on the rows whose picks are equal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/parallel.h"
#include "dsv4/weights.h"
#include "engine/cpu_engine.h"
#include "tensor_parallel_util.h"

namespace dsv4 {
namespace {

using tp_testing::Agreement;
using tp_testing::WorkloadOutputs;

constexpr uint64_t kWeightSeed = 7;
constexpr uint64_t kInputSeed = 11;

// The ranks of a group as threads of this process. all_reduce_sum waits until every rank called
// it, then adds the ranks' buffers in rank order into each of them: every rank gets the same bits.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : shared_(std::make_shared<Shared>()) {
    shared_->size = size;
    shared_->buffers.resize(static_cast<size_t>(size));
  }
  std::shared_ptr<Communicator> rank(int r) const { return std::make_shared<Rank>(shared_, r); }
  // A rank failed: every waiting and later all-reduce throws instead of waiting for it.
  void abort() const {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->aborted = true;
    shared_->changed.notify_all();
  }

 private:
  struct Shared {
    std::mutex mutex;
    std::condition_variable changed;
    int size = 0;
    int arrived = 0;
    int64_t count = 0;
    uint64_t generation = 0;
    bool aborted = false;
    std::vector<float*> buffers;
  };

  class Rank final : public Communicator {
   public:
    Rank(std::shared_ptr<Shared> shared, int rank) : shared_(std::move(shared)), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return shared_->size; }
    void all_reduce_sum(float* data, int64_t count, void* stream) override {
      DSV4_CHECK(stream == nullptr, "thread group: rank ", rank_, " was given a stream; it sums host memory");
      Shared& g = *shared_;
      std::unique_lock<std::mutex> lock(g.mutex);
      DSV4_CHECK(!g.aborted, "thread group: rank ", rank_, ": another rank failed");
      if (g.arrived == 0) g.count = count;
      if (count != g.count) {
        g.aborted = true;
        g.changed.notify_all();
        fail("thread group: rank ", rank_, " sums ", count, " floats, another rank ", g.count);
      }
      g.buffers[static_cast<size_t>(rank_)] = data;
      const uint64_t generation = g.generation;
      if (++g.arrived == g.size) {
        for (int64_t i = 0; i < count; ++i) {
          float sum = 0.0f;
          for (const float* b : g.buffers) sum += b[i];
          for (float* b : g.buffers) b[i] = sum;
        }
        g.arrived = 0;
        ++g.generation;
        g.changed.notify_all();
        return;
      }
      g.changed.wait(lock, [&] { return g.generation != generation || g.aborted; });
      DSV4_CHECK(g.generation != generation, "thread group: rank ", rank_, ": another rank failed");
    }

   private:
    std::shared_ptr<Shared> shared_;
    int rank_;
  };

  std::shared_ptr<Shared> shared_;
};

// The model a case runs: the preset for tp 2; for tp 4 four output groups (one head each), since
// the presets' two groups cannot be split four ways.
ModelConfig case_config(const std::string& preset, int tp) {
  ModelConfig c = preset_config(preset);
  if (tp == 4) {
    c.o_groups = 4;
    validate_config(c);
  }
  return c;
}

// tiny-v4.1 with fp8 projections (32 x 32 blocks: every head and group is whole blocks); tiny-v4's
// 128 x 128 blocks cut its 64-row groups, so it runs bf16 weights.
std::shared_ptr<const ModelWeights> case_weights(const ModelConfig& c) {
  return std::make_shared<const ModelWeights>(
      random_weights(c, resolve_topology(c), kWeightSeed, c.family == ModelFamily::v4_1));
}

// ---------------------------------------------------------------------------------------------
// Sharding

TEST(TensorParallelShard, ConfigHoldsTheRanksHeadsAndGroups) {
  const ModelConfig c = case_config("tiny-v4.1", 4);
  for (IndexerSharding indexer : {IndexerSharding::replicated, IndexerSharding::split}) {
    const ModelConfig s = shard_config(c, 3, 4, indexer);
    EXPECT_EQ(s.num_heads, c.num_heads / 4);
    EXPECT_EQ(s.o_groups, 1);
    EXPECT_EQ(s.index_n_heads, indexer == IndexerSharding::split ? c.index_n_heads / 4 : c.index_n_heads);
    EXPECT_EQ(s.tensor_parallel_size, 1);
    EXPECT_EQ(s.hidden_size, c.hidden_size);
    EXPECT_EQ(s.compress_ratios, c.compress_ratios);
    EXPECT_EQ(s.index_source_layers, c.index_source_layers);
  }
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(TensorParallelShard, ConfigErrorsNameFieldAndRule) {
  const ModelConfig c = preset_config("tiny-v4.1");
  expect_error([&] { shard_config(c, 0, 3, IndexerSharding::replicated); },
               {"num_heads", "divisible by tensor_parallel_size = 3"});
  expect_error([&] { shard_config(c, 0, 4, IndexerSharding::replicated); },
               {"o_groups", "tensor_parallel_size = 4"});
  expect_error([&] { shard_config(c, 2, 2, IndexerSharding::replicated); }, {"rank is 2", "expected 0 ... 1"});
  expect_error([&] { shard_config(c, 0, 0, IndexerSharding::replicated); }, {"tp is 0"});
  ModelConfig odd_index = c;
  odd_index.index_n_heads = 3;
  expect_error([&] { shard_config(odd_index, 0, 2, IndexerSharding::split); },
               {"index_n_heads' = 3", "tensor_parallel_size = 2", "split"});
  EXPECT_EQ(shard_config(odd_index, 1, 2, IndexerSharding::replicated).index_n_heads, 3);
  expect_error([] { parse_indexer_sharding("halved"); }, {"'halved'", "replicated or split"});
}

// Rows [first, first + count) (or, with `columns`, columns) of a [rows, cols] f32 tensor.
std::vector<float> reference_slice(const HostTensor& t, bool columns, int64_t first, int64_t count) {
  const int64_t rows = t.rank() == 2 ? t.size(0) : 1, cols = t.size(-1);
  std::vector<float> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = columns || t.rank() == 1 ? c : r;
      if (i >= first && i < first + count) out.push_back(t.as<float>()[r * cols + c]);
    }
  return out;
}

class ShardWeights : public ::testing::TestWithParam<std::tuple<std::string, int, IndexerSharding>> {};

TEST_P(ShardWeights, AreTheRanksSlicesOfTheFullTensors) {
  const auto& [preset, tp, indexer] = GetParam();
  const ModelConfig c = case_config(preset, tp);
  const ModelTopology topology = resolve_topology(c);
  const auto weights = case_weights(c);
  const int64_t heads = c.num_heads / tp, groups = c.o_groups / tp, index_heads = c.index_n_heads / tp;
  const bool split = indexer == IndexerSharding::split;
  for (int rank = 0; rank < tp; ++rank) {
    const ModelWeights shard = shard_weights(*weights, c, rank, tp, indexer);
    ASSERT_EQ(shard.layers.size(), weights->layers.size());
    for (int l = 0; l < c.total_layers(); ++l) {
      for (const ExpectedWeight& e : expected_layer_weights(c, topology[l])) {
        const WeightTensor& full = weights->layers[static_cast<size_t>(l)].get(e.role);
        const WeightTensor& part = shard.layers[static_cast<size_t>(l)].get(e.role);
        // Which rows (columns for wo_b) of the full tensor the rank holds, from the layout rules.
        bool columns = false;
        int64_t first = 0, count = -1;
        switch (e.role) {
          case WeightRole::wq_b: first = rank * heads * c.head_dim, count = heads * c.head_dim; break;
          case WeightRole::attn_sink: first = rank * heads, count = heads; break;
          case WeightRole::wo_a: first = rank * groups * c.o_lora_rank, count = groups * c.o_lora_rank; break;
          case WeightRole::wo_b:
            columns = true, first = rank * groups * c.o_lora_rank, count = groups * c.o_lora_rank;
            break;
          case WeightRole::indexer_wq_b:
            if (split) first = rank * index_heads * c.index_head_dim, count = index_heads * c.index_head_dim;
            break;
          case WeightRole::indexer_weights_proj:
            if (split) first = rank * index_heads, count = index_heads;
            break;
          default: break;
        }
        if (count < 0) {
          EXPECT_EQ(part.data, full.data) << "layer " << l << " " << weight_role_name(e.role) << " is replicated";
          continue;
        }
        EXPECT_EQ(part.dtype, full.dtype);
        const HostTensor part_values = part.to_f32();  // fp8: decoded with the sliced block scales
        const std::vector<float> expected = reference_slice(full.to_f32(), columns, first, count);
        ASSERT_EQ(part_values.numel(), static_cast<int64_t>(expected.size()))
            << "layer " << l << " " << weight_role_name(e.role);
        EXPECT_TRUE(std::equal(expected.begin(), expected.end(), part_values.as<float>()))
            << "rank " << rank << " layer " << l << " " << weight_role_name(e.role);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Presets, ShardWeights,
    ::testing::Values(std::tuple{"tiny-v4.1", 2, IndexerSharding::replicated},
                      std::tuple{"tiny-v4.1", 4, IndexerSharding::split},
                      std::tuple{"tiny-v4", 2, IndexerSharding::split}),
    [](const auto& info) {
      std::string name = std::get<0>(info.param) + "_tp" + std::to_string(std::get<1>(info.param)) + "_" +
                         indexer_sharding_name(std::get<2>(info.param));
      std::replace(name.begin(), name.end(), '-', '_');
      std::replace(name.begin(), name.end(), '.', '_');
      return name;
    });

TEST(TensorParallelShard, AbsentMtpLayerStaysAbsent) {
  const ModelConfig c = preset_config("tiny-v4.1");
  ModelWeights weights = random_weights(c, resolve_topology(c), kWeightSeed, false);
  weights.layers.back().tensors = {};  // the MTP layer, left out of a checkpoint
  const ModelWeights shard = shard_weights(weights, c, 1, 2, IndexerSharding::replicated);
  for (const auto& t : shard.layers.back().tensors) EXPECT_FALSE(t.has_value());
  EXPECT_EQ(shard.layers.front().get(WeightRole::wq_b).shape[0], c.num_heads / 2 * c.head_dim);
}

TEST(TensorParallelShard, Fp8SliceOffTheScaleBlocksThrows) {
  // tiny-v4: 64-row output groups, 128 x 128 fp8 blocks.
  const ModelConfig c = preset_config("tiny-v4");
  const ModelWeights weights = random_weights(c, resolve_topology(c), kWeightSeed, true);
  expect_error([&] { shard_weights(weights, c, 1, 2, IndexerSharding::replicated); },
               {"layer 0", "'attn.wo_a.weight'", "128-row scale blocks", "rows 64 ... 127", "block boundaries"});
}

TEST(TensorParallelShard, WrongWeightShapeThrows) {
  const ModelConfig c = preset_config("tiny-v4.1");
  ModelWeights weights = random_weights(c, resolve_topology(c), kWeightSeed, false);
  weights.layers[2].tensors[static_cast<size_t>(WeightRole::wo_b)]->shape = {c.hidden_size, 64};
  expect_error([&] { shard_weights(weights, c, 0, 2, IndexerSharding::replicated); },
               {"layer 2", "'attn.wo_b.weight'", "[256, 64]", "expected [256, 128]"});
}

TEST(TensorParallelEngine, SplitIndexerNeedsACommunicator) {
  const ModelConfig c = preset_config("tiny-v4.1");
  const auto weights = case_weights(c);
  EngineOptions options = tp_testing::workload_options(Backend::cpu, Precision::fp32);
  options.indexer_sharding = IndexerSharding::split;
  expect_error([&] { Engine::create(c, weights, options); }, {"indexer_sharding is split", "no communicator"});
  expect_error([&] { make_rank_shard(c, *weights, options, nullptr, IndexerSharding::split); }, {"no communicator"});
}

// ---------------------------------------------------------------------------------------------
// Rank engines against the unsharded engine

// A run's outputs and, per step and index-source layer, the masked scores its top-k ran on.
struct RecordedRun {
  WorkloadOutputs outputs;
  std::vector<std::map<int, reference::RaggedRows<float>>> scores;
};

RecordedRun run_recorded(Engine& engine) {
  auto& cpu = dynamic_cast<CpuEngine&>(engine);
  cpu.set_record_index_scores(true);
  RecordedRun run;
  run.scores.resize(tp_testing::mixed_workload().size());
  run.outputs = tp_testing::run_workload(engine, tp_testing::mixed_workload(), kInputSeed, [&](int step, int layer) {
    if (engine.topology()[layer].owns_indexer)
      run.scores[static_cast<size_t>(step)][layer] = cpu.publication(layer).index_scores;
  });
  return run;
}

// The unsharded engine's run of a case's model, computed once per model and precision.
const RecordedRun& whole_run(const std::string& preset, int tp, Precision precision) {
  static std::map<std::tuple<std::string, int, Precision>, RecordedRun> runs;
  const auto key = std::tuple{preset, tp, precision};
  auto it = runs.find(key);
  if (it != runs.end()) return it->second;
  const ModelConfig c = case_config(preset, tp);
  const auto engine = Engine::create(c, case_weights(c), tp_testing::workload_options(Backend::cpu, precision));
  return runs.emplace(key, run_recorded(*engine)).first->second;
}

// Whether the top-k sets of two score rows [n] must be equal: the same scores, or a gap at a's cut
// (k-th vs (k+1)-th largest eligible score) wider than twice the largest difference. −inf: not
// eligible; a −inf against a number, or a NaN, leaves the row undecided.
bool selection_decided(const float* a, const float* b, int64_t n, int64_t k) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  double largest_difference = 0.0;
  std::vector<float> eligible;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(a[j]) || std::isnan(b[j]) || ((a[j] == -kInf) != (b[j] == -kInf))) return false;
    if (a[j] == -kInf) continue;
    largest_difference = std::max(largest_difference, std::abs(static_cast<double>(a[j]) - b[j]));
    eligible.push_back(a[j]);
  }
  if (largest_difference == 0.0 || static_cast<int64_t>(eligible.size()) <= k) return true;
  std::sort(eligible.begin(), eligible.end(), std::greater<>());
  return static_cast<double>(eligible[static_cast<size_t>(k - 1)]) - eligible[static_cast<size_t>(k)] >
         2.0 * largest_difference;
}

struct TpCase {
  std::string preset;
  int tp;
  Precision precision;
  IndexerSharding indexer;
};

class TensorParallelCpu : public ::testing::TestWithParam<TpCase> {};

TEST_P(TensorParallelCpu, RanksSumToTheUnshardedEngine) {
  const TpCase& tc = GetParam();
  const ModelConfig c = case_config(tc.preset, tc.tp);
  const ModelTopology topology = resolve_topology(c);
  const auto weights = case_weights(c);
  const RecordedRun& whole = whole_run(tc.preset, tc.tp, tc.precision);

  EngineOptions options = tp_testing::workload_options(Backend::cpu, tc.precision);
  options.num_threads = 1;  // the ranks run side by side
  const ThreadGroup group(tc.tp);
  const std::vector<RecordedRun> ranks = tp_testing::run_on_rank_threads<RecordedRun>(
      tc.tp,
      [&](int r) {
        const RankShard shard = make_rank_shard(c, *weights, options, group.rank(r), tc.indexer);
        const auto engine = Engine::create(shard.config, shard.weights, shard.options);
        return run_recorded(*engine);
      },
      [&] { group.abort(); });

  for (int r = 1; r < tc.tp; ++r)
    EXPECT_TRUE(tp_testing::identical(ranks[static_cast<size_t>(r)].outputs, ranks[0].outputs))
        << "rank " << r << " computed other outputs than rank 0";

  const Agreement a = tp_testing::compare_outputs(ranks[0].outputs, whole.outputs, c, topology);
  const double tolerance = tc.precision == Precision::fp32 ? 2e-7 : 4e-5;  // measured 5.7e-8 / 1.3e-5
  EXPECT_LE(a.worst_rel_l2, tolerance) << "step " << a.worst_step << " layer " << a.worst_layer;
  int64_t undecided = 0;
  double score_difference = 0.0;  // split: largest score difference relative to the largest score
  if (tc.indexer == IndexerSharding::replicated) {
    // Every rank runs the unsharded indexer on the same inputs: the same picks everywhere.
    EXPECT_EQ(a.pick_rows_equal, a.pick_rows);
    EXPECT_EQ(a.rows_other_picks, 0);
  } else {
    const int64_t k = c.index_topk;
    double largest_score = 0.0, largest_difference = 0.0;
    for (size_t s = 0; s < whole.scores.size(); ++s)
      for (const auto& [layer, rows] : whole.scores[s]) {
        const reference::RaggedRows<float>& mine = ranks[0].scores[s].at(layer);
        ASSERT_EQ(mine.offset, rows.offset);
        for (size_t j = 0; j < rows.values.size(); ++j)
          if (std::isfinite(rows.values[j])) {
            largest_score = std::max(largest_score, std::abs(static_cast<double>(rows.values[j])));
            largest_difference =
                std::max(largest_difference, std::abs(static_cast<double>(rows.values[j]) - mine.values[j]));
          }
        const std::vector<int32_t>& my_picks = ranks[0].outputs[s].picks[static_cast<size_t>(layer)];
        const std::vector<int32_t>& picks = whole.outputs[s].picks[static_cast<size_t>(layer)];
        for (int64_t t = 0; t + 1 < static_cast<int64_t>(rows.offset.size()); ++t) {
          if (!selection_decided(rows.row(t), mine.row(t), rows.length(t), k)) {
            ++undecided;
            continue;
          }
          const bool equal = std::equal(picks.begin() + t * k, picks.begin() + (t + 1) * k, my_picks.begin() + t * k);
          EXPECT_TRUE(equal) << "step " << s << " layer " << layer << " token " << t;
        }
      }
    // The summed partial scores are the unsharded ones up to fp32 summation order: measured 7.1e-8
    // relative to the row's largest score, bound 3e-7; in reference precision measured 0 (the sum
    // is rounded to bf16 once either way), bound one bf16 ulp (2^-8), the least a rounding that
    // lands on the other side can give.
    score_difference = largest_difference / std::max(largest_score, 1e-30);
    EXPECT_LE(score_difference, tc.precision == Precision::fp32 ? 3e-7 : 1.0 / 256);
    // The comparison must not be vacuous: most rows are decided and compared.
    EXPECT_LE(undecided * 10, a.pick_rows);
    EXPECT_GE(a.rows_compared, 9 * a.rows_other_picks);
  }
  EXPECT_GT(a.pick_rows, 300);
  std::printf("%s tp %d %s indexer %s: worst rel L2 %.2e (step %d, layer %d) over %lld rows, %lld rows left out for "
              "other picks; picks equal on %lld of %lld rows (%lld undecided by the scores, scores differ by %.1e)\n",
              tc.preset.c_str(), tc.tp, precision_name(tc.precision), indexer_sharding_name(tc.indexer), a.worst_rel_l2,
              a.worst_step, a.worst_layer, static_cast<long long>(a.rows_compared),
              static_cast<long long>(a.rows_other_picks), static_cast<long long>(a.pick_rows_equal),
              static_cast<long long>(a.pick_rows), static_cast<long long>(undecided), score_difference);
}

std::vector<TpCase> all_cases() {
  std::vector<TpCase> cases;
  for (const char* preset : {"tiny-v4.1", "tiny-v4"})
    for (int tp : {2, 4})
      for (Precision p : {Precision::fp32, Precision::reference})
        for (IndexerSharding s : {IndexerSharding::replicated, IndexerSharding::split}) cases.push_back({preset, tp, p, s});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Workload, TensorParallelCpu, ::testing::ValuesIn(all_cases()), [](const auto& info) {
  const TpCase& tc = info.param;
  std::string name = tc.preset + "_tp" + std::to_string(tc.tp) + "_" + precision_name(tc.precision) + "_" +
                     indexer_sharding_name(tc.indexer);
  std::replace(name.begin(), name.end(), '-', '_');
  std::replace(name.begin(), name.end(), '.', '_');
  return name;
});

}  // namespace
}  // namespace dsv4

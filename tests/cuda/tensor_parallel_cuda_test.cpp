// Tensor parallelism on two GPUs (docs/parallel.md): tp = 2 rank engines, one thread and GPU each,
// summing through NCCL (one process, ncclCommInitAll), against the tp = 1 CUDA engine on GPU 0:
//  * the golden schedules (tests/golden_util.h): v41a in reference precision, v40a in fp32, every
//    call through every layer with the recorded inputs;
//  * the mixed serving workload of tensor_parallel_util.h (prefill chunks, decode tokens, a fork,
//    a release) on tiny-v4.1 (fp8 weights, reference precision) and tiny-v4 (fp32).
// Both indexer shardings. Relative L2 <= 2e-2 per call (step) and layer over the rows whose index
// source picked the same entries; the picks agree on at least 98 % of the rows (the rank engines'
// replicated GEMMs may take other cuBLASLt algorithms than the tp = 1 engine's, so near-ties at the
// cut can fall either way); both ranks produce the same bits. Skipped unless two GPUs and NCCL are
// present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"
#include "dsv4/parallel.h"
#include "golden_util.h"
#include "parallel/nccl_communicator.h"
#include "tensor_parallel_util.h"

namespace dsv4 {
namespace {

using tp_testing::Agreement;
using tp_testing::WorkloadOutputs;

constexpr int kRanks = 2;
constexpr double kTolerance = 2e-2;
constexpr double kMinPickAgreement = 0.98;

class TensorParallelCuda : public ::testing::TestWithParam<IndexerSharding> {
 protected:
  void SetUp() override {
    if (cuda::device_count() < kRanks) GTEST_SKIP() << "needs " << kRanks << " CUDA devices";
    if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  }
};

// `body` run on the tp = 1 engine on GPU 0, then on the rank engines of a tp = 2 group, each on a
// thread of its own with its GPU current. Returns the tp = 1 result first, then the ranks'.
std::vector<WorkloadOutputs> run_whole_and_ranks(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights,
                                                 const EngineOptions& options, IndexerSharding indexer,
                                                 const std::function<WorkloadOutputs(Engine&)>& body) {
  std::vector<WorkloadOutputs> results;
  DSV4_CUDA_CHECK(cudaSetDevice(0));
  results.push_back(body(*Engine::create(config, weights, options)));
  std::vector<std::shared_ptr<NcclCommunicator>> group = NcclCommunicator::create_local_group({0, 1});
  // A failed rank leaves the other one waiting in an all-reduce; ctest's timeout ends the test.
  const std::vector<WorkloadOutputs> ranks = tp_testing::run_on_rank_threads<WorkloadOutputs>(
      kRanks,
      [&](int r) {
        DSV4_CUDA_CHECK(cudaSetDevice(r));
        // The rank's thread owns its communicator: the ranks tear NCCL down side by side.
        const std::shared_ptr<NcclCommunicator> communicator = std::move(group[static_cast<size_t>(r)]);
        const RankShard shard = make_rank_shard(config, *weights, options, communicator, indexer);
        return body(*Engine::create(shard.config, shard.weights, shard.options));
      },
      [] {});
  results.insert(results.end(), ranks.begin(), ranks.end());
  return results;
}

void expect_agreement(const std::vector<WorkloadOutputs>& results, const ModelConfig& config, const std::string& what) {
  ASSERT_EQ(results.size(), static_cast<size_t>(1 + kRanks));
  for (int r = 2; r <= kRanks; ++r)
    EXPECT_TRUE(tp_testing::identical(results[static_cast<size_t>(r)], results[1]))
        << what << ": rank " << r - 1 << " computed other outputs than rank 0";
  const Agreement a = tp_testing::compare_outputs(results[1], results[0], config, resolve_topology(config));
  EXPECT_LE(a.worst_rel_l2, kTolerance) << what << ": step / call " << a.worst_step << ", layer " << a.worst_layer;
  EXPECT_GT(a.pick_rows, 100) << what;
  EXPECT_GE(static_cast<double>(a.pick_rows_equal), kMinPickAgreement * static_cast<double>(a.pick_rows)) << what;
  std::printf("%s: tp 2 vs tp 1: worst rel L2 %.2e (step/call %d, layer %d) over %lld rows, %lld rows left out for "
              "other picks; picks equal on %lld of %lld rows\n",
              what.c_str(), a.worst_rel_l2, a.worst_step, a.worst_layer, static_cast<long long>(a.rows_compared),
              static_cast<long long>(a.rows_other_picks), static_cast<long long>(a.pick_rows_equal),
              static_cast<long long>(a.pick_rows));
}

// Every call of a golden set with its recorded layer inputs, as WorkloadOutputs (one step per call).
WorkloadOutputs replay_golden(Engine& engine, const golden::GoldenSet& g) {
  std::vector<SequenceId> sequences;
  for (int64_t b = 0; b < g.batch; ++b) sequences.push_back(engine.add_sequence());
  WorkloadOutputs out;
  for (int c = 0; c < g.num_calls; ++c) {
    golden::CallOutputs call = golden::replay_call(engine, g, c, sequences);
    tp_testing::StepOutputs& step = out.emplace_back();
    step.tokens = g.batch * g.call_tokens(c);
    step.attn_out = std::move(call.attn_out);
    step.picks = std::move(call.picks);
  }
  return out;
}

TEST_P(TensorParallelCuda, GoldenSchedulesMatchTp1) {
  for (const auto& [name, precision] : {std::pair{"v41a", Precision::reference}, std::pair{"v40a", Precision::fp32}}) {
    const golden::GoldenSet g = golden::load_golden_set(name);
    int64_t positions = 0, longest_call = 0;
    for (int c = 0; c < g.num_calls; ++c) {
      positions += g.call_tokens(c);
      longest_call = std::max(longest_call, g.call_tokens(c));
    }
    EngineOptions options;
    options.backend = Backend::cuda;
    options.precision = precision;
    options.max_sequences = g.batch;
    options.max_context = positions;
    options.max_tokens_per_step = g.batch * longest_call;
    const auto results = run_whole_and_ranks(g.config, g.weights, options, GetParam(),
                                             [&](Engine& engine) { return replay_golden(engine, g); });
    expect_agreement(results, g.config, std::string(name) + " (" + indexer_sharding_name(GetParam()) + " indexer)");
  }
}

TEST_P(TensorParallelCuda, MixedWorkloadMatchesTp1) {
  for (const auto& [preset, precision] :
       {std::pair{"tiny-v4.1", Precision::reference}, std::pair{"tiny-v4", Precision::fp32}}) {
    const ModelConfig c = preset_config(preset);
    const bool fp8 = c.family == ModelFamily::v4_1;  // tiny-v4's 128-row fp8 blocks cut its 64-row groups
    const auto weights = std::make_shared<const ModelWeights>(random_weights(c, resolve_topology(c), 7, fp8));
    const auto results =
        run_whole_and_ranks(c, weights, tp_testing::workload_options(Backend::cuda, precision), GetParam(),
                            [](Engine& engine) { return tp_testing::run_workload(engine, tp_testing::mixed_workload(), 11); });
    expect_agreement(results, c, std::string(preset) + " workload (" + indexer_sharding_name(GetParam()) + " indexer)");
  }
}

INSTANTIATE_TEST_SUITE_P(Indexer, TensorParallelCuda,
                         ::testing::Values(IndexerSharding::replicated, IndexerSharding::split),
                         [](const auto& info) { return std::string(indexer_sharding_name(info.param)); });

}  // namespace
}  // namespace dsv4

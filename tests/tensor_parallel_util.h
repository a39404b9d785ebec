// A mixed serving workload run through an Engine, the ranks of a tensor-parallel group run on
// threads, and the comparison of their outputs with an unsharded engine's: shared by
// tensor_parallel_test.cpp (CPU ranks) and cuda/tensor_parallel_cuda_test.cpp (GPU ranks).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "dsv4/engine.h"
#include "dsv4/parallel.h"
#include "golden_util.h"

namespace dsv4::tp_testing {

// One engine step of the workload: sequences forked and released before it, then its entries.
struct ScriptStep {
  std::vector<std::pair<int, int>> forks;          // (new workload sequence, parent)
  std::vector<int> releases;                       // workload sequences
  std::vector<std::pair<int, int64_t>> entries;    // (workload sequence, tokens); new ones are added
};

// Prefill chunks, decode tokens and both in one step, a fork sharing a prefix, a release, a
// sequence added after it. The longest sequence reaches 83 tokens: past tiny-v4.1's 64 candidate
// entries and past every layer's top-k.
inline std::vector<ScriptStep> mixed_workload() {
  return {
      {{}, {}, {{0, 40}, {1, 12}}},
      {{}, {}, {{0, 1}, {1, 20}, {2, 9}}},
      {{{3, 0}}, {}, {{0, 1}, {1, 1}, {2, 1}, {3, 3}}},
      {{}, {}, {{0, 1}, {1, 1}, {2, 1}, {3, 1}}},
      {{}, {1}, {{0, 24}, {2, 1}, {3, 36}}},
      {{}, {}, {{0, 1}, {2, 1}, {3, 1}, {4, 20}}},
  };
}

// Engine options that fit mixed_workload.
inline EngineOptions workload_options(Backend backend, Precision precision) {
  EngineOptions options;
  options.backend = backend;
  options.precision = precision;
  options.max_sequences = 8;
  options.max_tokens_per_step = 128;
  options.max_context = 128;
  if (backend == Backend::cpu) options.cache_storage = CacheStorage::float_rows;
  return options;
}

// What a step produced: per layer attn_out [T, hidden] and, for index sources, picks [T, index_topk].
struct StepOutputs {
  int64_t tokens = 0;
  std::vector<std::vector<float>> attn_out;
  std::vector<std::vector<int32_t>> picks;
};
using WorkloadOutputs = std::vector<StepOutputs>;

// Layer `layer`'s input in step `step`: uniform on [-sqrt(3), sqrt(3)] (unit variance), fresh per
// (seed, step, layer), the same for every engine.
inline std::vector<float> layer_input(uint64_t seed, int step, int layer, int64_t n) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(step) * 1009u + static_cast<uint64_t>(layer));
  std::uniform_real_distribution<float> dist(-std::sqrt(3.0f), std::sqrt(3.0f));
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = dist(rng);
  return x;
}

// Runs the script through every backbone layer of `engine` with host views; `after_layer(step,
// layer)` runs after each layer (e.g. to read a cpu engine's recorded scores).
inline WorkloadOutputs run_workload(Engine& engine, const std::vector<ScriptStep>& script, uint64_t seed,
                                    const std::function<void(int, int)>& after_layer = {}) {
  const ModelConfig& c = engine.config();
  std::vector<SequenceId> ids;
  WorkloadOutputs out;
  for (int s = 0; s < static_cast<int>(script.size()); ++s) {
    const ScriptStep& step = script[static_cast<size_t>(s)];
    for (const auto& [child, parent] : step.forks) {
      ids.resize(std::max(ids.size(), static_cast<size_t>(child) + 1), -1);
      ids[static_cast<size_t>(child)] = engine.fork_sequence(ids[static_cast<size_t>(parent)]);
    }
    for (int r : step.releases) engine.release_sequence(ids[static_cast<size_t>(r)]);
    std::vector<StepEntry> entries;
    StepOutputs& o = out.emplace_back();
    for (const auto& [sequence, tokens] : step.entries) {
      if (static_cast<size_t>(sequence) >= ids.size()) ids.resize(static_cast<size_t>(sequence) + 1, -1);
      if (ids[static_cast<size_t>(sequence)] < 0) ids[static_cast<size_t>(sequence)] = engine.add_sequence();
      entries.push_back({ids[static_cast<size_t>(sequence)], tokens});
      o.tokens += tokens;
    }
    engine.begin_step(entries);
    o.attn_out.resize(static_cast<size_t>(c.num_layers));
    o.picks.resize(static_cast<size_t>(c.num_layers));
    for (int l = 0; l < c.num_layers; ++l) {
      std::vector<float> in = layer_input(seed, s, l, o.tokens * c.hidden_size);
      std::vector<float>& result = o.attn_out[static_cast<size_t>(l)];
      result.assign(in.size(), 0.0f);
      engine.run_layer(l, TensorView::contiguous(in.data(), DType::f32, {o.tokens, c.hidden_size}),
                       TensorView::contiguous(result.data(), DType::f32, {o.tokens, c.hidden_size}));
      if (engine.topology()[l].owns_indexer) {
        const HostTensor picks = engine.layer_picks(l);
        o.picks[static_cast<size_t>(l)].assign(picks.as<int32_t>(), picks.as<int32_t>() + picks.numel());
      }
      if (after_layer) after_layer(s, l);
    }
    engine.end_step();
  }
  return out;
}

// Runs `rank_body(rank)` for every rank of `communicators` on a thread of its own and returns the
// results in rank order; rethrows the first failure. `on_failure` runs after a rank failed, to
// release the others from their collectives.
template <class Result>
std::vector<Result> run_on_rank_threads(int tp, const std::function<Result(int)>& rank_body,
                                        const std::function<void()>& on_failure) {
  std::vector<Result> results(static_cast<size_t>(tp));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      try {
        results[static_cast<size_t>(r)] = rank_body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        on_failure();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return results;
}

// How a sharded run's outputs compare with the unsharded engine's.
struct Agreement {
  double worst_rel_l2 = 0.0;       // over the compared rows, per step and layer
  int worst_step = -1, worst_layer = -1;
  int64_t rows_compared = 0;       // (step, layer, token) rows whose outputs were compared
  int64_t rows_other_picks = 0;    // left out: their layer's index source picked other entries
  int64_t pick_rows = 0;           // (step, index-source layer, token) rows
  int64_t pick_rows_equal = 0;     // ... whose picks are equal
};

// Picks of index sources row by row; outputs of every row whose layer's index source picked the
// same entries (layers without one: every row), as relative L2 per step and layer. A layer's
// outputs depend on its index source's picks only through that row, and no cache depends on
// picks, so a differing pick does not spread to other rows or steps.
inline Agreement compare_outputs(const WorkloadOutputs& sharded, const WorkloadOutputs& whole,
                                 const ModelConfig& config, const ModelTopology& topology) {
  const int64_t H = config.hidden_size, k = config.index_topk;
  Agreement a;
  EXPECT_EQ(sharded.size(), whole.size());
  for (size_t s = 0; s < std::min(sharded.size(), whole.size()); ++s) {
    const int64_t T = whole[s].tokens;
    std::vector<std::vector<uint8_t>> same_picks(static_cast<size_t>(config.num_layers));
    for (int l = 0; l < config.num_layers; ++l) {
      if (!topology[l].owns_indexer) continue;
      const std::vector<int32_t>& mine = sharded[s].picks[static_cast<size_t>(l)];
      const std::vector<int32_t>& theirs = whole[s].picks[static_cast<size_t>(l)];
      EXPECT_EQ(mine.size(), theirs.size());
      std::vector<uint8_t>& same = same_picks[static_cast<size_t>(l)];
      same.assign(static_cast<size_t>(T), 0);
      for (int64_t t = 0; t < T && mine.size() == theirs.size(); ++t) {
        same[static_cast<size_t>(t)] = std::equal(mine.begin() + t * k, mine.begin() + (t + 1) * k, theirs.begin() + t * k);
        ++a.pick_rows;
        a.pick_rows_equal += same[static_cast<size_t>(t)];
      }
    }
    for (int l = 0; l < config.num_layers; ++l) {
      const int source = topology[l].index_source;
      const std::vector<float>& mine = sharded[s].attn_out[static_cast<size_t>(l)];
      const std::vector<float>& theirs = whole[s].attn_out[static_cast<size_t>(l)];
      std::vector<float> x, y;
      for (int64_t t = 0; t < T; ++t) {
        if (source >= 0 && !same_picks[static_cast<size_t>(source)][static_cast<size_t>(t)]) {
          ++a.rows_other_picks;
          continue;
        }
        x.insert(x.end(), mine.begin() + t * H, mine.begin() + (t + 1) * H);
        y.insert(y.end(), theirs.begin() + t * H, theirs.begin() + (t + 1) * H);
        ++a.rows_compared;
      }
      if (x.empty()) continue;
      const double err = golden::relative_l2(x.data(), y.data(), static_cast<int64_t>(x.size()));
      if (!(err <= a.worst_rel_l2) || a.worst_step < 0) {
        a.worst_rel_l2 = err;
        a.worst_step = static_cast<int>(s);
        a.worst_layer = l;
      }
    }
  }
  return a;
}

// Whether two runs produced the same bits (the ranks of one group must).
inline bool identical(const WorkloadOutputs& a, const WorkloadOutputs& b) {
  if (a.size() != b.size()) return false;
  for (size_t s = 0; s < a.size(); ++s) {
    if (a[s].picks != b[s].picks || a[s].attn_out.size() != b[s].attn_out.size()) return false;
    for (size_t l = 0; l < a[s].attn_out.size(); ++l) {
      const std::vector<float>& x = a[s].attn_out[l];
      const std::vector<float>& y = b[s].attn_out[l];
      if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0) return false;
    }
  }
  return true;
}

}  // namespace dsv4::tp_testing

// Loading the golden vector sets (tests/data/golden) and replaying their call schedules through an
// Engine, shared by the golden tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/safetensors.h"
#include "dsv4/weights.h"

namespace dsv4::golden {

inline std::string data_path(const std::string& file) { return std::string(DSV4_TEST_DATA_DIR) + "/golden/" + file; }

// A golden set: its config, weights and recorded calls.
struct GoldenSet {
  ModelConfig config;
  ModelTopology topology;
  std::shared_ptr<const ModelWeights> weights;
  std::shared_ptr<SafetensorsFile> calls;
  int64_t batch = 0;
  int num_calls = 0;
  // DSpark sets (v41ds_a) hold only the draft layers' weights and calls: replayed by a drafter.
  LayerSet layers = LayerSet::all;

  bool has(const std::string& name) const { return calls->find(name) != nullptr; }
  // Any recorded tensor converted to f32 (integers become their values).
  std::vector<float> floats(const std::string& name) const {
    const HostTensor t = calls->read_as(name, DType::f32);
    return std::vector<float>(t.as<float>(), t.as<float>() + t.numel());
  }
  std::vector<int64_t> shape(const std::string& name) const { return calls->at(name).shape; }
  int64_t call_tokens(int c) const { return shape(call_name(c, "position_ids"))[0]; }
  int64_t call_first_position(int c) const { return static_cast<int64_t>(floats(call_name(c, "position_ids"))[0]); }

  static std::string call_name(int c, const std::string& field) { return "calls." + std::to_string(c) + "." + field; }
  static std::string layer_name(int c, int l, const std::string& field) {
    return "calls." + std::to_string(c) + ".layers." + std::to_string(l) + "." + field;
  }
};

// `name`: "v41a" (sharded weights), "v40a", "v41ds_a" (a DSpark set: calls carry main_hidden).
inline GoldenSet load_golden_set(const std::string& name) {
  GoldenSet g;
  g.config = load_config_file(data_path(name + ".config.json"));
  g.topology = resolve_topology(g.config);
  g.calls = SafetensorsFile::open(data_path(name + ".calls.safetensors"));
  while (g.has(GoldenSet::call_name(g.num_calls, "position_ids"))) ++g.num_calls;
  const bool dspark = g.has(GoldenSet::call_name(0, "main_hidden"));
  g.layers = dspark ? LayerSet::draft : LayerSet::all;
  g.batch = g.shape(dspark ? GoldenSet::call_name(0, "main_hidden") : GoldenSet::layer_name(0, 0, "hidden_in"))[0];
  const std::string sharded = data_path(name + ".weights.index.json");
  const std::string single = data_path(name + ".weights.safetensors");
  const bool is_sharded = std::ifstream(sharded).good();
  g.weights =
      std::make_shared<ModelWeights>(load_weights(is_sharded ? sharded : single, g.config, g.topology, g.layers));
  return g;
}

// Relative L2 error ||a − b|| / ||b|| over n values.
inline double relative_l2(const float* a, const float* b, int64_t n) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    ref += static_cast<double>(b[i]) * b[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// The outputs of one call, laid out as the golden file: per layer [B, S, hidden] and, for index
// sources, the picks [B, S, index_topk].
struct CallOutputs {
  std::vector<std::vector<float>> attn_out;
  std::vector<std::vector<int32_t>> picks;
};

// Rows [batch · tokens] of call c whose layer-l result is not tied ("ambiguous" flags, when the set has them).
inline std::vector<uint8_t> usable_rows(const GoldenSet& g, int c, int l) {
  const std::string name = GoldenSet::layer_name(c, l, "ambiguous");
  const int64_t rows = g.batch * g.call_tokens(c);
  std::vector<uint8_t> usable(static_cast<size_t>(rows), 1);
  if (!g.has(name)) return usable;
  const std::vector<float> ambiguous = g.floats(name);
  for (int64_t i = 0; i < rows; ++i) usable[i] = ambiguous[i] == 0.0f;
  return usable;
}

// Relative L2 error over the usable rows of [rows, width] buffers.
inline double masked_relative_l2(const std::vector<float>& a, const std::vector<float>& b,
                                 const std::vector<uint8_t>& usable, int64_t width) {
  std::vector<float> x, y;
  for (size_t r = 0; r < usable.size(); ++r)
    if (usable[r]) {
      x.insert(x.end(), a.begin() + r * width, a.begin() + (r + 1) * width);
      y.insert(y.end(), b.begin() + r * width, b.begin() + (r + 1) * width);
    }
  return relative_l2(x.data(), y.data(), static_cast<int64_t>(x.size()));
}

// Every call's attention outputs against the set's on the usable rows, within `tolerance`; prints
// the worst as "<label>: worst relative L2 error ...".
inline void expect_outputs_match(const GoldenSet& g, const std::vector<CallOutputs>& outputs, double tolerance,
                                 const char* label) {
  double worst = 0;
  int worst_call = -1, worst_layer = -1;
  for (int c = 0; c < g.num_calls; ++c)
    for (int l = 0; l < g.config.num_layers; ++l) {
      const double err = masked_relative_l2(outputs[static_cast<size_t>(c)].attn_out[static_cast<size_t>(l)],
                                            g.floats(GoldenSet::layer_name(c, l, "attn_out")), usable_rows(g, c, l),
                                            g.config.hidden_size);
      EXPECT_LE(err, tolerance) << "call " << c << " layer " << l;
      if (err > worst) worst = err, worst_call = c, worst_layer = l;
    }
  std::printf("%s: worst relative L2 error %.3g (call %d, layer %d) over non-ambiguous rows\n", label, worst,
              worst_call, worst_layer);
}

// Runs call c for the batch rows of `sequences` (one engine sequence per batch row). `steps`
// groups batch rows into engine steps run one after the other (all rows in one step by default):
// every step runs every backbone layer with its rows' recorded hidden_in.
inline CallOutputs replay_call(Engine& engine, const GoldenSet& g, int c, const std::vector<SequenceId>& sequences,
                               std::vector<std::vector<int64_t>> steps = {}) {
  const int64_t S = g.call_tokens(c), H = g.config.hidden_size, k = g.config.index_topk;
  const int layers = g.config.num_layers;
  if (steps.empty()) {
    steps.emplace_back(static_cast<size_t>(g.batch));
    std::iota(steps[0].begin(), steps[0].end(), 0);
  }
  CallOutputs out;
  out.attn_out.assign(static_cast<size_t>(layers), std::vector<float>(static_cast<size_t>(g.batch * S * H)));
  out.picks.assign(static_cast<size_t>(layers), {});
  std::vector<std::vector<float>> hidden(static_cast<size_t>(layers));
  for (int l = 0; l < layers; ++l) hidden[l] = g.floats(GoldenSet::layer_name(c, l, "hidden_in"));
  for (const std::vector<int64_t>& rows : steps) {
    std::vector<StepEntry> entries;
    for (int64_t b : rows) entries.push_back({sequences[static_cast<size_t>(b)], S});
    engine.begin_step(entries);
    const int64_t T = static_cast<int64_t>(rows.size()) * S;
    std::vector<float> in(static_cast<size_t>(T * H)), result(static_cast<size_t>(T * H));
    for (int l = 0; l < layers; ++l) {
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy_n(hidden[l].data() + rows[i] * S * H, S * H, in.data() + static_cast<int64_t>(i) * S * H);
      engine.run_layer(l, TensorView::contiguous(in.data(), DType::f32, {T, H}),
                       TensorView::contiguous(result.data(), DType::f32, {T, H}));
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy_n(result.data() + static_cast<int64_t>(i) * S * H, S * H, out.attn_out[l].data() + rows[i] * S * H);
      if (!g.topology[l].owns_indexer) continue;
      const HostTensor picks = engine.layer_picks(l);
      out.picks[l].resize(static_cast<size_t>(g.batch * S * k));
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy_n(picks.as<int32_t>() + static_cast<int64_t>(i) * S * k, S * k, out.picks[l].data() + rows[i] * S * k);
    }
    engine.end_step();
  }
  return out;
}

// One call of a DSpark set (README.upstream.md, v41ds_a) through a drafter engine: a call whose
// main positions start at 0 replaces `sequences` by new ones; the call's main rows go through one
// step (run_draft_context); a draft call then runs every stage's block. Returns per stage the
// outputs [B, block, hidden] (nothing for a prefill).
inline std::vector<std::vector<float>> replay_dspark_call(Engine& engine, const GoldenSet& g, int c,
                                                          std::vector<SequenceId>& sequences) {
  const std::vector<float> main_positions = g.floats(GoldenSet::call_name(c, "main_position_ids"));
  const int64_t n = static_cast<int64_t>(main_positions.size()), H = g.config.hidden_size;
  if (main_positions[0] == 0.0f) {
    for (SequenceId s : sequences) engine.release_sequence(s);
    sequences.clear();
    for (int64_t b = 0; b < g.batch; ++b) sequences.push_back(engine.add_sequence());
  }
  std::vector<float> main_hidden = g.floats(GoldenSet::call_name(c, "main_hidden"));
  std::vector<StepEntry> entries;
  for (SequenceId s : sequences) entries.push_back({s, n});
  engine.begin_step(entries);
  engine.run_draft_context(
      TensorView::contiguous(main_hidden.data(), DType::f32, {g.batch * n, g.config.dspark_main_width()}));
  engine.end_step();

  std::vector<std::vector<float>> out;
  if (!g.has(GoldenSet::layer_name(c, 0, "hidden_in"))) return out;
  const int64_t rows = g.batch * g.config.dspark_block_size;
  for (int stage = 0; stage < g.config.num_mtp_layers; ++stage) {
    std::vector<float> in = g.floats(GoldenSet::layer_name(c, stage, "hidden_in"));
    std::vector<float>& result = out.emplace_back(static_cast<size_t>(rows * H));
    engine.run_draft_block(g.config.num_layers + stage, sequences, TensorView::contiguous(in.data(), DType::f32, {rows, H}),
                           TensorView::contiguous(result.data(), DType::f32, {rows, H}));
  }
  return out;
}

}  // namespace dsv4::golden

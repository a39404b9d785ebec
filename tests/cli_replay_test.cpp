// `dsv4 replay` and `dsv4 compare` as a user runs them: the built CLI on the golden sets, and
// compare's verdicts and numbers on files edited here with known differences.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dsv4/safetensors.h"
#include "test_util.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::CliResult;
using test::kGolden;
using test::run_cli;

std::string shell_quoted(const std::string& s) { return "'" + s + "'"; }


std::string replay_args(const std::string& set, const std::string& weights, const std::string& calls,
                        const std::string& out, const std::string& extra) {
  return "replay --config " + shell_quoted(kGolden + set + ".config.json") + " --weights " + shell_quoted(kGolden + weights) +
         " --calls " + shell_quoted(calls) + " --out " + shell_quoted(out) + " " + extra;
}

// Writes every tensor of `source` to `path`, passed through `edit` first; `edit` returns false to
// leave a tensor out.
void write_edited(const std::string& source, const std::string& path,
                  const std::function<bool(const std::string&, HostTensor&)>& edit) {
  const auto file = SafetensorsFile::open(source);
  SafetensorsWriter writer;
  for (const SafetensorsEntry& entry : file->header().entries) {
    HostTensor tensor = file->read(entry.name);
    if (edit(entry.name, tensor)) writer.add(entry.name, tensor);
  }
  writer.write(path);
}

const nlohmann::json& layer_entry(const nlohmann::json& report, int call, int layer) {
  for (const nlohmann::json& entry : report["layers"])
    if (entry["call"] == call && entry["layer"] == layer) return entry;
  ADD_FAILURE() << "no entry for call " << call << " layer " << layer;
  static const nlohmann::json none;
  return none;
}

// Relative L2 error of `name` between two files, computed here, independently of compare.
double relative_l2(const std::string& reference_path, const std::string& out_path, const std::string& name) {
  const HostTensor a = SafetensorsFile::open(reference_path)->read(name);
  const HostTensor b = SafetensorsFile::open(out_path)->read(name);
  double error = 0.0, norm = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(a.as<float>()[i]) - b.as<float>()[i];
    error += d * d;
    norm += static_cast<double>(a.as<float>()[i]) * a.as<float>()[i];
  }
  return std::sqrt(error / norm);
}

// ctest runs every test in its own process, so each replay runs only in the tests that use it,
// at most once per process.
class CliReplayTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("dsv4_cli_replay_test_" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  static std::string temp(const std::string& name) { return (dir_ / name).string(); }

  struct Replay {
    std::string out;  // the output file
    CliResult result;
  };
  // Replays a golden set into `out_name` under the temporary directory.
  static const Replay& replayed(const std::string& set, const std::string& weights, const std::string& out_name,
                                const std::string& flags) {
    static std::map<std::string, Replay> done;
    auto it = done.find(out_name);
    if (it == done.end()) {
      const std::string out = temp(out_name);
      it = done.emplace(out_name, Replay{out, run_cli(replay_args(set, weights, kGolden + set + ".calls.safetensors",
                                                                  out, flags))})
               .first;
    }
    return it->second;
  }
  static const Replay& v40a_fp32() {
    return replayed("v40a", "v40a.weights.safetensors", "v40a.fp32.safetensors", "--precision fp32");
  }
  static const Replay& v41a_reference() {
    return replayed("v41a", "v41a.weights.index.json", "v41a.reference.safetensors", "--precision reference");
  }
  static const Replay& v41a_native_cache() {
    return replayed("v41a", "v41a.weights.index.json", "v41a.native.safetensors",
                    "--precision reference --kv-format v4.1-native");
  }
  static const Replay& v41a_split() {
    return replayed("v41a", "v41a.weights.index.json", "v41a.split.safetensors", "--precision reference --split-steps");
  }

  static inline fs::path dir_;
};

TEST_F(CliReplayTest, V40aFp32MatchesGolden) {
  const Replay& replay = v40a_fp32();
  ASSERT_EQ(replay.result.exit_code, 0) << replay.result.output;
  EXPECT_NE(replay.result.output.find("replay: call 11/11"), std::string::npos) << replay.result.output;
  const std::string& v40a_out = replay.out;

  // What replay wrote: attn_out of layers 0..2 for every call, picks of the CSA layer 1 only.
  const auto out = SafetensorsFile::open(v40a_out);
  const std::vector<int64_t> call_tokens = {37, 1, 1, 1, 1, 1, 1, 21, 1, 1, 9};
  for (int c = 0; c < static_cast<int>(call_tokens.size()); ++c) {
    for (int l = 0; l < 3; ++l) {
      const std::string prefix = "calls." + std::to_string(c) + ".layers." + std::to_string(l) + ".";
      ASSERT_NE(out->find(prefix + "attn_out"), nullptr) << prefix;
      EXPECT_EQ(out->at(prefix + "attn_out").shape, (std::vector<int64_t>{2, call_tokens[c], 256}));
      EXPECT_EQ(out->find(prefix + "topk") != nullptr, l == 1) << prefix;
    }
    const SafetensorsEntry& picks = out->at("calls." + std::to_string(c) + ".layers.1.topk");
    EXPECT_EQ(picks.dtype, DType::i32);
    EXPECT_EQ(picks.shape, (std::vector<int64_t>{2, call_tokens[c], 8}));
  }

  // transformers breaks ties among equal index scores (common at zero, after the ReLU) its own way,
  // so a few rows pick a different, equally valid set (the engine's golden test checks that these
  // are ties); outputs are compared on the rows whose picks agree.
  const CliResult compare = run_cli("compare " + shell_quoted(kGolden + "v40a.calls.safetensors") + " " +
                                            shell_quoted(v40a_out) + " --tol 1e-4 --skip-differing-picks --json",
                                        false);
  ASSERT_EQ(compare.exit_code, 0) << compare.output;
  const nlohmann::json report = nlohmann::json::parse(compare.output);
  EXPECT_EQ(report["layers"].size(), 33u);
  for (const nlohmann::json& entry : report["layers"]) EXPECT_LE(entry["rel_l2"].get<double>(), 1e-4) << entry;
  const int64_t topk_rows = report["topk_rows"], topk_rows_equal = report["topk_rows_equal"];
  // The set flags 3 of the 150 CSA rows ambiguous (float64 scores tied at the cut): left out.
  EXPECT_EQ(report["rows_ambiguous"].get<int64_t>(), 3);
  EXPECT_EQ(topk_rows, 2 * (37 + 6 + 21 + 1 + 1 + 9) - 3);
  EXPECT_GE(topk_rows_equal, topk_rows * 95 / 100);
  EXPECT_EQ(report["rows_picks_differ"].get<int64_t>(), topk_rows - topk_rows_equal);
  // compare's number for an output without picks agrees with the one computed here.
  EXPECT_NEAR(layer_entry(report, 7, 2)["rel_l2"].get<double>(),
              relative_l2(kGolden + "v40a.calls.safetensors", v40a_out, "calls.7.layers.2.attn_out"), 1e-9);
}

TEST_F(CliReplayTest, V41aReferenceMatchesGolden) {
  const Replay& replay = v41a_reference();
  ASSERT_EQ(replay.result.exit_code, 0) << replay.result.output;
  const std::string& v41a_out = replay.out;
  const CliResult compare =
      run_cli("compare " + shell_quoted(kGolden + "v41a.calls.safetensors") + " " + shell_quoted(v41a_out) + " --tol 2e-2 --json",
              false);
  ASSERT_EQ(compare.exit_code, 0) << compare.output;
  const nlohmann::json report = nlohmann::json::parse(compare.output);
  EXPECT_EQ(report["layers"].size(), 34u * 6u);
  int64_t skipped = 0;
  for (const nlohmann::json& entry : report["layers"]) {
    EXPECT_LE(entry["rel_l2"].get<double>(), 2e-2) << entry;
    skipped += entry["rows_ambiguous"].get<int64_t>();
  }
  EXPECT_GT(skipped, 0) << "the golden set flags ambiguous rows; compare must leave them out";
  // Picks of the three index sources on every row that is not ambiguous.
  EXPECT_EQ(report["topk_rows_equal"], report["topk_rows"]);
}

// A DSpark set (v41ds_a, SPEC §13.1) through the draft layers of a drafter, on the CPU and on the
// GPU (where there is none, replay falls back to the CPU and says so): 15 draft calls x 3 stages,
// every output within the acceptance bound.
TEST_F(CliReplayTest, V41dsDraftLayersMatchGoldenOnEveryBackend) {
  for (const std::string backend : {"cpu", "cuda"}) {
    SCOPED_TRACE("backend " + backend);
    const Replay& replay = replayed("v41ds_a", "v41ds_a.weights.safetensors", "v41ds_a." + backend + ".safetensors",
                                    "--precision reference --backend " + backend);
    ASSERT_EQ(replay.result.exit_code, 0) << replay.result.output;
    EXPECT_NE(replay.result.output.find("replay: DSpark set, 17 calls (15 with a draft block) x 3 draft stages"),
              std::string::npos)
        << replay.result.output;
    const CliResult compare = run_cli("compare " + shell_quoted(kGolden + "v41ds_a.calls.safetensors") + " " +
                                          shell_quoted(replay.out) + " --tol 2e-2 --json",
                                      false);
    ASSERT_EQ(compare.exit_code, 0) << compare.output;
    const nlohmann::json report = nlohmann::json::parse(compare.output);
    EXPECT_EQ(report["layers"].size(), 15u * 3u);
    for (const nlohmann::json& entry : report["layers"]) EXPECT_LE(entry["rel_l2"].get<double>(), 2e-2) << entry;
  }
}

// DeepSeek's official V4.0 code (v40o_a): a ModelArgs config with an HCA ratio of 16, every float
// tensor stored as bf16, the indexer QAT on; picks equal on every row not flagged ambiguous.
TEST_F(CliReplayTest, V40oOfficialReferenceMatchesGolden) {
  const Replay& replay =
      replayed("v40o_a", "v40o_a.weights.safetensors", "v40o_a.reference.safetensors", "--precision reference");
  ASSERT_EQ(replay.result.exit_code, 0) << replay.result.output;
  const std::string reference = kGolden + "v40o_a.calls.safetensors";
  const CliResult compare = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(replay.out) + " --json", false);
  ASSERT_EQ(compare.exit_code, 0) << compare.output;
  const nlohmann::json report = nlohmann::json::parse(compare.output);
  EXPECT_EQ(report["layers"].size(), 52u * 3u);
  for (const nlohmann::json& entry : report["layers"]) EXPECT_LE(entry["rel_l2"].get<double>(), 2e-2) << entry;
  EXPECT_EQ(report["topk_rows"], 2 * 96 - 9);
  EXPECT_EQ(report["topk_rows_equal"], report["topk_rows"]);

  // The same schedule widened to f32 replays bit for bit the same: bf16 inputs are read exactly.
  const std::string widened = temp("v40o_a.f32.safetensors"), widened_out = temp("v40o_a.f32.out.safetensors");
  const auto golden = SafetensorsFile::open(reference);
  write_edited(reference, widened, [&](const std::string& name, HostTensor& t) {
    if (t.dtype() == DType::bf16) t = golden->read_as(name, DType::f32);
    return true;
  });
  const CliResult f32_replay =
      run_cli(replay_args("v40o_a", "v40o_a.weights.safetensors", widened, widened_out, "--precision reference"));
  ASSERT_EQ(f32_replay.exit_code, 0) << f32_replay.output;
  const auto a = SafetensorsFile::open(replay.out), b = SafetensorsFile::open(widened_out);
  ASSERT_EQ(a->header().entries.size(), b->header().entries.size());
  for (const SafetensorsEntry& entry : a->header().entries) {
    const HostTensor x = a->read(entry.name), y = b->read(entry.name);
    ASSERT_EQ(x.nbytes(), y.nbytes()) << entry.name;
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.nbytes()), 0) << entry.name;
  }
}

TEST_F(CliReplayTest, SplitStepsMatchGoldenAndTheBatchedReplay) {
  const Replay& batched_replay = v41a_reference();
  const Replay& split_replay = v41a_split();
  ASSERT_EQ(batched_replay.result.exit_code, 0) << batched_replay.result.output;
  ASSERT_EQ(split_replay.result.exit_code, 0) << split_replay.result.output;
  EXPECT_NE(split_replay.result.output.find("one step per sequence and call"), std::string::npos);
  const std::string& v41a_out = batched_replay.out;
  const std::string& v41a_split_out = split_replay.out;
  const CliResult golden =
      run_cli("compare " + shell_quoted(kGolden + "v41a.calls.safetensors") + " " + shell_quoted(v41a_split_out) + " --tol 2e-2");
  EXPECT_EQ(golden.exit_code, 0) << golden.output;
  // A sequence's outputs do not depend on which other sequences share its step.
  const CliResult batched =
      run_cli("compare " + shell_quoted(v41a_out) + " " + shell_quoted(v41a_split_out) + " --tol 1e-5");
  EXPECT_EQ(batched.exit_code, 0) << batched.output;
}

// V4.1's own cache formats (FP8 window rows, FP4 compressed rows, MXFP4 index keys) hold exactly
// the values the reference's fake quantization produces: the same outputs as float caches.
TEST_F(CliReplayTest, NativeCacheFormatsReproduceTheFloatCaches) {
  const Replay& float_caches = v41a_reference();
  const Replay& native_caches = v41a_native_cache();
  ASSERT_EQ(float_caches.result.exit_code, 0) << float_caches.result.output;
  ASSERT_EQ(native_caches.result.exit_code, 0) << native_caches.result.output;
  EXPECT_NE(native_caches.result.output.find("kv format v4.1-native"), std::string::npos);
  const CliResult same = run_cli("compare " + shell_quoted(float_caches.out) + " " +
                                     shell_quoted(native_caches.out) + " --tol 1e-6");
  EXPECT_EQ(same.exit_code, 0) << same.output;
}

TEST_F(CliReplayTest, CompareMeasuresAPerturbation) {
  const std::string reference = kGolden + "v40a.calls.safetensors";
  const std::string perturbed = temp("v40a.perturbed.safetensors");
  const std::string target = "calls.4.layers.2.attn_out";
  std::mt19937 rng(20261129);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  double noise_sq = 0.0, reference_sq = 0.0, largest = 0.0;
  std::vector<int64_t> largest_at;
  write_edited(reference, perturbed, [&](const std::string& name, HostTensor& t) {
    if (name != target) return true;
    float* v = t.as<float>();  // [2, 1, 256]
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double delta = 0.05 * std::fabs(v[i]) * noise(rng);  // about 5 % relative
      const float perturbed_value = static_cast<float>(v[i] + delta);
      const double actual_delta = static_cast<double>(perturbed_value) - v[i];
      noise_sq += actual_delta * actual_delta;
      reference_sq += static_cast<double>(v[i]) * v[i];
      if (std::fabs(actual_delta) > largest) {
        largest = std::fabs(actual_delta);
        largest_at = {i / 256, 0, i % 256};
      }
      v[i] = perturbed_value;
    }
    return true;
  });

  const CliResult fail = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(perturbed) + " --json", false);
  EXPECT_EQ(fail.exit_code, 1) << fail.output;
  const nlohmann::json report = nlohmann::json::parse(fail.output);
  EXPECT_EQ(report["above_tolerance"], 1);
  const nlohmann::json& entry = layer_entry(report, 4, 2);
  EXPECT_NEAR(entry["rel_l2"].get<double>(), std::sqrt(noise_sq / reference_sq), 1e-9);
  EXPECT_NEAR(entry["max_abs_error"].get<double>(), largest, 1e-12);
  EXPECT_EQ(entry["worst_index"].get<std::vector<int64_t>>(), largest_at);
  EXPECT_EQ(report["worst"]["call"], 4);
  EXPECT_EQ(report["worst"]["layer"], 2);
  for (const nlohmann::json& other : report["layers"])
    if (other["call"] != 4 || other["layer"] != 2) EXPECT_EQ(other["rel_l2"].get<double>(), 0.0);

  // The table names the failing output; a looser tolerance passes.
  const CliResult table = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(perturbed));
  EXPECT_EQ(table.exit_code, 1);
  EXPECT_NE(table.output.find("worst: call 4 layer 2"), std::string::npos) << table.output;
  EXPECT_NE(table.output.find("FAIL"), std::string::npos) << table.output;
  EXPECT_EQ(run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(perturbed) + " --tol 0.2").exit_code, 0);
}

TEST_F(CliReplayTest, CompareLeavesOutAmbiguousRowsOnlyWhenAsked) {
  const std::string reference = kGolden + "v41a.calls.safetensors";
  const auto golden = SafetensorsFile::open(reference);
  // The first output with a row flagged ambiguous; that row is perturbed by 100 %.
  std::string target;
  std::vector<uint8_t> flags;
  for (int c = 0; c < 34 && target.empty(); ++c) {
    for (int l = 1; l < 6 && target.empty(); ++l) {
      const std::string prefix = "calls." + std::to_string(c) + ".layers." + std::to_string(l) + ".";
      const HostTensor flag = golden->read(prefix + "ambiguous");
      const auto* f = flag.as<uint8_t>();
      if (std::find(f, f + flag.numel(), 1) == f + flag.numel()) continue;
      target = prefix + "attn_out";
      flags.assign(f, f + flag.numel());
    }
  }
  ASSERT_FALSE(target.empty()) << "the golden set has no ambiguous row";
  const std::string perturbed = temp("v41a.ambiguous.safetensors");
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> factor(1.5f, 2.5f);
  write_edited(reference, perturbed, [&](const std::string& name, HostTensor& t) {
    if (name != target) return true;
    const int64_t hidden = t.size(2);
    for (size_t r = 0; r < flags.size(); ++r)
      if (flags[r]) for (int64_t h = 0; h < hidden; ++h) t.as<float>()[r * hidden + h] *= factor(rng);
    return true;
  });
  EXPECT_EQ(run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(perturbed)).exit_code, 0);
  const CliResult strict = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(perturbed) + " --no-ignore-ambiguous");
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
}

TEST_F(CliReplayTest, CompareCountsDifferingPickedSets) {
  const std::string reference = kGolden + "v41a.calls.safetensors";
  const std::string edited = temp("v41a.picks.safetensors");
  // Call 0, layer 3, row [1, 30]: one pick replaced by a position it does not hold; another row's
  // picks reordered (the same set).
  const std::string target = "calls.0.layers.3.topk_pos";
  const auto golden = SafetensorsFile::open(reference);
  ASSERT_EQ(golden->read("calls.0.layers.3.ambiguous").as<uint8_t>()[37 + 30], 0) << "choose a row not ambiguous";
  write_edited(reference, edited, [&](const std::string& name, HostTensor& t) {
    if (name != target) return true;
    int32_t* changed = t.as<int32_t>() + (37 + 30) * 8;  // [2, 37, 8]
    int32_t unused = 0;
    while (std::find(changed, changed + 8, unused) != changed + 8) ++unused;
    changed[0] = unused;
    int32_t* reordered = t.as<int32_t>() + 5 * 8;
    std::reverse(reordered, reordered + 8);
    return true;
  });
  const CliResult compare = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(edited) + " --json", false);
  EXPECT_EQ(compare.exit_code, 0) << "picks are reported, not judged: " << compare.output;
  const nlohmann::json report = nlohmann::json::parse(compare.output);
  const nlohmann::json& entry = layer_entry(report, 0, 3);
  EXPECT_EQ(entry["topk_rows_equal"].get<int64_t>(), entry["topk_rows"].get<int64_t>() - 1);
  EXPECT_EQ(report["topk_rows_equal"].get<int64_t>(), report["topk_rows"].get<int64_t>() - 1);
}

// A row whose picks differ, with an output that differs accordingly: counted against the
// tolerance by default, left out with --skip-differing-picks.
TEST_F(CliReplayTest, CompareLeavesOutRowsWithDifferingPicksOnlyWhenAsked) {
  const std::string reference = kGolden + "v40a.calls.safetensors";
  const std::string edited = temp("v40a.other.picks.safetensors");
  const int64_t row = 37 + 12;  // calls.0: [2, 37, ...], batch 1, token 12
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> factor(-1.0f, 1.0f);
  write_edited(reference, edited, [&](const std::string& name, HostTensor& t) {
    if (name == "calls.0.layers.1.topk") {
      int64_t* picks = t.as<int64_t>() + row * 8;
      int64_t unused = 0;
      while (std::find(picks, picks + 8, unused) != picks + 8) ++unused;
      picks[3] = unused;
    } else if (name == "calls.0.layers.1.attn_out") {
      for (int64_t h = 0; h < 256; ++h) t.as<float>()[row * 256 + h] = factor(rng);
    }
    return true;
  });
  const CliResult strict = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(edited) + " --json",
                                       false);
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  const CliResult lenient = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(edited) +
                                            " --skip-differing-picks --json",
                                        false);
  ASSERT_EQ(lenient.exit_code, 0) << lenient.output;
  const nlohmann::json report = nlohmann::json::parse(lenient.output);
  EXPECT_EQ(report["rows_picks_differ"], 1);
  const nlohmann::json& entry = layer_entry(report, 0, 1);
  EXPECT_EQ(entry["rows_picks_differ"], 1);
  EXPECT_EQ(entry["rel_l2"].get<double>(), 0.0);
}

TEST_F(CliReplayTest, CompareFailsOnAMissingTensor) {
  const std::string reference = kGolden + "v40a.calls.safetensors";
  for (const std::string& dropped : {"calls.5.layers.1.attn_out", "calls.2.layers.1.topk"}) {
    const std::string out = temp("v40a.without.safetensors");
    write_edited(reference, out, [&](const std::string& name, HostTensor&) { return name != dropped; });
    const CliResult compare = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(out));
    EXPECT_EQ(compare.exit_code, 1) << dropped << ": " << compare.output;
    EXPECT_NE(compare.output.find("MISSING"), std::string::npos) << compare.output;
    EXPECT_NE(compare.output.find("1 tensors missing"), std::string::npos) << compare.output;
  }
}

TEST_F(CliReplayTest, CompareExits2OnMalformedInput) {
  const std::string reference = kGolden + "v40a.calls.safetensors";
  // Not a safetensors file, a file that does not exist, and outputs of the wrong shape.
  EXPECT_EQ(run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(kGolden + "v40a.config.json")).exit_code, 2);
  EXPECT_EQ(run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(temp("absent.safetensors"))).exit_code, 2);
  const std::string reshaped = temp("v40a.reshaped.safetensors");
  write_edited(reference, reshaped, [&](const std::string& name, HostTensor& t) {
    if (name == "calls.1.layers.0.attn_out") t = HostTensor(DType::f32, {2, 2, 128});
    return true;
  });
  const CliResult shape = run_cli("compare " + shell_quoted(reference) + " " + shell_quoted(reshaped));
  EXPECT_EQ(shape.exit_code, 2) << shape.output;
  EXPECT_NE(shape.output.find("calls.1.layers.0.attn_out has shape [2, 2, 128]"), std::string::npos) << shape.output;
  EXPECT_NE(shape.output.find("expected [2, 1, 256]"), std::string::npos) << shape.output;
}

// Replay checks the whole schedule before it runs anything; each broken file names its tensor.
// Image spans (SPEC §14) from --image-span and from calls.{c}.image_spans give the same outputs,
// which differ from the replay without spans only on the span tokens of the prefill call; a config
// without image spans (v41a's: vision_n_layers 0) rejects them, and so does the engine a span that
// leaves its call.
TEST_F(CliReplayTest, ReplayTakesImageSpans) {
  nlohmann::json config = nlohmann::json::parse(std::ifstream(kGolden + "v41a.config.json"));
  config["vision_n_layers"] = 1;  // M = its vision_max_n_token, 1024
  const std::string vision_config = temp("v41a_vision.config.json");
  std::ofstream(vision_config) << config.dump();
  const std::string golden_calls = kGolden + "v41a.calls.safetensors";
  const auto replay = [&](const std::string& config_path, const std::string& calls, const std::string& out,
                          const std::string& flags) {
    return run_cli("replay --config " + shell_quoted(config_path) + " --weights " +
                   shell_quoted(kGolden + "v41a.weights.index.json") + " --calls " + shell_quoted(calls) + " --out " +
                   shell_quoted(out) + " --precision reference " + flags);
  };
  const auto fails_with = [&](const std::string& config_path, const std::string& flags, const std::string& expected) {
    const CliResult r = replay(config_path, golden_calls, temp("never.safetensors"), flags);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  };
  fails_with(kGolden + "v41a.config.json", "--image-span 0:3:20",
             "sequence 0: image span [3, 20] is given, but the model takes no image spans");
  fails_with(vision_config, "--image-span 0:3", "replay: --image-span 0:3: expected sequence:first:last");
  fails_with(vision_config, "--image-span 2:3:20", "replay: --image-span 2:3:20: sequence 2 is not in the batch of 2");
  fails_with(vision_config, "--image-span 1:30:40",
             "sequence 1: image span [30, 40] does not lie inside the entry's chunk, positions 0 to 36");

  const CliResult by_flag =
      replay(vision_config, golden_calls, temp("spans_flag.safetensors"), "--image-span 0:3:20 --image-span 1:30:36");
  ASSERT_EQ(by_flag.exit_code, 0) << by_flag.output;
  const std::string with_spans_tensor = temp("calls_with_spans.safetensors");
  {
    const auto golden = SafetensorsFile::open(golden_calls);
    SafetensorsWriter writer;
    for (const SafetensorsEntry& entry : golden->header().entries) writer.add(entry.name, golden->read(entry.name));
    HostTensor spans(DType::i64, {2, 3});
    const int64_t rows[] = {0, 3, 20, 1, 30, 36};
    std::copy(rows, rows + 6, spans.as<int64_t>());
    writer.add("calls.0.image_spans", spans);
    writer.write(with_spans_tensor);
  }
  const CliResult by_file = replay(vision_config, with_spans_tensor, temp("spans_file.safetensors"), "");
  ASSERT_EQ(by_file.exit_code, 0) << by_file.output;
  const Replay& plain = v41a_reference();
  ASSERT_EQ(plain.result.exit_code, 0) << plain.result.output;

  const auto flag_out = SafetensorsFile::open(temp("spans_flag.safetensors"));
  const auto file_out = SafetensorsFile::open(temp("spans_file.safetensors"));
  const auto plain_out = SafetensorsFile::open(plain.out);
  for (int c = 0; c < 34; ++c)
    for (int l = 0; l < 6; ++l) {
      const std::string name = "calls." + std::to_string(c) + ".layers." + std::to_string(l) + ".attn_out";
      const HostTensor a = flag_out->read(name), b = file_out->read(name), p = plain_out->read(name);
      ASSERT_EQ(a.numel(), p.numel()) << name;
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << name;
      const int64_t S = a.size(1), hidden = a.size(2);
      int64_t differing_span_rows = 0;
      for (int64_t b_index = 0; b_index < 2; ++b_index)
        for (int64_t t = 0; t < S; ++t) {
          // Span tokens may differ; everything else is bitwise the replay without spans.
          const bool in_span = c == 0 && (b_index == 0 ? t >= 3 && t <= 20 : t >= 30 && t <= 36);
          const float* x = a.as<float>() + (b_index * S + t) * hidden;
          const bool equal = std::memcmp(x, p.as<float>() + (b_index * S + t) * hidden, hidden * sizeof(float)) == 0;
          if (!in_span) EXPECT_TRUE(equal) << name << " sequence " << b_index << " row " << t;
          differing_span_rows += in_span && !equal;
        }
      if (c == 0) EXPECT_GT(differing_span_rows, 10) << name;
    }
}

TEST_F(CliReplayTest, ReplayRejectsMalformedCalls) {
  const std::string golden = kGolden + "v40a.calls.safetensors";
  const std::string out = temp("never.safetensors");
  auto replay_fails_with = [&](const std::string& calls, const std::vector<std::string>& expected) {
    const CliResult r = run_cli(replay_args("v40a", "v40a.weights.safetensors", calls, out, "--precision fp32"));
    EXPECT_NE(r.exit_code, 0) << r.output;
    for (const std::string& part : expected) EXPECT_NE(r.output.find(part), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
  };

  // Truncated: the header promises more data than the file has.
  const std::string truncated = temp("truncated.safetensors");
  {
    std::ifstream in(golden, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(truncated, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  replay_fails_with(truncated, {"dsv4: ", "truncated.safetensors"});

  const std::string edited = temp("edited.safetensors");
  auto edit_and_expect = [&](const std::string& target, const std::function<void(HostTensor&)>& change,
                             const std::vector<std::string>& expected) {
    write_edited(golden, edited, [&](const std::string& name, HostTensor& t) {
      if (name != target) return true;
      if (!change) return false;
      change(t);
      return true;
    });
    replay_fails_with(edited, expected);
  };
  edit_and_expect("calls.3.layers.1.hidden_in", [](HostTensor& t) { t = HostTensor(DType::f32, {2, 2, 256}); },
                  {"calls.3.layers.1.hidden_in", "has shape [2, 2, 256], expected [2, 1, 256]"});
  edit_and_expect("calls.1.layers.2.hidden_in", [](HostTensor& t) { t = HostTensor(DType::f32, {3, 1, 256}); },
                  {"calls.1.layers.2.hidden_in", "has shape [3, 1, 256], expected [2, 1, 256]"});
  edit_and_expect("calls.2.position_ids", [](HostTensor& t) { t.as<int64_t>()[0] += 1; },
                  {"calls.2.position_ids[0] is 39, expected 38"});
  edit_and_expect("calls.0.position_ids", [](HostTensor& t) { t.as<int64_t>()[20] = 0; },
                  {"calls.0.position_ids[20] is 0, expected 20 (a new sequence starts at position 0)"});
  edit_and_expect("calls.6.layers.0.hidden_in", nullptr, {"calls.6.layers.0.hidden_in"});
  edit_and_expect("calls.4.position_ids", nullptr, {"calls.4.position_ids"});
  edit_and_expect("calls.0.layers.1.hidden_in", [](HostTensor& t) { t = HostTensor(DType::i32, {2, 37, 256}); },
                  {"calls.0.layers.1.hidden_in", "has dtype I32, expected F32 or BF16"});
  edit_and_expect("calls.0.layers.1.hidden_in", [](HostTensor& t) { t = HostTensor(DType::bf16, {2, 36, 256}); },
                  {"calls.0.layers.1.hidden_in", "has shape [2, 36, 256], expected [2, 37, 256]"});
}

}  // namespace
}  // namespace dsv4

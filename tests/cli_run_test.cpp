// `dsv4 run` as a user runs it: the built CLI with small workloads; the summary's numbers are
// checked against the workload the flags describe.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <string>
#include <vector>
#include "test_util.h"

namespace {

using dsv4::test::CliResult;
using dsv4::test::run_cli;

// The first match of `pattern`'s group `group` in `text`, or "" when it does not match.
std::string find(const std::string& text, const std::string& pattern, int group = 1) {
  std::smatch m;
  return std::regex_search(text, m, std::regex(pattern)) ? m[group].str() : "";
}

int64_t find_int(const std::string& text, const std::string& pattern, int group = 1) {
  const std::string s = find(text, pattern, group);
  EXPECT_FALSE(s.empty()) << "no match for '" << pattern << "' in:\n" << text;
  return s.empty() ? -1 : std::stoll(s);
}

// 3 sequences of mean prompt 40 and the default spread 0.5: prompts of 20, 40 and 60 tokens, on the
// CPU backend (the default backend of a machine with a GPU is cuda, with other workload defaults).
const std::string kSmallFlags = "--batch 3 --prompt-len 40 --gen-len 5 --chunk 16 --max-running 2 --step-tokens 24 --seed 7";
const std::string kSmallWorkload = "run --backend cpu " + kSmallFlags;

void expect_consistent_summary(const std::string& out) {
  EXPECT_EQ(find_int(out, R"(workload: (\d+) sequences)"), 3);
  EXPECT_EQ(find(out, R"(prompts of (\d+\.\.\d+) tokens)"), "20..60");
  EXPECT_EQ(find_int(out, R"(\((\d+) in all\))"), 120);
  // Every prompt token is prefilled once; 5 decode steps for each of the 3 sequences, some of them
  // inside steps that also prefill.
  EXPECT_EQ(find_int(out, R"(prefill: (\d+) tokens)"), 120);
  EXPECT_EQ(find_int(out, R"(also decoded (\d+) tokens)") + find_int(out, R"(decode: (\d+) tokens)"), 15);
  // With 2 running and 24 tokens per step, prefill (16-token chunks) overlaps other sequences' decode.
  EXPECT_GT(find_int(out, R"(also decoded (\d+) tokens)"), 0);
  EXPECT_GT(find_int(out, R"(steps: \d+ \(\d+ with prefill, (\d+) decode only\))"), 0);
  EXPECT_NE(find(out, R"(prefill: .* ([0-9.]+) tok/s)"), "");
  EXPECT_NE(find(out, R"(decode: .* ([0-9.]+) tok/s)"), "");
  EXPECT_NE(find(out, R"(kv cache: ([0-9.]+ [KMG]?i?B) per sequence)"), "");
  EXPECT_NE(find(out, R"(check: sequence \d+ .* rel L2 ([0-9.e+-]+))"), "");
}

// The check's relative L2 error, overall and of the worst layer: bit equality on the CPU.
void expect_check_error_is_zero(const std::string& out) {
  EXPECT_EQ(find(out, R"(check: .* rel L2 ([0-9.e+-]+) \(worst layer)"), "0.00e+00") << out;
  EXPECT_EQ(find(out, R"(check: .* \(worst layer \d+: ([0-9.e+-]+)\))"), "0.00e+00") << out;
}

TEST(CliRun, SmallWorkloadPassesItsCheck) {
  const CliResult r = run_cli(kSmallWorkload);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_consistent_summary(r.output);
  EXPECT_NE(r.output.find("tolerance 2e-02: PASS"), std::string::npos) << r.output;
  // The CPU engine computes every row in a fixed order: the recomputation picks the same entries on
  // every index row (tiny-v4.1's 4 index sources at the sampled positions) and no output is left out.
  const int64_t pick_rows = find_int(r.output, R"(picked the same entries on \d+ of (\d+) rows)");
  EXPECT_GT(pick_rows, 0);
  EXPECT_EQ(find_int(r.output, R"(picked the same entries on (\d+) of)"), pick_rows);
  EXPECT_EQ(find_int(r.output, R"((\d+) of \d+ outputs left out)"), 0);
  EXPECT_EQ(find_int(r.output, R"(\d+ of (\d+) outputs left out)"), find_int(r.output, R"((\d+) sampled positions)") * 9);
  // The 2e-2 the check prints is the user-facing default; on the CPU the recomputation is the same
  // per-token math in another step split, so the measured error is 0 and the test asserts it.
  expect_check_error_is_zero(r.output);
}

// --speculative 3: decode steps verify the bonus token and 3 drafts, roll back the rejected ones;
// the check recomputes the accepted tokens only, so any trace of a rejected draft would show. The
// workload commits the same tokens as without speculation (prompts plus 12 decode tokens each).
TEST(CliRun, SpeculativeDecodingPassesItsCheck) {
  const CliResult r = run_cli(
      "run --backend cpu --batch 3 --prompt-len 40 --gen-len 12 --chunk 16 --max-running 2 --step-tokens 24 --seed 7 "
      "--speculative 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tolerance 2e-02: PASS"), std::string::npos) << r.output;
  expect_check_error_is_zero(r.output);
  const int64_t verifies = find_int(r.output, R"(speculative: (\d+) verify steps)");
  EXPECT_GT(verifies, 0);
  const int64_t kept = find_int(r.output, R"(decode-only steps kept (\d+) of)");
  const int64_t computed = find_int(r.output, R"(decode-only steps kept \d+ of (\d+) tokens)");
  EXPECT_LT(kept, computed);  // some drafts were rejected
  EXPECT_EQ(find_int(r.output, R"(prefill: (\d+) tokens)"), 120);
}

// With DSpark draft layers (v41ds_a's config: 3 backbone layers, 3 draft stages), every verify step
// is drafted first: the target layers' inputs reach the draft windows each step and each stage runs a
// block per verifying sequence.
TEST(CliRun, SpeculativeDecodingDraftsWithDsparkLayers) {
  const CliResult r = run_cli("run --backend cpu --config " + std::string(DSV4_TEST_DATA_DIR) +
                              "/golden/v41ds_a.config.json --batch 3 --prompt-len 40 --gen-len 12 --chunk 16 "
                              "--max-running 2 --step-tokens 24 --seed 7 --speculative 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tolerance 2e-02: PASS"), std::string::npos) << r.output;
  const int64_t verifies = find_int(r.output, R"(speculative: (\d+) verify steps)");
  EXPECT_EQ(find_int(r.output, R"(drafting: (\d+) DSpark draft blocks of 5 rows \(3 stages)"), 3 * verifies);
}

TEST(CliRun, Fp32CheckPassesAtTightTolerance) {
  const CliResult r = run_cli(kSmallWorkload + " --precision fp32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_consistent_summary(r.output);
  EXPECT_NE(r.output.find("precision fp32"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tolerance 1e-04: PASS"), std::string::npos) << r.output;
  expect_check_error_is_zero(r.output);  // measured 0, as in reference precision
}

// Bytes in KiB from a "kv cache: 310.0 KiB per sequence" line.
double kv_kib_per_sequence(const std::string& out) {
  const std::string value = find(out, R"(kv cache: ([0-9.]+ [KM]iB) per sequence)");
  EXPECT_FALSE(value.empty()) << out;
  if (value.empty()) return -1.0;
  return std::stod(value) * (value.find("MiB") != std::string::npos ? 1024.0 : 1.0);
}

// The cache formats reach the engine: V4.1's native rows (528 / 288 / 68 bytes) take less room
// than bf16 rows (1024 / 1024 / 256 bytes), and the check still passes in each.
TEST(CliRun, KvFormatsPassTheCheckAndSizeTheCache) {
  const CliResult native = run_cli(kSmallWorkload + " --kv-format v4.1-native");
  const CliResult bf16 = run_cli(kSmallWorkload + " --kv-format bf16");
  ASSERT_EQ(native.exit_code, 0) << native.output;
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  EXPECT_NE(native.output.find("kv format v4.1-native"), std::string::npos) << native.output;
  EXPECT_NE(native.output.find(": PASS"), std::string::npos) << native.output;
  EXPECT_NE(bf16.output.find(": PASS"), std::string::npos) << bf16.output;
  EXPECT_LT(kv_kib_per_sequence(native.output), kv_kib_per_sequence(bf16.output));
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Two runs of the same flags trace the same hashes; another seed changes the inputs from step 0
// and layer 0 on. A line per step and layer; picks only for index sources.
TEST(CliRun, TraceHashesEveryStepAndLayer) {
  const dsv4::test::TempDir dir;
  const CliResult first = run_cli(kSmallWorkload + " --trace " + dir.file("a.txt"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(run_cli(kSmallWorkload + " --trace " + dir.file("b.txt")).exit_code, 0);
  ASSERT_EQ(run_cli(std::regex_replace(kSmallWorkload, std::regex("--seed 7"), "--seed 8") + " --trace " + dir.file("c.txt")).exit_code, 0);
  const std::vector<std::string> a = lines_of(dir.file("a.txt")), b = lines_of(dir.file("b.txt")),
                                 c = lines_of(dir.file("c.txt"));
  const int64_t steps = find_int(first.output, R"(steps: (\d+))");
  ASSERT_EQ(static_cast<int64_t>(a.size()), steps * 9) << "tiny-v4.1 has 9 layers";
  EXPECT_EQ(a, b);
  ASSERT_FALSE(c.empty());
  EXPECT_NE(a[0], c[0]);
  EXPECT_EQ(find(a[0], R"(^step 0 layer 0 rows (\d+) )"), "24");  // step 0 fills the 24-token budget
  EXPECT_EQ(find(a[0], R"(picks ([0-9a-f]{16})$)"), "0000000000000000");  // layer 0: window only
  EXPECT_NE(find(a[1], R"(picks ([0-9a-f]{16})$)"), "0000000000000000");  // layer 1: an index source
  const CliResult unwritable = run_cli(kSmallWorkload + " --trace " + dir.file("no/such/dir/t.txt"));
  EXPECT_NE(unwritable.exit_code, 0);
  EXPECT_NE(unwritable.output.find("dsv4: run: --trace: cannot write"), std::string::npos) << unwritable.output;
}

TEST(CliRun, RejectsAnInvalidWorkload) {
  const CliResult chunk = run_cli("run --chunk 0");
  EXPECT_NE(chunk.exit_code, 0);
  EXPECT_NE(chunk.output.find("dsv4: run: --chunk is 0, expected >= 1"), std::string::npos) << chunk.output;
  const CliResult budget = run_cli("run --max-running 8 --step-tokens 4");
  EXPECT_NE(budget.exit_code, 0);
  EXPECT_NE(budget.output.find("--step-tokens is 4, expected >= --max-running x (1 + --speculative) (8)"),
            std::string::npos)
      << budget.output;
  const CliResult preset = run_cli("run --preset no-such-model");
  EXPECT_NE(preset.exit_code, 0);
  EXPECT_NE(preset.output.find("no-such-model"), std::string::npos) << preset.output;
}

#ifndef DSV4_WITH_CUDA
TEST(CliRun, CudaRequestFallsBackToCpuWithoutTheBackend) {
  const CliResult r = run_cli("run --backend cuda " + kSmallFlags);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("backend cuda is not usable"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("engine: backend cpu"), std::string::npos) << r.output;
  expect_consistent_summary(r.output);
}
#endif

}  // namespace

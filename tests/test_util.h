// Helpers shared by the host test programs: the golden data directory, temporary directories,
// running the built dsv4 tool, and catching the message of an expected dsv4::Error.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "dsv4/error.h"

namespace dsv4::test {

// tests/data/golden/ (copies of the shared golden vectors, see tests/data/README.md).
inline const std::string kGolden = std::string(DSV4_TEST_DATA_DIR) + "/golden/";

// A fresh directory, removed with everything in it when the object goes.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "dsv4_test") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            (prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

struct CliResult {
  int exit_code = -1;  // -1: the tool could not be started or did not exit normally
  std::string output;  // stdout, and stderr unless left out
};

// Runs the built tool with `args` (shell words, quoted by the caller where needed).
inline CliResult run_cli(const std::string& args, bool with_stderr = true) {
  const std::string command = "'" + std::string(DSV4_CLI_PATH) + "' " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  CliResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// A value in [-1, 1) from a hash of its coordinates, so that a token's input does not depend on
// how the tokens are split into steps.
inline float hashed_value(uint64_t stream, int64_t position, int layer, int64_t channel) {
  uint64_t z = stream * 0x9e3779b97f4a7c15ull ^ (static_cast<uint64_t>(position) << 20) ^
               (static_cast<uint64_t>(layer) << 52) ^ static_cast<uint64_t>(channel);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

// The message of the dsv4::Error that f() throws; a test failure (and "") when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a dsv4::Error";
  return "";
}

}  // namespace dsv4::test

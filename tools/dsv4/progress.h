// Progress of a long-running command on stderr: a bar redrawn in place when stderr is a terminal,
// otherwise a plain line at most every few seconds, so that logs stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace dsv4::cli {

class Progress {
 public:
  // `label` starts every line; `total` units make 100 %.
  Progress(std::string label, int64_t total, double line_interval_s = 2.0);
  // Reports `done` units; `detail` follows the bar.
  void update(int64_t done, const std::string& detail);
  // Leaves the bar's line (terminal) so that what follows starts on a fresh line.
  void finish();

 private:
  std::string label_;
  int64_t total_;
  double line_interval_s_;
  bool terminal_;
  bool bar_drawn_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_line_;
};

}  // namespace dsv4::cli

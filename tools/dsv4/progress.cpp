#include "dsv4/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace dsv4::cli {

Progress::Progress(std::string label, int64_t total, double line_interval_s)
    : label_(std::move(label)),
      total_(std::max<int64_t>(total, 1)),
      line_interval_s_(line_interval_s),
      terminal_(isatty(fileno(stderr)) != 0),
      start_(std::chrono::steady_clock::now()),
      last_line_(start_) {}

void Progress::update(int64_t done, const std::string& detail) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double fraction = std::clamp(static_cast<double>(done) / static_cast<double>(total_), 0.0, 1.0);
  const int percent = static_cast<int>(fraction * 100.0);  // rounded down: 100 % only when done
  if (terminal_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    const std::string bar = std::string(static_cast<size_t>(filled), '#') + std::string(kWidth - filled, '.');
    // \r and "erase to end of line" redraw the bar in place.
    std::fprintf(stderr, "\r%s [%s] %3d%% %s | %.1f s\x1b[K", label_.c_str(), bar.c_str(), percent, detail.c_str(),
                 elapsed);
    std::fflush(stderr);
    bar_drawn_ = true;
    return;
  }
  const bool complete = done >= total_;
  if (!complete && std::chrono::duration<double>(now - last_line_).count() < line_interval_s_) return;
  last_line_ = now;
  std::fprintf(stderr, "%s: %3d%% %s | %.1f s\n", label_.c_str(), percent, detail.c_str(), elapsed);
}

void Progress::finish() {
  if (terminal_ && bar_drawn_) std::fputc('\n', stderr);
  bar_drawn_ = false;
}

}  // namespace dsv4::cli

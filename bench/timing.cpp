#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>

#include "bench/bench.h"

namespace dsv4::bench {

std::vector<double> time_runs(const BenchOptions& o, cudaStream_t stream, const std::function<void()>& launch) {
  launch();  // outside the capture: one-time work (function attributes, lazy module loading)
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch();
  DSV4_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  DSV4_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<double> us = time_graph(o, stream, exec);
  DSV4_CUDA_CHECK(cudaGraphExecDestroy(exec));
  DSV4_CUDA_CHECK(cudaGraphDestroy(graph));
  return us;
}

std::vector<double> time_graph(const BenchOptions& o, cudaStream_t stream, cudaGraphExec_t graph) {
  const auto launch = [&] { DSV4_CUDA_CHECK(cudaGraphLaunch(graph, stream)); };
  for (int i = 0; i < o.warmup; ++i) launch();
  std::vector<cudaEvent_t> events(static_cast<size_t>(2 * o.iters));
  for (cudaEvent_t& e : events) DSV4_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < o.iters; ++i) {
    DSV4_CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(2 * i)], stream));
    launch();
    DSV4_CUDA_CHECK(cudaEventRecord(events[static_cast<size_t>(2 * i + 1)], stream));
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (int i = 0; i < o.iters; ++i) {
    float ms = 0;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, events[static_cast<size_t>(2 * i)], events[static_cast<size_t>(2 * i + 1)]));
    us.push_back(1000.0 * ms);
  }
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  return us;
}

double percentile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const double at = q * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(at)), hi = static_cast<size_t>(std::ceil(at));
  return values[lo] + (values[hi] - values[lo]) * (at - static_cast<double>(lo));
}

void print_result(const BenchOptions& o, const ModelConfig& c, const Workload& w, const std::vector<double>& us) {
  std::printf("dsv4 bench: op %s, preset %s (%d heads x %" PRId64 ", window %" PRId64 ", top-k %" PRId64
              ", index %d heads x %" PRId64 "), batch %" PRId64 ", context %" PRId64 "\n",
              o.op.c_str(), c.name.c_str(), c.num_heads, c.head_dim, c.sliding_window, c.index_topk, c.index_n_heads,
              c.index_head_dim, o.batch, o.context);
  std::printf("  workload  %s\n", w.what.c_str());
  if (!w.implementation.empty()) std::printf("  kernel    %s\n", w.implementation.c_str());
  const double median = percentile(us, 0.5);
  std::printf("  time      median %.2f us   p10 %.2f   p90 %.2f   min %.2f   max %.2f   (%d graph replays after %d warm-up)\n",
              median, percentile(us, 0.1), percentile(us, 0.9), *std::min_element(us.begin(), us.end()),
              *std::max_element(us.begin(), us.end()), o.iters, o.warmup);
  const double seconds = median * 1e-6;
  std::printf("  memory    %.3f MB counted (%s) -> %.1f GB/s = %.1f%% of the %.1f TB/s copy ceiling\n", w.bytes * 1e-6,
              w.bytes_note.c_str(), w.bytes / seconds * 1e-9, 100.0 * w.bytes / seconds / kCopyBytesPerSecond,
              kCopyBytesPerSecond * 1e-12);
  std::printf("  compute   %.3f GFLOP -> %.2f TFLOP/s = %.2f%% of bf16 GEMM %.0f TFLOP/s (%.2f%% of fp8 %.0f)\n",
              w.flops * 1e-9, w.flops / seconds * 1e-12, 100.0 * w.flops / seconds / kBf16FlopsPerSecond,
              kBf16FlopsPerSecond * 1e-12, 100.0 * w.flops / seconds / kFp8FlopsPerSecond, kFp8FlopsPerSecond * 1e-12);
}

std::string format_string(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

}  // namespace dsv4::bench

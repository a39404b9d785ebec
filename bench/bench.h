// Benchmarks of the CUDA operations (dsv4 bench is the command line over them): each op sets up
// random inputs at a preset's dimensions, times runs with CUDA events (warm-up runs, then one
// event pair per run) and prints the median and spread next to the bytes it must move, the work
// it does and the H200 ceilings.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

#include "bench/bench_options.h"
#include "dsv4/config.h"
#include "dsv4/cuda/runtime.h"

namespace dsv4::bench {

// H200 ceilings the results are compared with.
inline constexpr double kCopyBytesPerSecond = 4.2e12;  // HBM3e, read + write
inline constexpr double kBf16FlopsPerSecond = 760e12;  // dense bf16 tensor-core GEMM
inline constexpr double kFp8FlopsPerSecond = 1350e12;  // dense fp8 tensor-core GEMM

// What one operation was timed at and what a run of it moves and computes.
struct Workload {
  std::string what;            // one line: shapes and formats
  double bytes = 0;            // bytes a run must read and write at least
  std::string bytes_note;      // which bytes are counted
  double flops = 0;            // multiply-adds x 2
  std::string implementation;  // the implementation the op's chooser picked; empty: the op has one
};

// Times `launch` (which queues one run on `stream`, capturable: no allocation, no synchronization)
// as the replays of a CUDA graph it is captured into, so that host work and launch gaps stay out of
// the numbers, as in an engine that replays its step graph; microseconds of each timed run.
std::vector<double> time_runs(const BenchOptions& o, cudaStream_t stream, const std::function<void()>& launch);
// Times replays of an instantiated graph on `stream`.
std::vector<double> time_graph(const BenchOptions& o, cudaStream_t stream, cudaGraphExec_t graph);
double percentile(std::vector<double> values, double q);
void print_result(const BenchOptions& o, const ModelConfig& c, const Workload& w, const std::vector<double>& us);

// printf into a string.
std::string format_string(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// The ops timed on their own (bench/ops.cpp), in the order `dsv4 bench --help` lists them.
struct BenchOp {
  const char* name;
  bool decode;  // one token per sequence against `context` tokens (else a `context`-token chunk)
  void (*run)(const BenchOptions& o, const ModelConfig& c, cuda::Stream& stream);
};
const std::vector<BenchOp>& bench_ops();

}  // namespace dsv4::bench

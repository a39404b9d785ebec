// The CUDA engine's step graphs (Engine::run_step_graph): one CUDA graph per step key, captured
// the first time the key is seen and replayed for every later step of that key.
#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "dsv4/cuda/runtime.h"

namespace dsv4::cuda {

class StepGraphs {
 public:
  StepGraphs() = default;
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  bool has(uint64_t key) const { return graphs_.count(key) != 0; }
  // Captures what `enqueue` queues on `stream` into the graph of `key` (new) and launches it.
  void capture(uint64_t key, cudaStream_t stream, const std::function<void()>& enqueue);
  // Launches the graph of `key` (captured) on `stream`.
  void launch(uint64_t key, cudaStream_t stream) const;

 private:
  std::map<uint64_t, cudaGraphExec_t> graphs_;
};

}  // namespace dsv4::cuda

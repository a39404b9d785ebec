// One CUDA graph per step key (Engine::step_graph_key): the work of a begun step — the engine's
// run_layer calls and whatever the caller queues between them on Engine::cuda_stream() — is
// captured the first time its key is seen and replayed for every later step of that key. The
// caller keeps the activation buffers the work reads and writes at fixed addresses.
#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"

namespace dsv4::cuda {

class StepGraphs {
 public:
  StepGraphs() = default;
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  // Launches the graph of engine.step_graph_key() on engine.cuda_stream(), capturing `enqueue`
  // (which queues the step's work on that stream) into it first if the key is new. Returns whether
  // it replayed a graph captured earlier. A key of 0 (no step graph: the cpu backend) runs
  // `enqueue` directly.
  bool run(const Engine& engine, const std::function<void()>& enqueue);

  int captures() const { return captures_; }
  int replays() const { return replays_; }

 private:
  std::map<uint64_t, cudaGraphExec_t> graphs_;
  int captures_ = 0, replays_ = 0;
};

}  // namespace dsv4::cuda

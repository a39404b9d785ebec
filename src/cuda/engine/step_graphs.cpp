#include "dsv4/cuda/step_graphs.h"

namespace dsv4::cuda {

StepGraphs::~StepGraphs() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
}

bool StepGraphs::run(const Engine& engine, const std::function<void()>& enqueue) {
  const uint64_t key = engine.step_graph_key();
  if (key == 0) {
    enqueue();
    return false;
  }
  const cudaStream_t stream = engine.cuda_stream();
  auto it = graphs_.find(key);
  const bool replay = it != graphs_.end();
  if (!replay) {
    cudaGraph_t graph = nullptr;
    DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);  // leaves the stream usable; the partial graph goes
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    DSV4_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    check_status(status, "cudaGraphInstantiate", __FILE__, __LINE__);
    it = graphs_.emplace(key, exec).first;
    ++captures_;
  } else {
    ++replays_;
  }
  DSV4_CUDA_CHECK(cudaGraphLaunch(it->second, stream));
  return replay;
}

}  // namespace dsv4::cuda

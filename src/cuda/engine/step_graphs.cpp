#include "cuda/engine/step_graphs.h"

namespace dsv4::cuda {

StepGraphs::~StepGraphs() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
}

void StepGraphs::capture(uint64_t key, cudaStream_t stream, const std::function<void()>& enqueue) {
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
  graphs_[key] = exec;
  launch(key, stream);
}

void StepGraphs::launch(uint64_t key, cudaStream_t stream) const {
  DSV4_CUDA_CHECK(cudaGraphLaunch(graphs_.at(key), stream));
}

}  // namespace dsv4::cuda

// One attention layer of the CUDA engine as a sequence of the operations of include/dsv4/cuda on
// the engine's stream (SPEC §2-§6, §12), following the layer's recipe: projections and norms,
// window rows into the cache, the compressor and the indexer of source layers, sparse attention,
// the output projection. No allocation, no synchronization, no host copy when the activations
// are device views, so a step's layers can be captured into a CUDA graph.
#pragma once

#include <optional>
#include <vector>

#include "cuda/engine/device_caches.h"
#include "cuda/engine/layer_weights.h"
#include "cuda/engine/step_metadata.h"
#include "cuda/engine/workspace.h"
#include "dsv4/cuda/output.h"
#include "dsv4/cuda/qkv.h"
#include "dsv4/engine.h"
#include "model/layer_recipe.h"

namespace dsv4::cuda {

// What the pipeline reads; the engine owns it all and outlives the pipeline.
struct LayerPipelineInputs {
  const ModelConfig* config = nullptr;
  const std::vector<LayerRecipe>* recipes = nullptr;
  const std::vector<std::optional<DeviceLayerWeights>>* weights = nullptr;  // nullopt: absent MTP layer
  const DeviceBuffer* main_rope = nullptr;      // [max_context, rope_head_dim] f32
  const DeviceBuffer* compress_rope = nullptr;  // [max_context, rope_head_dim] f32
  int64_t max_context = 0;
  DeviceCaches* caches = nullptr;
  const StepMetadata* step = nullptr;
  Workspace* workspace = nullptr;
  const BlasLt* blas = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  Communicator* communicator = nullptr;  // tensor parallelism, else nullptr
  bool split_indexer = false;            // the index heads are the rank's share
};

class LayerPipeline {
 public:
  explicit LayerPipeline(const LayerPipelineInputs& in) : in_(in) {}

  // Runs `layer` over the step: hidden_in / attn_out [step tokens, hidden] f32, on the host
  // (staged through the workspace; the call then waits for the stream) or on the engine's device.
  void run(int layer, const TensorView& hidden_in, const TensorView& attn_out);
  // The scratch every op of the largest step needs (run_linear, the output projection, the
  // attention's row split): what the workspace's scratch is sized to.
  size_t scratch_bytes(int64_t max_tokens) const;

 private:
  const ModelConfig& config() const { return *in_.config; }
  const LayerRecipe& recipe(int layer) const { return (*in_.recipes)[static_cast<size_t>(layer)]; }
  const DeviceLayerWeights& weights(int layer) const { return *(*in_.weights)[static_cast<size_t>(layer)]; }
  TensorView view(void* data, DType dtype, const std::vector<int64_t>& shape) const;
  TensorView rope_table(int layer) const;
  void project(const TensorView& x, const DeviceWeight& w, const TensorView& y) const;
  // An insert into `cache` at the step's positions with the layer's RoPE table (rows, norm and
  // position offset left to the caller).
  CacheInsertParams insert_params(int layer, RowQuantizer quantizer, const TensorView& slots,
                                  const PagedCache& cache) const;
  OutputProjectionParams output_params(int layer, const TensorView& o, const TensorView& y) const;
  void compress(int layer);
  void index(int layer);
  void attend(int layer);

  LayerPipelineInputs in_;
};

}  // namespace dsv4::cuda

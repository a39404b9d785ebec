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
#include "dsv4/cuda/attention.h"
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
  int64_t max_tokens = 0;  // per step and per draft block call
  DeviceCaches* caches = nullptr;
  const StepMetadata* step = nullptr;
  const DraftBlockMetadata* draft_block = nullptr;  // the current draft block call (DSpark)
  Workspace* workspace = nullptr;
  const BlasLt* blas = nullptr;
  cudaStream_t stream = nullptr;
  // The indexer branch's lane (compressor and indexer of source layers), run beside the query
  // projection and the window insert when set: a second stream with its own cuBLASLt workspace
  // and scratch. nullptr: everything on `stream`.
  cudaStream_t aux_stream = nullptr;
  const BlasLt* aux_blas = nullptr;
  int device = 0;
  Communicator* communicator = nullptr;  // tensor parallelism, else nullptr
  bool split_indexer = false;            // the index heads are the rank's share
};

class LayerPipeline {
 public:
  explicit LayerPipeline(const LayerPipelineInputs& in);
  ~LayerPipeline();
  LayerPipeline(const LayerPipeline&) = delete;
  LayerPipeline& operator=(const LayerPipeline&) = delete;

  // Runs `layer` over the step: hidden_in / attn_out [step tokens, hidden] f32, on the host
  // (staged through the workspace; the call then waits for the stream) or on the engine's device.
  void run(int layer, const TensorView& hidden_in, const TensorView& attn_out);
  // DSpark draft layers (SPEC §13.1), in a step: main_x = main_norm(main_proj(main_hidden)) with
  // the first draft layer's weights, then every draft layer's window rows of the step's tokens
  // from main_x. main_hidden [step tokens, hidden · targets] f32 on the host (staged; the call
  // then does not wait) or the engine's device.
  void run_draft_context(const TensorView& main_hidden);
  // DSpark, outside a step: draft layer `layer` over the blocks draft_block holds. The block's
  // keys go to the workspace's block-key cache, not to the window. Activations as for run().
  void run_draft_block(int layer, const TensorView& hidden_in, const TensorView& attn_out);
  // The scratch every op of the largest step needs (run_linear, the output projection, the
  // attention's row split): what the workspace's scratch is sized to.
  size_t scratch_bytes(int64_t max_tokens) const;

 private:
  const ModelConfig& config() const { return *in_.config; }
  const LayerRecipe& recipe(int layer) const { return (*in_.recipes)[static_cast<size_t>(layer)]; }
  const DeviceLayerWeights& weights(int layer) const { return *(*in_.weights)[static_cast<size_t>(layer)]; }
  // A call's activations on the device: the input x [T, hidden] bf16, and where the f32 output
  // goes (attn_out, or the staging buffer when attn_out is host memory).
  struct Activations {
    TensorView x;
    float* out = nullptr;
  };

  // Where a piece of a layer runs: its stream, the scratch of its GEMMs and their cuBLASLt.
  struct Lane {
    cudaStream_t stream;
    void* scratch;
    const BlasLt* blas;
  };
  Lane main_lane() const { return {in_.stream, in_.workspace->scratch, in_.blas}; }
  Lane aux_lane() const;

  // scratch_bytes of steps of exactly T tokens.
  size_t scratch_bytes_at(int64_t T) const;
  TensorView view(void* data, DType dtype, const std::vector<int64_t>& shape) const;
  TensorView rope_table(int layer) const;
  void project(const TensorView& x, const DeviceWeight& w, const TensorView& y) const { project(x, w, y, main_lane()); }
  void project(const TensorView& x, const DeviceWeight& w, const TensorView& y, const Lane& lane) const;
  // An insert into `cache` at `positions` [T] i32 with the layer's RoPE table (rows, norm and
  // position offset left to the caller).
  CacheInsertParams insert_params(int layer, RowQuantizer quantizer, const TensorView& positions,
                                  const TensorView& slots, const PagedCache& cache) const;
  OutputProjectionParams output_params(int layer, const TensorView& positions, const TensorView& o,
                                       const TensorView& y) const;
  // The pieces of a layer call over T tokens at `positions`.
  Activations load_input(const char* operation, int layer, const TensorView& hidden_in, const TensorView& attn_out,
                         int64_t T);
  void project_queries(int layer, const TensorView& x, const TensorView& positions);
  void insert_window_rows(int layer, const TensorView& x, const TensorView& positions, const TensorView& slots,
                          const PagedCache& cache);
  void project_output(int layer, const TensorView& positions, float* out, const TensorView& attn_out);
  void compress(int layer, const Lane& lane);
  void index(int layer, const Lane& lane);
  void attend(int layer);
  // In a step that stages the layer's attention (StepMetadata): the pages its tokens attend,
  // decoded to bf16 pages once (run_cache_stage), and `a` pointed at them: the same bits.
  void stage_attended_pages(int layer, SparseAttentionParams& a);
  // Pool `pool`'s staged pages at `pages` with the block table `table` by step sequence.
  PagedCache stage_pool(int pool, const PagedCache& source, const AttentionStage::Table& table, std::byte* pages);

  LayerPipelineInputs in_;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;  // the aux lane's start after q_norm and its end
};

}  // namespace dsv4::cuda

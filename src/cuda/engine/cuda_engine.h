// The CUDA backend (Backend::cuda) behind the step engine's protocol: the layer recipes run as
// sequences of the operations of include/dsv4/cuda (LayerPipeline) over paged caches that live on
// the device (DeviceCaches), on one stream: the caller's (EngineOptions::cuda_stream) or the
// engine's own. docs/cuda.md, "Engine and bench".
//
// What happens where:
//  * create: every layer's weights are converted and uploaded, the cache arenas, the RoPE tables,
//    the step metadata staging and one workspace sized for max_tokens_per_step tokens of
//    max_sequences sequences are allocated (workspace.h). Nothing is allocated afterwards.
//  * begin_step: the page bookkeeping (KvCacheManager::reserve, copy-on-write copies queued on the
//    stream) and one upload of the step's metadata (step_metadata.h).
//  * run_layer: LayerPipeline::run; with device activations nothing waits and the step's layers
//    can be captured into a CUDA graph. Host activations are staged, and the call then waits for
//    the stream.
//  * layer_picks: copies the picks of an index source to the host (waits for the stream).
// Every host<->device copy is queued on the stream; nothing synchronizes the whole device.
//
// Numerics follow the layer recipes with bf16 activations: bf16 projections with fp32
// accumulation (fp8 weights dequantized exactly; activations fp8-quantized where the recipe says),
// fp32 norms / RoPE / softmax, rows fake-quantized as the recipe says and stored in the kv
// format's bytes. Differences from the CPU reference: index scores in fp32 (the reference sums in
// bf16), the attention does not round its exponentials to bf16, summation orders.
// Precision::fp32 turns off the fake quantization and bf16 rounding of intermediate rows but keeps
// bf16 GEMM inputs (the kernels' activation type).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "cuda/engine/device_caches.h"
#include "cuda/engine/layer_pipeline.h"
#include "cuda/engine/layer_weights.h"
#include "cuda/engine/step_graphs.h"
#include "cuda/engine/step_metadata.h"
#include "cuda/engine/workspace.h"
#include "dsv4/cuda/runtime.h"
#include "engine/step_engine.h"
#include "model/layer_recipe.h"

namespace dsv4::cuda {

class CudaEngine final : public StepEngine {
 public:
  // Throws when no CUDA device is present or the options / weights do not fit the config.
  CudaEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights, const EngineOptions& options);
  ~CudaEngine() override;

  EngineMemory memory() const override;
  CUstream_st* cuda_stream() const override { return stream_; }
  uint64_t step_graph_key() const override { return step_metadata_->graph_key(); }

  // Diagnostics: window rows [first, first + n) of a sequence in `layer`'s cache, decoded
  // ([n, head_dim] f32; the rows must be readable). Waits for the stream.
  std::vector<float> window_rows(SequenceId sequence, int layer, int64_t first, int64_t n) const;
  // Diagnostics: the layers whose attention reads staged bf16 pages in the current step
  // (EngineOptions::attention_stage_bytes).
  int staged_attention_layers() const;

 private:
  void add_sequence_caches(SequenceId id) override { caches_->add_sequence(id); }
  void fork_sequence_caches(SequenceId parent, SequenceId child) override { caches_->fork_sequence(parent, child); }
  void release_sequence_caches(SequenceId id) override { caches_->release_sequence(id); }
  void rollback_sequence_caches(SequenceId id, int64_t new_length) override { caches_->rollback(id, new_length); }
  int64_t cached_length(SequenceId id) const override { return caches_->manager().sequence_length(id); }
  int64_t cached_bytes(SequenceId id) const override { return caches_->manager().sequence_bytes(id); }
  void prepare_step(const StepLayout& step) override;
  void run_layer_step(int layer, const TensorView& hidden_in, const TensorView& attn_out) override;
  bool accepts_activations_on(Device) const override { return true; }  // host views are staged
  HostTensor read_picks(int layer) const override;
  void commit_sequence(const StepChunk& chunk) override;
  void run_draft_context_step(const TensorView& main_hidden) override;
  void run_draft_block_layer(int layer, const std::vector<SequenceId>& sequences, const std::vector<int64_t>& lengths,
                             const TensorView& hidden_in, const TensorView& attn_out) override;
  void capture_step_graph(uint64_t key, const std::function<void()>& enqueue) override {
    graphs_.capture(key, stream_, enqueue);
  }
  void launch_step_graph(uint64_t key) override { graphs_.launch(key, stream_); }

  int device_ = 0;
  std::optional<Stream> own_stream_;  // when the caller gave none
  cudaStream_t stream_ = nullptr;
  BlasLt blas_;
  // The indexer branch's lane (LayerPipelineInputs::aux_stream); none with a communicator, whose
  // collectives must stay in one order on one stream.
  std::optional<Stream> aux_stream_;
  std::optional<BlasLt> aux_blas_;
  std::vector<std::optional<DeviceLayerWeights>> layers_;  // nullopt: MTP layer absent from the checkpoint
  DeviceBuffer main_rope_, compress_rope_;                  // [max_context, rope_head_dim] f32
  std::unique_ptr<DeviceCaches> caches_;
  std::unique_ptr<StepMetadata> step_metadata_;
  std::unique_ptr<DraftBlockMetadata> draft_block_;  // with DSpark draft layers
  Workspace workspace_;
  std::unique_ptr<LayerPipeline> pipeline_;
  StepGraphs graphs_;  // Engine::run_step_graph; its graphs read the buffers above
};

}  // namespace dsv4::cuda

// The CUDA backend of dsv4::Engine (Backend::cuda): the attention layers of SPEC §2-§6 / §12 as a
// sequence of the operations of include/dsv4/cuda on one stream, over paged caches that live on
// the device (docs/cuda.md, "Engine and bench").
//
// What happens where:
//  * create: every layer's weights are converted and uploaded, the cache arenas, the RoPE tables
//    and one workspace sized for max_tokens_per_step tokens of max_sequences sequences are
//    allocated. Nothing is allocated afterwards.
//  * begin_step: the page bookkeeping (KvCacheManager::reserve, copy-on-write copies queued on the
//    device) and one upload of the step's metadata: positions, per-layer block tables and slots.
//  * run_layer: kernels and cuBLASLt GEMMs queued on stream(); no allocation, no synchronization
//    and no host copy when hidden_in and attn_out are device views, so the run_layer calls of a
//    step can be captured into a CUDA graph. Host views are accepted too: hidden_in is copied to
//    the device and attn_out back, and the call then waits for its results.
//  * layer_picks: copies the picks of an index source to the host (waits for the stream).
//
// Numerics follow Precision::reference with bf16 activations: bf16 projections with fp32
// accumulation (fp8 weights dequantized exactly; activations fp8-quantized where the reference
// quantizes them), fp32 norms / RoPE / softmax, rows fake-quantized as the reference does and
// stored in the kv_format's byte format. Differences from the CPU reference: index scores in fp32
// (the reference sums in bf16), the attention does not round its exponentials to bf16, summation
// orders. Precision::fp32 turns off the fake quantization and bf16 rounding of intermediate rows
// but keeps bf16 GEMM inputs (the kernels' activation type).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "cuda/engine/device_caches.h"
#include "cuda/engine/layer_weights.h"
#include "cuda/engine/step_upload.h"
#include "dsv4/cuda/output.h"
#include "dsv4/cuda/qkv.h"
#include "dsv4/cuda/runtime.h"
#include "dsv4/engine.h"
#include "engine/sequence_registry.h"

namespace dsv4::cuda {

// The cache formats the engine stores for `options` (an empty kv_format: the formats whose
// decoded rows are exactly the reference's values for the precision: V4.1 "v4.1-native", V4.0
// fp8_ds_mla rows with bf16 index keys, Precision::fp32 bf16 everywhere).
KvFormatSet engine_kv_formats(const ModelConfig& config, const EngineOptions& options);

class CudaEngine final : public Engine {
 public:
  // Throws when no CUDA device is present or the options / weights do not fit the config.
  CudaEngine(const ModelConfig& config, std::shared_ptr<const ModelWeights> weights, const EngineOptions& options);
  ~CudaEngine() override;

  const ModelConfig& config() const override { return config_; }
  const ModelTopology& topology() const override { return topology_; }

  SequenceId add_sequence() override;
  SequenceId fork_sequence(SequenceId parent) override;
  void release_sequence(SequenceId sequence) override;
  int64_t sequence_length(SequenceId sequence) const override;

  void begin_step(const std::vector<StepEntry>& entries) override;
  void run_layer(int layer, const TensorView& hidden_in, const TensorView& attn_out) override;
  HostTensor layer_picks(int layer) const override;
  void end_step() override;

  int64_t sequence_cache_bytes(SequenceId sequence) const override;

  // The stream every operation of the engine is queued on (e.g. to capture run_layer calls into
  // a CUDA graph, or to wait for attn_out).
  cudaStream_t stream() const { return stream_.get(); }
  // Device memory held: weights, cache arenas and state, workspace.
  int64_t device_bytes() const;

 private:
  struct Workspace;
  struct LayerStep;

  void check_layer(const char* operation, int layer) const;
  void check_layer_inputs(int layer) const;
  // A device f32 [tokens, hidden] pointer for an activation argument (host views are staged).
  float* activation(const char* name, const TensorView& v, int layer, float* staging) const;
  bool in_running_step(SequenceId sequence) const;

  // Stages of run_layer.
  void project(const TensorView& x, const DeviceWeight& w, const TensorView& y) const;
  TensorView rope_table_view(const LayerPlan& plan) const;
  // An insert into `cache` at the step's positions with the layer's RoPE table (rows, norm and
  // position offset left to the caller).
  CacheInsertParams insert_params(const LayerPlan& plan, RowQuant quant, const TensorView& slots,
                                  const PagedCache& cache) const;
  OutputProjectionParams output_params(int layer, const TensorView& o, const TensorView& token_position,
                                       const TensorView& y) const;
  void compress(int layer);
  void index(int layer);
  void attend(int layer);

  ModelConfig config_;
  ModelTopology topology_;
  std::shared_ptr<const ModelWeights> weights_;
  EngineOptions options_;
  KvFormatSet formats_;
  int device_ = 0;
  Stream stream_;
  BlasLt blas_;
  std::vector<std::optional<DeviceLayerWeights>> layers_;  // nullopt: MTP layer absent from the checkpoint
  DeviceBuffer main_rope_, compress_rope_;                  // [max_context, rope_head_dim] f32
  std::unique_ptr<DeviceCaches> caches_;
  std::unique_ptr<Workspace> workspace_;
  std::unique_ptr<StepUpload> upload_;

  SequenceRegistry sequences_;

  bool in_step_ = false;
  std::vector<StepEntry> step_entries_;
  int64_t step_tokens_ = 0;
  // [step tokens] i32 on the device: the token's entry in the step (row of every block table),
  // its position, its sequence's slot in the compressor rings.
  TensorView token_sequence_, token_position_, state_slot_;
  std::vector<LayerStep> layer_steps_;          // per layer
  std::vector<uint8_t> ran_;                    // per layer: ran in this step
};

}  // namespace dsv4::cuda

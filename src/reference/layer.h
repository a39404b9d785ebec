// One attention layer of the CPU reference over one engine step: V4.1 (SPEC §2-§6) and V4.0 as
// transformers computes it (SPEC §12). The step is a ragged batch of chunks, one per sequence:
// prefill chunks of any length and single decode tokens, each continuing its sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/engine.h"
#include "dsv4/weights.h"
#include "reference/ops.h"
#include "reference/cache_store.h"

namespace dsv4::reference {

// A projection as the reference multiplies it.
struct Projection {
  std::vector<float> weight;          // [out, in] fp32 (fp8 weights dequantized)
  int64_t out = 0, in = 0;
  int64_t fp8_activation_block = 0;   // > 0: activations are fp8-quantized in blocks (fp8 weights)
};

// How the rows a layer caches are fake-quantized (SPEC §2.2 step 6, §3.4, §10).
enum class RowQuantization : uint8_t {
  none,
  fp8_all_32,    // V4.1 window rows: e4m3, ue8m0 scale per 32 channels, all channels
  fp8_nope_64,   // V4.0 window and compressed rows: e4m3, ue8m0 per 64 channels, RoPE channels kept
  fp4_e4m3_16,   // V4.1 compressed rows: e2m1, e4m3 scale per 16 channels
};

struct CompressorParameters {
  CompressorGeometry geometry;
  Projection projection;              // [row_width, hidden]: kv rows, then gate rows
  std::vector<float> norm;            // [dim]
  std::vector<float> position_bias;   // [ratio, coff·dim]; empty: none (V4.1)
  // Its ring of projected token rows (slot = position % span) in the sequence's compressor state.
  int64_t state_offset = 0;
  int64_t state_floats() const { return geometry.span() * geometry.row_width(); }
};

// Everything one layer needs, resolved once when the engine is created.
struct LayerParameters {
  LayerPlan plan;
  ModelFamily family = ModelFamily::v4_1;
  bool bf16 = false;                  // Precision::reference: round op outputs to bf16
  float eps = 1e-6f;
  std::vector<float> rope_freqs;      // the layer's table (main, or compress + YaRN)
  Projection wq_a, wq_b, wkv, wo_a, wo_b;
  std::vector<float> q_norm, kv_norm, attn_sink;
  bool q_head_norm = false;           // V4.0: per-head RMS normalization of q without weight
  RowQuantization window_quantization = RowQuantization::none;
  RowQuantization compressed_quantization = RowQuantization::none;
  bool indexer_fp4 = false;           // V4.1 reference: FP4 fake quantization of indexer q and k
  // kv sources
  CompressorParameters compressor;
  // index keys: V4.1 from the latent (wk, k_norm); V4.0 CSA from the indexer's own compressor
  Projection indexer_wk;
  std::vector<float> indexer_k_norm;
  CompressorParameters index_compressor;
  // index sources
  Projection indexer_wq_b, indexer_weights_proj;
  float indexer_weight_scale = 1.0f;  // index_head_dim^-0.5 · index_n_heads^-0.5 (of the whole model)
};

// Checks the layer's tensors against the plan and converts them. Throws naming layer, tensor,
// shape and expectation. `index_weight_heads`: the index heads the index weight scale counts, when
// `config` is a tensor-parallel shard whose indexer holds only its rank's share (0: index_n_heads).
LayerParameters prepare_layer(const ModelConfig& config, const LayerPlan& plan, const LayerWeights& weights,
                              Precision precision, int index_weight_heads = 0);

// What the layer caches per sequence.
LayerCacheShape layer_cache_shape(const ModelConfig& config, const LayerParameters& layer);

// One sequence's tokens in a step: tokens [first_token, first_token + tokens) of the step at
// positions [start, start + tokens).
struct StepChunk {
  SequenceId sequence = 0;
  int64_t first_token = 0;
  int64_t tokens = 0;
  int64_t start = 0;
};

struct StepLayout {
  std::vector<StepChunk> chunks;
  std::vector<int64_t> positions;     // [T]
  std::vector<int32_t> chunk_of;      // [T]
  int64_t tokens() const { return static_cast<int64_t>(positions.size()); }
};

// Per-token rows of different lengths (token t: values[offset[t] .. offset[t + 1])).
template <class T>
struct RaggedRows {
  std::vector<int64_t> offset;
  std::vector<T> values;
  const T* row(int64_t t) const { return values.data() + offset[static_cast<size_t>(t)]; }
  int64_t length(int64_t t) const { return offset[static_cast<size_t>(t) + 1] - offset[static_cast<size_t>(t)]; }
};

// What a layer published in the current step for the layers after it.
struct LayerPublication {
  bool ran = false;
  std::vector<int32_t> picks;          // index sources: [T, index_topk], sorted, −1 padded
  RaggedRows<uint8_t> candidate_mask;  // the candidate source: per token, over its kv source's entries
  RaggedRows<float> index_scores;      // index sources, only when recording: the masked scores top-k ran on
};

// The collectives of a tensor-parallel rank (dsv4/parallel.h); the default: the whole model.
struct RankReduction {
  // Sums the partial output of the rank's heads (kept fp32 until then) and, with split_indexer,
  // the partial index scores over the ranks.
  Communicator* communicator = nullptr;
  bool split_indexer = false;  // the layer's index heads are the rank's share of them
};

// Runs layer `layer.plan.layer` of the step: hidden_in, attn_out [T, hidden] (may alias).
// `published` holds every layer's publication of this step (indexed by layer); the layer writes
// its own into published[layer]. Writes the layer's new cache rows to `caches`.
void run_layer_step(const ModelConfig& config, const LayerParameters& layer, const StepLayout& step,
                    CacheStore& caches, const float* hidden_in, float* attn_out,
                    std::vector<LayerPublication>& published, bool record_index_scores,
                    const RankReduction& ranks = {});

}  // namespace dsv4::reference

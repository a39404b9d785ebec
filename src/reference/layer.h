// One attention layer of the CPU reference over one engine step: V4.1 (SPEC §2-§6) and V4.0 as
// transformers computes it (SPEC §12). The step is a ragged batch of chunks, one per sequence:
// prefill chunks of any length and single decode tokens, each continuing its sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/types.h"
#include "dsv4/weights.h"
#include "common/step_layout.h"
#include "model/layer_recipe.h"
#include "reference/ops.h"
#include "reference/cache_store.h"

namespace dsv4 {
class Communicator;  // dsv4/parallel.h
}  // namespace dsv4

namespace dsv4::reference {

// A projection as the reference multiplies it.
struct Projection {
  std::vector<float> weight;          // [out, in] fp32 (fp8 weights dequantized)
  int64_t out = 0, in = 0;
  int64_t fp8_activation_block = 0;   // > 0: activations are fp8-quantized in blocks (fp8 weights)
};

struct CompressorParameters {
  CompressorGeometry geometry;
  Projection projection;              // [row_width, hidden]: kv rows, then gate rows
  std::vector<float> norm;            // [dim]
  std::vector<float> position_bias;   // [ratio, coff·dim]; empty: none (V4.1)
  // Its ring of projected token rows (slot = position % span) in the sequence's compressor state.
  int64_t state_offset = 0;
  int64_t state_floats() const { return geometry.ring_floats(); }
};

// Everything one layer needs, resolved once when the engine is created: its recipe and its
// weights converted as the reference multiplies them.
struct LayerParameters {
  LayerRecipe recipe;
  Projection wq_a, wq_b, wkv, wo_a, wo_b;
  std::vector<float> q_norm, kv_norm, attn_sink;
  // kv sources
  CompressorParameters compressor;
  // index keys: V4.1 from the latent (wk, k_norm); V4.0 CSA from the indexer's own compressor
  Projection indexer_wk;
  std::vector<float> indexer_k_norm;
  CompressorParameters index_compressor;
  // index sources
  Projection indexer_wq_b, indexer_weights_proj;
  // DSpark stage 0: the draft model's entry from the target's hidden states (SPEC §13.1)
  Projection main_proj;
  std::vector<float> main_norm;
};

// Checks the layer's tensors against the recipe's plan and converts them. Throws naming layer,
// tensor, shape and expectation.
LayerParameters prepare_layer(const ModelConfig& config, const LayerRecipe& recipe, const LayerWeights& weights);

// What the layer caches per sequence.
LayerCacheShape layer_cache_shape(const ModelConfig& config, const LayerParameters& layer);

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

// ----- DSpark draft layers (SPEC §13.1)

// main_x [T, hidden] = main_norm(main_proj(main_hidden)), main_hidden [T, hidden · targets]: the
// draft model's context input, computed once with stage 0's weights and given to every stage.
void draft_main_input(const ModelConfig& config, const LayerParameters& stage0, int64_t T, const float* main_hidden,
                      float* main_x);

// A draft stage's window rows of the step's tokens from main_x [T, hidden] (its own wkv, kv_norm,
// RoPE at the token's position and row quantizer), stored at the tokens' positions.
void write_draft_context(const ModelConfig& config, const LayerParameters& stage, const StepLayout& step,
                         CacheStore& caches, const float* main_x);

// One sequence's draft block: dspark_block_size rows at positions length … length + B − 1.
struct DraftBlock {
  SequenceId sequence = 0;
  int64_t length = 0;  // committed tokens (p0 + 1), >= 1
};

// A draft stage over blocks (hidden_in, attn_out [blocks · B, hidden], may alias): every row
// attends the committed window rows of positions max(0, p0 − W + 1) … p0 and all B rows of its
// block, itself included. Reads the caches; the block's keys are not stored.
void run_draft_block(const ModelConfig& config, const LayerParameters& stage, const std::vector<DraftBlock>& blocks,
                     const CacheStore& caches, const float* hidden_in, float* attn_out);

}  // namespace dsv4::reference

// How one attention layer computes: every numerics decision that depends on the model family, the
// layer's kind and the precision, made once here and read by every backend (the CPU reference in
// src/reference, the CUDA engine in src/cuda/engine), so that their numerics cannot drift apart.
// The backends decide only how to compute, never what (SPEC §2-§6, §8, §12).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/types.h"
#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"
#include "dsv4/weights.h"

namespace dsv4 {

// A compressor: how token rows pool into compressed entries (SPEC §3).
struct CompressorGeometry {
  int64_t ratio = 0;     // tokens per entry; entry w closes at position w·ratio + ratio − 1
  bool overlap = false;  // V4.0 CSA: entry w also pools the first half of window w − 1
  bool gated = true;     // false: V4.1 ratio 1, a plain projection
  int64_t dim = 0;       // channels of one entry (head_dim, or index_head_dim for the V4.0 indexer's)
  // Channels of one projected token row: [kv (coff·dim) | score (coff·dim)], coff = 1 + overlap.
  int64_t row_width() const { return (gated ? 2 : 1) * (overlap ? 2 : 1) * dim; }
  // Tokens whose projected rows an entry can read: the window, plus the previous one when overlapping.
  int64_t span() const { return (overlap ? 2 : 1) * ratio; }
  // Rows the ring keeps beyond the span: the tokens a rollback may take back (EngineOptions::
  // max_rollback). The ring is position-addressed (row of position p at p % ring_rows()), so the
  // rows of rejected tokens never overwrite rows the accepted ones still need.
  int64_t rollback_rows = 0;
  // Rows of the ring that keeps the projected rows of open groups between steps.
  int64_t ring_rows() const { return span() + rollback_rows; }
  int64_t ring_floats() const { return ring_rows() * row_width(); }
};

// How a layer weight is used.
struct WeightRecipe {
  // Multiplied by a GEMM (a projection); otherwise a vector read as fp32 (norms, sinks, biases).
  bool projection = false;
  // Precision::reference with an fp8 checkpoint tensor: the activation is quantized to fp8 in
  // blocks of the weight's input block before the product (the reference's fp8 GEMM). Other fp8
  // projections are dequantized and multiplied as bf16.
  bool fp8_activations = false;
  // The reference multiplies it in fp32 (the compressors, SPEC §3.2): fp32 checkpoint values are
  // not rounded.
  bool fp32_product = false;
};
WeightRecipe weight_recipe(WeightRole role);

// The per-pair RoPE frequencies f_i, i < rope_dim / 2, in fp32: base^(-2i/rope_dim), blended with
// f_i / factor by the YaRN ramp when params.yarn (the correction range in double, the blend in
// fp32, as DeepSeek's reference does). No attention scaling.
std::vector<float> rope_frequencies(const RopeParams& params, int64_t rope_dim);

struct LayerRecipe {
  LayerPlan plan;
  ModelFamily family = ModelFamily::v4_1;
  Precision precision = Precision::reference;
  // Precision::reference: op outputs are rounded to bf16 where DeepSeek's code rounds (SPEC §8).
  bool round_bf16 = false;
  float eps = 1e-6f;
  // [rope_head_dim / 2] of the layer's RoPE: the main one, or the compress one (YaRN) when
  // plan.uses_compress_rope.
  std::vector<float> rope_frequencies;
  bool q_head_norm = false;            // V4.0: per-head RMS normalization of q without a weight
  float softmax_scale = 0.0f;          // head_dim^-0.5
  // Fake quantization of the rows the layer caches (none in Precision::fp32).
  RowQuantizer window_rows = RowQuantizer::none;
  RowQuantizer compressed_rows = RowQuantizer::none;
  RowQuantizer index_rows = RowQuantizer::none;  // index queries and keys (SPEC §4, §15)
  // Index queries and keys are rotated by a Hadamard transform of index_head_dim points after
  // RoPE, before index_rows quantizes them: the official V4.0 indexer (config.indexer_qat, SPEC §15).
  bool index_hadamard = false;
  // kv sources: the compressor of the layer's entries.
  std::optional<CompressorGeometry> compressor;
  // kv sources that own index keys: V4.1 derives them from the compressor's latent (wk, k_norm);
  // V4.0 CSA pools them with the indexer's own compressor, whose ring follows the main one.
  std::optional<CompressorGeometry> index_compressor;
  // index sources: index_head_dim^-0.5 · n^-0.5, n the whole model's index heads.
  float index_weight_scale = 1.0f;
};

// `index_heads_counted`: the index heads the weight scale counts when the config is a
// tensor-parallel shard whose indexer holds only its rank's share (0: config.index_n_heads).
LayerRecipe layer_recipe(const ModelConfig& config, const LayerPlan& plan, Precision precision,
                         int64_t index_heads_counted = 0);

// The index heads a shard's weight scale counts (layer_recipe's index_heads_counted): the whole
// model's, when the shard holds a split indexer of a group of `ranks` ranks; 0 otherwise.
int64_t index_heads_counted(const ModelConfig& shard, IndexerSharding sharding, int ranks);

// The cache formats whose decoded rows are exactly the values `precision` stores: V4.1 reference
// "v4.1-native", V4.0 reference fp8_ds_mla rows with bf16 index keys, fp32 "f32" (the fp32 rows
// themselves, as float_rows storage keeps them). EngineOptions::kv_format "" means this.
KvFormatSet default_kv_formats(const ModelConfig& config, Precision precision);

}  // namespace dsv4

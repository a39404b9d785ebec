#include "model/layer_recipe.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "dsv4/error.h"

namespace dsv4 {

WeightRecipe weight_recipe(WeightRole role) {
  switch (role) {
    // The projections DeepSeek's code runs as fp8 GEMMs when the checkpoint stores them in fp8.
    case WeightRole::wq_a:
    case WeightRole::wq_b:
    case WeightRole::wkv:
    case WeightRole::wo_b:
    case WeightRole::indexer_wq_b:
    case WeightRole::main_proj:
      return {.projection = true, .fp8_activations = true};
    // Dequantized and multiplied without activation quantization.
    case WeightRole::wo_a:
    case WeightRole::indexer_wk:
    case WeightRole::indexer_weights_proj:
      return {.projection = true};
    case WeightRole::compressor_wkv:
    case WeightRole::compressor_wgate:
    case WeightRole::indexer_compressor_wkv:
    case WeightRole::indexer_compressor_wgate:
      return {.projection = true, .fp32_product = true};
    default:
      return {};
  }
}

std::vector<float> rope_frequencies(const RopeParams& params, int64_t rope_dim) {
  DSV4_CHECK(rope_dim > 0 && rope_dim % 2 == 0, "rope: rope_dim ", rope_dim, " must be even and positive");
  DSV4_CHECK(params.theta > 1.0, "rope: theta ", params.theta, " must be > 1");
  const int64_t pairs = rope_dim / 2;
  std::vector<float> freqs(static_cast<size_t>(pairs));
  const float base = static_cast<float>(params.theta);
  for (int64_t i = 0; i < pairs; ++i)
    freqs[i] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rope_dim));
  if (!params.yarn) return freqs;
  DSV4_CHECK(params.factor > 0 && params.original_max_position > 0, "rope: YaRN factor ", params.factor,
             " and original_max_position ", params.original_max_position, " must be positive");
  // The correction range is computed in double, the blend in fp32, as the reference does.
  const auto correction_dim = [&](double rotations) {
    return static_cast<double>(rope_dim) *
           std::log(static_cast<double>(params.original_max_position) / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(params.theta));
  };
  const double low = std::max(std::floor(correction_dim(params.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(params.beta_slow)), static_cast<double>(rope_dim - 1));
  if (low == high) high += 0.001;
  const float factor = static_cast<float>(params.factor);
  for (int64_t i = 0; i < pairs; ++i) {
    const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low),
                                  0.0f, 1.0f);
    const float smooth = 1.0f - ramp;  // weight of the original frequency
    freqs[i] = freqs[i] / factor * (1.0f - smooth) + freqs[i] * smooth;
  }
  return freqs;
}

LayerRecipe layer_recipe(const ModelConfig& config, const LayerPlan& plan, Precision precision,
                         int64_t index_heads_counted) {
  const bool v41 = config.family == ModelFamily::v4_1;
  LayerRecipe r;
  r.plan = plan;
  r.family = config.family;
  r.precision = precision;
  r.round_bf16 = precision == Precision::reference;
  r.eps = static_cast<float>(config.rms_norm_eps);
  r.rope_frequencies =
      rope_frequencies(plan.uses_compress_rope ? config.compress_rope : config.main_rope, config.rope_head_dim);
  r.q_head_norm = !v41;
  r.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.head_dim)));
  if (precision == Precision::reference) {
    r.window_rows = v41 ? RowQuantizer::fp8_e4m3_32 : RowQuantizer::fp8_e4m3_nope_64;
    r.compressed_rows = v41 ? RowQuantizer::fp4_e4m3_16 : RowQuantizer::fp8_e4m3_nope_64;
    // The official V4.0 indexer rotates q and k with a Hadamard transform before an FP4
    // quantization (config.indexer_qat); transformers' V4.0 does neither.
    const bool v40_indexer_qat = !v41 && config.indexer_qat;
    r.index_rows = v41 || v40_indexer_qat ? RowQuantizer::fp4_ue8m0_32 : RowQuantizer::none;
    r.index_hadamard = v40_indexer_qat;
  }
  if (plan.owns_compressor)
    r.compressor = CompressorGeometry{.ratio = plan.compress_ratio,
                                      .overlap = plan.kind == AttentionKind::csa,
                                      .gated = !(v41 && plan.compress_ratio == 1),
                                      .dim = config.head_dim};
  if (plan.owns_index_keys && !v41)
    r.index_compressor =
        CompressorGeometry{.ratio = plan.compress_ratio, .overlap = true, .gated = true, .dim = config.index_head_dim};
  if (plan.owns_indexer) {
    const double heads = index_heads_counted > 0 ? static_cast<double>(index_heads_counted)
                                                 : static_cast<double>(config.index_n_heads);
    r.index_weight_scale =
        static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.index_head_dim)) / std::sqrt(heads));
  }
  return r;
}

int64_t index_heads_counted(const ModelConfig& shard, IndexerSharding sharding, int ranks) {
  return sharding == IndexerSharding::split ? shard.index_n_heads * ranks : 0;
}

KvFormatSet default_kv_formats(const ModelConfig& config, Precision precision) {
  if (precision == Precision::fp32) return kv_format_set("f32");
  if (config.family == ModelFamily::v4_1) return kv_format_set("v4.1-native");
  return {"v4.0-reference", KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla, KvRowFormat::bf16};
}

}  // namespace dsv4

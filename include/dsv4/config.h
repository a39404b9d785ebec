// Model configuration (the attention-relevant fields of a DeepSeek V4 / V4.1 checkpoint) and its
// resolution into a per-layer plan. SPEC.md §1 (V4.1) and §12 (V4.0).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsv4 {

enum class ModelFamily : uint8_t { v4_0, v4_1 };
const char* family_name(ModelFamily f);

// What a layer's attention does beyond the sliding window.
enum class AttentionKind : uint8_t {
  sliding,       // window only (ratio 0, also MTP layers of a model without DSpark)
  compressed,    // V4.1: ratio 1 or 2, compressed cache of the kv source, picks of the index source
  csa,           // V4.0: overlapped compressor (ratio 4) + its own indexer with its own compressor
  hca,           // V4.0: non-overlapping compressor, every visible compressed entry attended
  dspark,        // DSpark draft layer (SPEC §13.1): window rows from the target model, a non-causal draft block
};
const char* attention_kind_name(AttentionKind k);

struct RopeParams {
  double theta = 10000.0;
  bool yarn = false;
  double factor = 1.0;                   // YaRN scaling factor
  int64_t original_max_position = 0;     // YaRN original context
  double beta_fast = 32.0;
  double beta_slow = 1.0;
};

// fp8 block quantization of the checkpoint's projection weights (quantization_config).
struct WeightQuantization {
  int block_out = 128;        // rows of one scale block
  int block_in = 128;         // columns of one scale block
  bool ue8m0_scales = true;   // scale_fmt ue8m0 (power-of-two bytes) or fp32 scales
};

struct ModelConfig {
  std::string name;                      // preset name or file the config came from
  ModelFamily family = ModelFamily::v4_1;

  int64_t hidden_size = 0;               // dim
  int num_layers = 0;                    // backbone layers (n_layers)
  int num_mtp_layers = 0;                // MTP / DSpark layers after the backbone, window-only
  int num_heads = 0;                     // n_heads (query heads)
  int64_t head_dim = 512;                // 448 NoPE + 64 RoPE
  int64_t rope_head_dim = 64;            // rotated tail of every head
  int64_t q_lora_rank = 0;
  int o_groups = 0;
  int64_t o_lora_rank = 0;               // per group
  int64_t sliding_window = 128;

  // Per backbone layer; layers beyond the list (MTP) are ratio 0.
  std::vector<int> compress_ratios;
  // V4.0 only: per backbone layer kind (csa / hca / sliding); empty for V4.1.
  std::vector<AttentionKind> layer_kinds;

  // V4.1 sharing (V4.0: every compressed layer is its own source; these stay empty).
  std::vector<int> kv_source_layers;
  std::vector<int> index_source_layers;
  int candidate_source_layer = -1;       // -1: no candidate filtering
  int64_t candidate_topk_blocks = 0;
  int64_t candidate_block_size = 0;

  int index_n_heads = 0;
  int64_t index_head_dim = 128;
  int64_t index_topk = 0;

  // V4.0 only: the official indexer's quantization-aware training path (SPEC §15), applied in
  // Precision::reference: index queries and keys rotated by a Hadamard transform after RoPE, then
  // FP4-quantized. DeepSeek's ModelArgs form turns it on (its code does both); transformers'
  // config.json form and the presets leave it off (transformers does neither). JSON key
  // "indexer_qat" (either form) overrides the default.
  bool indexer_qat = false;

  // M, the longest image span a prefill chunk may carry (SPEC §14; StepEntry::image_spans); 0: the
  // model takes none. ModelArgs / Vision-Exp "vision_max_n_token", transformers V4.1
  // "vision_config.max_image_tokens"; "vision_n_layers": 0 turns it off. Default: V4.1 1024, V4.0 0.
  int64_t vision_max_n_token = 0;

  RopeParams main_rope;                  // ratio-0 layers
  RopeParams compress_rope;              // layers with ratio > 0 (YaRN)
  double rms_norm_eps = 1e-6;

  // DSpark speculative decoding (SPEC §13.1): when dspark_target_layer_ids is not empty, the MTP
  // layers are DSpark draft stages. Their window rows for committed positions come from the target
  // model: the hidden states entering these backbone layers (each averaged over the hc copies),
  // concatenated in this order, through stage 0's main_proj and main_norm. A draft block is
  // dspark_block_size query rows.
  std::vector<int> dspark_target_layer_ids;
  int64_t dspark_block_size = 0;

  std::optional<WeightQuantization> weight_quantization;  // absent: bf16 / fp32 weights
  int tensor_parallel_size = 1;

  int total_layers() const { return num_layers + num_mtp_layers; }
  bool has_dspark() const { return num_mtp_layers > 0 && !dspark_target_layer_ids.empty(); }
  // Width of main_proj's input: hidden_size per target layer.
  int64_t dspark_main_width() const {
    return hidden_size * static_cast<int64_t>(dspark_target_layer_ids.size());
  }
  int compress_ratio(int layer) const {
    return layer < static_cast<int>(compress_ratios.size()) ? compress_ratios[layer] : 0;
  }
};

// One layer's resolved role (SPEC §1.3).
struct LayerPlan {
  int layer = 0;
  AttentionKind kind = AttentionKind::sliding;
  int compress_ratio = 0;
  bool is_mtp = false;
  int dspark_stage = -1;                 // DSpark draft layers: the stage (layer − num_layers); else −1
  bool uses_compress_rope = false;       // compress theta + YaRN, else main theta
  int kv_source = -1;                    // layer whose compressed cache this layer reads; -1: none
  int index_source = -1;                 // layer whose picks this layer uses; -1: none (HCA: all)
  bool owns_compressor = false;          // kv source: compressor + compressed cache
  bool owns_index_keys = false;          // kv source with an indexer: index-key cache (V4.1 wk/k_norm)
  bool owns_indexer = false;             // index source: scores and publishes picks
  bool is_candidate_source = false;
  bool uses_candidates = false;          // index source that masks its scores to the candidates
};

// Which layers a weight set and an engine cover.
enum class LayerSet : uint8_t {
  all,    // the backbone and the MTP layers
  // Only the DSpark draft layers: a drafter beside the target model's engine, which feeds it the
  // target's hidden states (SPEC §13.1; vLLM runs its DSpark drafter this way). The backbone needs
  // no weights and does not run.
  draft,
};
const char* layer_set_name(LayerSet s);
// Whether `set` covers `plan`'s layer.
inline bool layer_in_set(const LayerPlan& plan, LayerSet set) {
  return set == LayerSet::all || plan.kind == AttentionKind::dspark;
}

struct ModelTopology {
  std::vector<LayerPlan> layers;         // total_layers() entries
  const LayerPlan& operator[](int l) const { return layers.at(static_cast<size_t>(l)); }
  int size() const { return static_cast<int>(layers.size()); }
};

// Reads any of the three config forms (transformers deepseek_v4 config.json, the V4.1 config.json
// with or without `text_config`, DeepSeek's inference ModelArgs JSON). Throws dsv4::Error naming
// the field on malformed input. `source` names the file in messages.
ModelConfig parse_config_json(const std::string& text, const std::string& source = "config");
ModelConfig load_config_file(const std::string& path);

// Checks every rule of SPEC §1 (see docs/config.md); throws dsv4::Error naming field, value, rule.
void validate_config(const ModelConfig& config);

// Resolves the per-layer plan; validates first.
ModelTopology resolve_topology(const ModelConfig& config);

// Embedded presets: "v4.1-flash", "v4-flash", "v4-pro", "tiny-v4.1", "tiny-v4".
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

// Either a preset name or a config file path, as the CLI's --preset / --config take them.
ModelConfig config_from_preset_or_file(const std::string& preset, const std::string& file);

}  // namespace dsv4

// Embedded model presets: the released configurations (SPEC §1.1, §1.2) and two small CPU-friendly
// ones with the same structure.
#include <functional>

#include "dsv4/config.h"
#include "dsv4/error.h"

namespace dsv4 {
namespace {

// `pattern` repeated `times` times, appended to `list`.
void append_repeated(std::vector<int>& list, std::initializer_list<int> pattern, int times) {
  for (int i = 0; i < times; ++i) list.insert(list.end(), pattern.begin(), pattern.end());
}

// V4.0 presets list their kinds by ratio: 0 sliding, 4 CSA, anything else HCA.
void set_v40_layers(ModelConfig& c, std::vector<int> ratios) {
  c.family = ModelFamily::v4_0;
  c.num_layers = static_cast<int>(ratios.size());
  c.layer_kinds.clear();
  for (int r : ratios)
    c.layer_kinds.push_back(r == 0 ? AttentionKind::sliding : r == 4 ? AttentionKind::csa : AttentionKind::hca);
  c.compress_ratios = std::move(ratios);
}

// YaRN of the compressed layers, identical in every release (SPEC §1.1, §1.2).
RopeParams released_compress_rope() {
  return RopeParams{.theta = 160000.0, .yarn = true, .factor = 16.0, .original_max_position = 65536,
                    .beta_fast = 32.0, .beta_slow = 1.0};
}

// Fields shared by every preset: head 512 = 448 NoPE + 64 RoPE, main rope theta 10000.
ModelConfig common(const std::string& name) {
  ModelConfig c;
  c.name = name;
  c.head_dim = 512;
  c.rope_head_dim = 64;
  c.main_rope = RopeParams{.theta = 10000.0};
  c.compress_rope = released_compress_rope();
  return c;
}

// SPEC §1.1.
ModelConfig v41_flash() {
  ModelConfig c = common("v4.1-flash");
  c.family = ModelFamily::v4_1;
  c.hidden_size = 5120;
  c.num_layers = 40;
  c.num_mtp_layers = 3;  // DSpark draft layers 40-42
  c.num_heads = 64;
  c.q_lora_rank = 1280;
  c.o_groups = 8;
  c.o_lora_rank = 1024;
  c.sliding_window = 128;
  c.compress_ratios = {0, 0};
  append_repeated(c.compress_ratios, {2}, 18);
  append_repeated(c.compress_ratios, {1}, 20);
  c.kv_source_layers = {2, 8, 14, 20};
  c.index_source_layers = {2, 8, 14, 20, 24, 28, 32, 36};
  c.candidate_source_layer = 20;
  c.vision_max_n_token = 1024;  // SPEC §14.2: image spans are opt-in per prefill call
  c.candidate_topk_blocks = 2048;
  c.candidate_block_size = 8;
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.rms_norm_eps = 1e-20;
  c.weight_quantization = WeightQuantization{.block_out = 32, .block_in = 32, .ue8m0_scales = true};
  c.dspark_target_layer_ids = {37, 38, 39};
  c.dspark_block_size = 5;
  return c;
}

// SPEC §1.2. Each release's compress_ratios list ends with one MTP entry (0), hence one MTP layer.
// The scale format is not pinned there; ue8m0 follows the V4.1 release.
ModelConfig v40(const std::string& name, int64_t hidden, int heads, int64_t q_lora, int o_groups,
                std::vector<int> ratios, int64_t index_topk) {
  ModelConfig c = common(name);
  set_v40_layers(c, std::move(ratios));
  c.hidden_size = hidden;
  c.num_mtp_layers = 1;
  c.num_heads = heads;
  c.q_lora_rank = q_lora;
  c.o_groups = o_groups;
  c.o_lora_rank = 1024;
  c.sliding_window = 128;
  c.index_n_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = index_topk;
  c.rms_norm_eps = 1e-6;
  c.weight_quantization = WeightQuantization{.block_out = 128, .block_in = 128, .ue8m0_scales = true};
  return c;
}

ModelConfig v4_flash() {
  std::vector<int> ratios = {0, 0};
  append_repeated(ratios, {4, 128}, 20);
  ratios.push_back(4);
  return v40("v4-flash", 4096, 64, 1024, 8, std::move(ratios), 512);
}

ModelConfig v4_pro() {
  std::vector<int> ratios = {128, 128};
  append_repeated(ratios, {4, 128}, 29);
  ratios.push_back(4);
  return v40("v4-pro", 7168, 128, 1536, 16, std::move(ratios), 1024);
}

// Small dims that run on a CPU; head 512 / rope 64 are kept because the cache formats and the CUDA
// attention assume them, the 128-wide indexer head as released. Same dims as the golden sets
// (v41a, v40a).
void set_tiny_dims(ModelConfig& c) {
  c.hidden_size = 256;
  c.num_heads = 4;
  c.q_lora_rank = 128;
  c.o_groups = 2;
  c.o_lora_rank = 64;
  c.sliding_window = 16;
  c.index_n_heads = 4;
  c.index_head_dim = 128;
  c.index_topk = 8;
}

// Released V4.1 roles in miniature: window-only layer 0, ratio-2 layers 1-3 sharing kv source 1
// (layer 3 re-scores its keys as its own index source), ratio-1 layers 4-7 sharing kv source 4,
// which is the candidate source; index source 6 masks to its candidates, 5 and 7 reuse picks.
// Candidates cover 8 blocks x 8 entries, so the filter bites past 64 compressed entries. One MTP layer.
ModelConfig tiny_v41() {
  ModelConfig c = common("tiny-v4.1");
  set_tiny_dims(c);
  c.family = ModelFamily::v4_1;
  c.num_layers = 8;
  c.num_mtp_layers = 1;
  c.compress_ratios = {0, 2, 2, 2, 1, 1, 1, 1};
  c.kv_source_layers = {1, 4};
  c.index_source_layers = {1, 3, 4, 6};
  c.candidate_source_layer = 4;
  c.candidate_topk_blocks = 8;
  c.candidate_block_size = 8;
  c.rms_norm_eps = 1e-20;
  c.weight_quantization = WeightQuantization{.block_out = 32, .block_in = 32, .ue8m0_scales = true};
  return c;
}

// V4.0 in miniature: sliding, CSA 4, HCA 16 (the golden v40a rate), CSA 4, and one MTP layer.
ModelConfig tiny_v40() {
  ModelConfig c = common("tiny-v4");
  set_tiny_dims(c);
  set_v40_layers(c, {0, 4, 16, 4});
  c.num_mtp_layers = 1;
  c.rms_norm_eps = 1e-6;
  c.weight_quantization = WeightQuantization{.block_out = 128, .block_in = 128, .ue8m0_scales = true};
  return c;
}

const std::vector<std::pair<std::string, std::function<ModelConfig()>>>& presets() {
  static const std::vector<std::pair<std::string, std::function<ModelConfig()>>> table = {
      {"v4.1-flash", v41_flash}, {"v4-flash", v4_flash}, {"v4-pro", v4_pro},
      {"tiny-v4.1", tiny_v41},   {"tiny-v4", tiny_v40},
  };
  return table;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, make] : presets()) names.push_back(name);
  return names;
}

ModelConfig preset_config(const std::string& name) {
  for (const auto& [preset, make] : presets()) {
    if (preset != name) continue;
    ModelConfig c = make();
    validate_config(c);
    return c;
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  fail("config: unknown preset '", name, "'; expected one of ", known);
}

}  // namespace dsv4

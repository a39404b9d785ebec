// Config parsing (all three forms), validation rules, presets, topology and the `dsv4 plan` tool.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "dsv4/config.h"
#include "dsv4/error.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

std::string golden_path(const std::string& name) { return std::string(DSV4_TEST_DATA_DIR) + "/golden/" + name; }

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// Runs `fn`, expects a dsv4::Error and returns its message.
using test::error_of;

void expect_rope_eq(const RopeParams& a, const RopeParams& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.theta, b.theta);
  EXPECT_EQ(a.yarn, b.yarn);
  if (a.yarn && b.yarn) {
    EXPECT_EQ(a.factor, b.factor);
    EXPECT_EQ(a.original_max_position, b.original_max_position);
    EXPECT_EQ(a.beta_fast, b.beta_fast);
    EXPECT_EQ(a.beta_slow, b.beta_slow);
  }
}

// Every field but the name.
void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_mtp_layers, b.num_mtp_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rope_head_dim, b.rope_head_dim);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.o_groups, b.o_groups);
  EXPECT_EQ(a.o_lora_rank, b.o_lora_rank);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.compress_ratios, b.compress_ratios);
  EXPECT_EQ(a.layer_kinds, b.layer_kinds);
  EXPECT_EQ(a.kv_source_layers, b.kv_source_layers);
  EXPECT_EQ(a.index_source_layers, b.index_source_layers);
  EXPECT_EQ(a.candidate_source_layer, b.candidate_source_layer);
  if (a.candidate_source_layer >= 0) {
    EXPECT_EQ(a.candidate_topk_blocks, b.candidate_topk_blocks);
    EXPECT_EQ(a.candidate_block_size, b.candidate_block_size);
  }
  EXPECT_EQ(a.index_n_heads, b.index_n_heads);
  EXPECT_EQ(a.index_head_dim, b.index_head_dim);
  EXPECT_EQ(a.index_topk, b.index_topk);
  expect_rope_eq(a.main_rope, b.main_rope, "main_rope");
  expect_rope_eq(a.compress_rope, b.compress_rope, "compress_rope");
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.indexer_qat, b.indexer_qat);
  EXPECT_EQ(a.dspark_target_layer_ids, b.dspark_target_layer_ids);
  EXPECT_EQ(a.dspark_block_size, b.dspark_block_size);
  EXPECT_EQ(a.vision_max_n_token, b.vision_max_n_token);
  ASSERT_EQ(a.weight_quantization.has_value(), b.weight_quantization.has_value());
  if (a.weight_quantization) {
    EXPECT_EQ(a.weight_quantization->block_out, b.weight_quantization->block_out);
    EXPECT_EQ(a.weight_quantization->block_in, b.weight_quantization->block_in);
    EXPECT_EQ(a.weight_quantization->ue8m0_scales, b.weight_quantization->ue8m0_scales);
  }
  EXPECT_EQ(a.tensor_parallel_size, b.tensor_parallel_size);
}

// `pattern` repeated `times` times as a JSON array fragment.
json repeated(std::initializer_list<int> pattern, int times) {
  json a = json::array();
  for (int i = 0; i < times; ++i)
    for (int x : pattern) a.push_back(x);
  return a;
}

json concat(std::initializer_list<json> parts) {
  json a = json::array();
  for (const auto& p : parts)
    for (const auto& x : p) a.push_back(x);
  return a;
}

// The released V4.1-Flash text config, written from the SPEC §1.1 table in config.json spelling.
json released_v41_text_config() {
  return json{
      {"hidden_size", 5120},
      {"num_hidden_layers", 40},
      {"num_nextn_predict_layers", 3},
      {"dspark_target_layer_ids", {37, 38, 39}},
      {"dspark_block_size", 5},
      {"num_attention_heads", 64},
      {"num_key_value_heads", 1},
      {"head_dim", 512},
      {"qk_rope_head_dim", 64},
      {"q_lora_rank", 1280},
      {"o_lora_rank", 1024},
      {"o_groups", 8},
      {"sliding_window", 128},
      {"compress_ratios", concat({json{0, 0}, repeated({2}, 18), repeated({1}, 20), json{0, 0, 0}})},
      {"kv_source_layer_ids", {2, 8, 14, 20}},
      {"index_source_layer_ids", {2, 8, 14, 20, 24, 28, 32, 36}},
      {"candidate_source_layer_id", 20},
      {"candidate_topk_blocks", 2048},
      {"candidate_block_size", 8},
      {"index_n_heads", 32},
      {"index_head_dim", 128},
      {"index_topk", 512},
      {"rope_theta", 10000},
      {"compress_rope_theta", 160000},
      {"rope_scaling",
       {{"rope_type", "yarn"}, {"factor", 16}, {"beta_fast", 32}, {"beta_slow", 1},
        {"original_max_position_embeddings", 65536}}},
      {"max_position_embeddings", 1048576},
      {"rms_norm_eps", 1e-20},
      {"vocab_size", 129280},
  };
}

json released_quantization_config() {
  return json{{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"},
              {"weight_block_size", {32, 32}}, {"activation_scheme", "dynamic"}, {"expert_dtype", "fp4"}};
}

// The same release in DeepSeek's ModelArgs spelling.
json released_v41_model_args() {
  return json{
      {"dim", 5120}, {"n_layers", 40}, {"n_mtp_layers", 3}, {"n_heads", 64}, {"head_dim", 512},
      {"rope_head_dim", 64}, {"q_lora_rank", 1280}, {"o_groups", 8}, {"o_lora_rank", 1024},
      {"window_size", 128},
      {"compress_ratios", concat({json{0, 0}, repeated({2}, 18), repeated({1}, 20), json{0, 0, 0}})},
      {"kv_source_layers", {2, 8, 14, 20}}, {"index_source_layers", {2, 8, 14, 20, 24, 28, 32, 36}},
      {"candidate_source_layer", 20}, {"candidate_topk_blocks", 2048}, {"candidate_block_size", 8},
      {"dspark_target_layer_ids", {37, 38, 39}}, {"dspark_block_size", 5},
      {"index_n_heads", 32}, {"index_head_dim", 128}, {"index_topk", 512}, {"rope_theta", 10000.0},
      {"compress_rope_theta", 160000.0}, {"rope_factor", 16}, {"original_seq_len", 65536},
      {"beta_fast", 32}, {"beta_slow", 1}, {"norm_eps", 1e-20}, {"dtype", "fp8"}, {"scale_fmt", "ue8m0"},
  };
}

// V4-Flash (SPEC §1.2) as a transformers config.json with the legacy ratio list incl. the MTP entry.
json released_v4_flash_config_json() {
  return json{
      {"hidden_size", 4096}, {"num_hidden_layers", 43}, {"num_nextn_predict_layers", 1},
      {"num_attention_heads", 64}, {"head_dim", 512}, {"qk_rope_head_dim", 64}, {"q_lora_rank", 1024},
      {"o_groups", 8}, {"o_lora_rank", 1024}, {"sliding_window", 128},
      {"compress_ratios", concat({json{0, 0}, repeated({4, 128}, 20), json{4, 0}})},
      {"index_n_heads", 64}, {"index_head_dim", 128}, {"index_topk", 512}, {"rope_theta", 10000},
      {"compress_rope_theta", 160000},
      {"rope_scaling", {{"type", "yarn"}, {"factor", 16}, {"beta_fast", 32}, {"beta_slow", 1},
                        {"original_max_position_embeddings", 65536}}},
      {"rms_norm_eps", 1e-6},
      {"quantization_config", {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"},
                               {"weight_block_size", {128, 128}}}},
  };
}

// ---------------------------------------------------------------------------------------------
// The three forms.

TEST(ConfigParse, GoldenV40aTransformersConfig) {
  const json j = read_json(golden_path("v40a.config.json"));
  const ModelConfig c = load_config_file(golden_path("v40a.config.json"));
  EXPECT_EQ(c.family, ModelFamily::v4_0);
  EXPECT_EQ(c.hidden_size, j["hidden_size"].get<int64_t>());
  EXPECT_EQ(c.num_layers, j["num_hidden_layers"].get<int>());
  EXPECT_EQ(c.num_mtp_layers, j["num_nextn_predict_layers"].get<int>());
  EXPECT_EQ(c.num_heads, j["num_attention_heads"].get<int>());
  EXPECT_EQ(c.q_lora_rank, j["q_lora_rank"].get<int64_t>());
  EXPECT_EQ(c.o_groups, j["o_groups"].get<int>());
  EXPECT_EQ(c.o_lora_rank, j["o_lora_rank"].get<int64_t>());
  EXPECT_EQ(c.sliding_window, j["sliding_window"].get<int64_t>());
  EXPECT_EQ(c.index_n_heads, j["index_n_heads"].get<int>());
  EXPECT_EQ(c.index_topk, j["index_topk"].get<int64_t>());
  EXPECT_EQ(c.rms_norm_eps, j["rms_norm_eps"].get<double>());
  // layer_types + compress_rates give the per-layer ratio and kind.
  ASSERT_EQ(c.compress_ratios.size(), j["layer_types"].size());
  for (size_t l = 0; l < c.compress_ratios.size(); ++l) {
    const std::string type = j["layer_types"][l];
    const int rate = type == "sliding_attention" ? 0 : j["compress_rates"][type].get<int>();
    EXPECT_EQ(c.compress_ratios[l], rate) << "layer " << l;
    EXPECT_EQ(c.layer_kinds[l], type == "sliding_attention"           ? AttentionKind::sliding
                                : type == "compressed_sparse_attention" ? AttentionKind::csa
                                                                        : AttentionKind::hca);
  }
  const json& compress = j["rope_parameters"]["compress"];
  EXPECT_EQ(c.main_rope.theta, j["rope_parameters"]["main"]["rope_theta"].get<double>());
  EXPECT_FALSE(c.main_rope.yarn);
  EXPECT_EQ(c.compress_rope.theta, compress["rope_theta"].get<double>());
  EXPECT_TRUE(c.compress_rope.yarn);
  EXPECT_EQ(c.compress_rope.factor, compress["factor"].get<double>());
  EXPECT_EQ(c.compress_rope.original_max_position, compress["original_max_position_embeddings"].get<int64_t>());
  EXPECT_FALSE(c.weight_quantization.has_value());

  const ModelTopology t = resolve_topology(c);
  ASSERT_EQ(t.size(), 4);
  EXPECT_EQ(t[0].kind, AttentionKind::sliding);
  EXPECT_EQ(t[1].kind, AttentionKind::csa);
  EXPECT_TRUE(t[1].owns_indexer && t[1].owns_compressor && t[1].owns_index_keys);
  EXPECT_EQ(t[1].index_source, 1);
  EXPECT_EQ(t[2].kind, AttentionKind::hca);
  EXPECT_EQ(t[2].compress_ratio, 16);
  EXPECT_EQ(t[2].index_source, -1);
  EXPECT_EQ(t[2].kv_source, 2);
  EXPECT_TRUE(t[3].is_mtp);
  EXPECT_EQ(t[3].kind, AttentionKind::sliding);
}

TEST(ConfigParse, GoldenV41aModelArgs) {
  const json j = read_json(golden_path("v41a.config.json"));
  const ModelConfig c = load_config_file(golden_path("v41a.config.json"));
  EXPECT_EQ(c.family, ModelFamily::v4_1);
  EXPECT_EQ(c.hidden_size, j["dim"].get<int64_t>());
  EXPECT_EQ(c.num_layers, j["n_layers"].get<int>());
  EXPECT_EQ(c.num_mtp_layers, j["n_mtp_layers"].get<int>());
  EXPECT_EQ(c.num_heads, j["n_heads"].get<int>());
  EXPECT_EQ(c.sliding_window, j["window_size"].get<int64_t>());
  EXPECT_EQ(c.compress_ratios, j["compress_ratios"].get<std::vector<int>>());
  EXPECT_TRUE(c.layer_kinds.empty());
  EXPECT_EQ(c.kv_source_layers, j["kv_source_layers"].get<std::vector<int>>());
  EXPECT_EQ(c.index_source_layers, j["index_source_layers"].get<std::vector<int>>());
  EXPECT_EQ(c.candidate_source_layer, j["candidate_source_layer"].get<int>());
  EXPECT_EQ(c.candidate_topk_blocks, j["candidate_topk_blocks"].get<int64_t>());
  EXPECT_EQ(c.candidate_block_size, j["candidate_block_size"].get<int64_t>());
  EXPECT_EQ(c.compress_rope.original_max_position, j["original_seq_len"].get<int64_t>());
  EXPECT_TRUE(c.compress_rope.yarn);
  EXPECT_EQ(c.compress_rope.factor, j["rope_factor"].get<double>());
  EXPECT_EQ(c.rms_norm_eps, j["norm_eps"].get<double>());
  EXPECT_FALSE(c.weight_quantization.has_value());  // dtype bf16

  // Roles by SPEC §1.3 rules, computed here from the lists.
  const ModelTopology t = resolve_topology(c);
  const auto& kv = c.kv_source_layers;
  const auto& idx = c.index_source_layers;
  for (int l = 0; l < t.size(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const int r = c.compress_ratios[static_cast<size_t>(l)];
    int kv_src = -1, idx_src = -1;
    for (int s : kv) if (r > 0 && s <= l) kv_src = s;
    for (int s : idx) if (r > 0 && s <= l) idx_src = s;
    EXPECT_EQ(t[l].kv_source, kv_src);
    EXPECT_EQ(t[l].index_source, idx_src);
    EXPECT_EQ(t[l].owns_compressor, r > 0 && kv_src == l);
    EXPECT_EQ(t[l].owns_indexer, r > 0 && idx_src == l);
    EXPECT_EQ(t[l].uses_candidates, idx_src == l && c.candidate_source_layer < l);
    EXPECT_EQ(t[l].uses_compress_rope, r > 0);
  }
  EXPECT_TRUE(t[4].uses_candidates);
  EXPECT_FALSE(t[5].owns_indexer);
}

TEST(ConfigParse, ReleasedV41ConfigJsonNestedAndFlatMatchPreset) {
  const ModelConfig preset = preset_config("v4.1-flash");
  json nested{{"architectures", {"DeepseekV41ForConditionalGeneration"}},
              {"text_config", released_v41_text_config()},
              {"quantization_config", released_quantization_config()}};
  const ModelConfig from_nested = parse_config_json(nested.dump(), "nested.json");
  expect_same_config(from_nested, preset);
  EXPECT_EQ(from_nested.name, "nested.json");

  json flat = released_v41_text_config();
  flat["quantization_config"] = released_quantization_config();
  expect_same_config(parse_config_json(flat.dump(), "flat.json"), preset);
}

TEST(ConfigParse, ReleasedV41ModelArgsMatchesPreset) {
  expect_same_config(parse_config_json(released_v41_model_args().dump(), "args.json"), preset_config("v4.1-flash"));
}

TEST(ConfigParse, ReleasedV4FlashLegacyListMatchesPreset) {
  expect_same_config(parse_config_json(released_v4_flash_config_json().dump(), "v4.json"), preset_config("v4-flash"));
}

// DeepSeek's official V4.0 ModelArgs (v40o_a): ratio 4 is CSA, any other ratio HCA (here 16), and
// the official code's indexer QAT (SPEC §15) is on.
TEST(ConfigParse, GoldenV40oOfficialModelArgs) {
  const json j = read_json(golden_path("v40o_a.config.json"));
  const ModelConfig c = load_config_file(golden_path("v40o_a.config.json"));
  EXPECT_EQ(c.family, ModelFamily::v4_0);
  EXPECT_EQ(c.hidden_size, j["dim"].get<int64_t>());
  EXPECT_EQ(c.num_layers, j["n_layers"].get<int>());
  EXPECT_EQ(c.num_mtp_layers, 0);
  EXPECT_EQ(c.num_heads, j["n_heads"].get<int>());
  EXPECT_EQ(c.q_lora_rank, j["q_lora_rank"].get<int64_t>());
  EXPECT_EQ(c.sliding_window, j["window_size"].get<int64_t>());
  EXPECT_EQ(c.compress_ratios, (std::vector<int>{0, 4, 16}));
  EXPECT_EQ(c.layer_kinds, (std::vector<AttentionKind>{AttentionKind::sliding, AttentionKind::csa, AttentionKind::hca}));
  EXPECT_EQ(c.index_n_heads, j["index_n_heads"].get<int>());
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, j["index_topk"].get<int64_t>());
  EXPECT_EQ(c.rms_norm_eps, j["norm_eps"].get<double>());
  EXPECT_FALSE(c.main_rope.yarn);
  EXPECT_EQ(c.compress_rope.theta, j["compress_rope_theta"].get<double>());
  EXPECT_TRUE(c.compress_rope.yarn);
  EXPECT_EQ(c.compress_rope.original_max_position, 65536);
  EXPECT_EQ(c.compress_rope.factor, j["rope_factor"].get<double>());
  EXPECT_FALSE(c.weight_quantization.has_value());  // dtype bf16
  EXPECT_TRUE(c.indexer_qat);
  const ModelTopology t = resolve_topology(c);
  EXPECT_TRUE(t[1].owns_indexer && t[1].owns_index_keys);
  EXPECT_EQ(t[2].kind, AttentionKind::hca);
  EXPECT_EQ(t[2].compress_ratio, 16);
  EXPECT_EQ(t[2].index_source, -1);
}

// The official code accepts any positive ratio: 4 builds a CSA layer, every other one an HCA layer.
// (1 and 2 are V4.1's ratios and make the config V4.1.)
TEST(ConfigParse, OfficialV40ModelArgsTakeAnyHcaRatio) {
  json args = read_json(golden_path("v40o_a.config.json"));
  for (int ratio : {3, 5, 8, 16, 64, 128, 1000, 65536}) {
    args["compress_ratios"] = {0, 4, ratio};
    const ModelConfig c = parse_config_json(args.dump(), "args.json");
    EXPECT_EQ(c.family, ModelFamily::v4_0) << ratio;
    EXPECT_EQ(c.compress_ratios[2], ratio);
    EXPECT_EQ(c.layer_kinds[2], AttentionKind::hca) << ratio;
    EXPECT_EQ(resolve_topology(c)[2].compress_ratio, ratio);
  }
  args["compress_ratios"] = {16, 0, 4};
  EXPECT_EQ(parse_config_json(args.dump()).layer_kinds,
            (std::vector<AttentionKind>{AttentionKind::hca, AttentionKind::sliding, AttentionKind::csa}));
}

// indexer_qat: on by default for the ModelArgs form, off for transformers' config.json form; the
// key overrides either.
TEST(ConfigParse, IndexerQatDefaultsToTheFormAndCanBeSet) {
  json args = read_json(golden_path("v40o_a.config.json"));
  json transformers = read_json(golden_path("v40a.config.json"));
  EXPECT_TRUE(parse_config_json(args.dump()).indexer_qat);
  EXPECT_FALSE(parse_config_json(transformers.dump()).indexer_qat);
  args["indexer_qat"] = false;
  transformers["indexer_qat"] = true;
  EXPECT_FALSE(parse_config_json(args.dump()).indexer_qat);
  EXPECT_TRUE(parse_config_json(transformers.dump()).indexer_qat);
  for (const std::string& preset : preset_names()) EXPECT_FALSE(preset_config(preset).indexer_qat) << preset;
  EXPECT_FALSE(parse_config_json(read_json(golden_path("v41a.config.json")).dump()).indexer_qat);
}

TEST(ConfigParse, ModelArgsFp8UsesFamilyBlock) {
  json v41 = read_json(golden_path("v41a.config.json"));
  v41["dtype"] = "fp8";
  v41["scale_fmt"] = "ue8m0";
  const ModelConfig c = parse_config_json(v41.dump());
  ASSERT_TRUE(c.weight_quantization.has_value());
  EXPECT_EQ(c.weight_quantization->block_out, 32);
  EXPECT_EQ(c.weight_quantization->block_in, 32);
  EXPECT_TRUE(c.weight_quantization->ue8m0_scales);

  json v40 = json{{"dim", 256}, {"n_layers", 2}, {"n_heads", 4}, {"q_lora_rank", 256}, {"o_groups", 2},
                  {"o_lora_rank", 64}, {"compress_ratios", {4, 128}}, {"dtype", "fp8"}};
  const ModelConfig c40 = parse_config_json(v40.dump());
  EXPECT_EQ(c40.family, ModelFamily::v4_0);
  ASSERT_TRUE(c40.weight_quantization.has_value());
  EXPECT_EQ(c40.weight_quantization->block_out, 128);
  EXPECT_FALSE(c40.weight_quantization->ue8m0_scales);  // no scale_fmt: fp32 scales
  EXPECT_EQ(c40.layer_kinds, (std::vector<AttentionKind>{AttentionKind::csa, AttentionKind::hca}));
}

// Whole-file parse failures name the field and the offending value.
TEST(ConfigParse, MalformedInputsNameFieldAndValue) {
  const json args = read_json(golden_path("v41a.config.json"));
  const json v40 = read_json(golden_path("v40a.config.json"));
  const json v40o = read_json(golden_path("v40o_a.config.json"));
  auto with = [](json j, const std::string& key, json value) {
    j[key] = std::move(value);
    return j;
  };
  auto without = [](json j, const std::string& key) {
    j.erase(key);
    return j;
  };
  struct Case {
    json input;  // a string is parsed as raw text, anything else is dumped
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"[1, 2]", {"root is an array of 2", "expected a JSON object"}},
      {"{\"dim\": 256,", {"not valid JSON"}},
      {std::string(200, '[') + std::string(200, ']'), {"nesting depth exceeds 64"}},
      {with(args, "n_heads", "4"), {"field 'n_heads' = \"4\"", "expected an integer"}},
      {with(args, "n_heads", 4.5), {"field 'n_heads' = 4.5", "expected an integer"}},
      {with(args, "dim", json::parse("18446744073709551615")), {"field 'dim' = 18446744073709551615"}},
      {with(args, "n_layers", -6), {"field 'n_layers' = -6", "cannot be negative"}},
      {without(args, "dim"), {"field 'dim' is missing"}},
      {without(args, "kv_source_layers"), {"field 'kv_source_layers' is missing"}},
      {with(args, "compress_ratios", {0, 2, 2, 1, 1}), {"field 'compress_ratios' = an array of 5", "6 (n_layers)"}},
      {with(with(args, "n_mtp_layers", 1), "compress_ratios", {0, 2, 2, 1, 1, 1, 2}),
       {"field 'compress_ratios[6]' = 2", "MTP layers"}},
      {with(args, "compress_ratios", {0, 2, 3, 1, 1, 1}), {"field 'compress_ratios[2]' = 3", "allowed ratios for V4.1 are 0, 1, 2"}},
      {with(args, "kv_source_layers", {1, "3"}), {"field 'kv_source_layers[1]' = \"3\"", "expected an integer"}},
      {with(args, "dtype", "fp4"), {"field 'dtype' = \"fp4\"", "expected bf16 or fp8"}},
      {with(args, "hidden_size", 256), {"mixes ModelArgs keys"}},
      {"{\"vocab_size\": 5}", {"neither 'hidden_size'"}},
      {with(v40, "layer_types", {"sliding_attention", "full_attention", "sliding_attention"}),
       {"field 'layer_types[1]' = \"full_attention\""}},
      {with(without(v40, "layer_types"), "compress_ratios", {0, 4, 16}),
       {"field 'compress_ratios[2]' = 16", "maps 0 to sliding, 4 to CSA and 128 to HCA"}},
      {with(v40, "compress_ratios", {0, 4, 128}), {"field 'compress_ratios[2]' = 128", "disagrees with layer_types"}},
      {with(v40, "compress_rates", {{"compressed_sparse_attention", 4}}),
       {"field 'compress_rates.heavily_compressed_attention' is missing"}},
      {with(v40, "num_key_value_heads", 2), {"field 'num_key_value_heads' = 2", "one shared K=V head"}},
      {with(v40, "kv_source_layer_ids", {1}), {"has both layer_types (V4.0) and kv_source_layer_ids"}},
      {with(v40, "rope_parameters", {{"main", {{"rope_type", "default"}}}}),
       {"field 'rope_parameters.compress' is missing"}},
      {with(v40, "rope_parameters", {{"main", {{"rope_type", "linear"}}}, {"compress", {{"rope_type", "default"}}}}),
       {"field 'rope_parameters.main.rope_type' = \"linear\"", "default and yarn"}},
      {with(v40, "rope_parameters", {{"main", {{"rope_type", "default"}}},
                                     {"compress", {{"rope_type", "yarn"}, {"original_max_position_embeddings", 64}}}}),
       {"field 'rope_parameters.compress.factor' is missing"}},
      {with(v40, "rope_parameters", {{"main", {{"rope_type", "default"}}},
                                     {"compress", {{"rope_type", "yarn"}, {"factor", 4}, {"attention_factor", 0.5},
                                                   {"original_max_position_embeddings", 64}}}}),
       {"field 'rope_parameters.compress.attention_factor' = 0.5"}},
      {with(v40, "quantization_config", {{"quant_method", "awq"}}), {"field 'quantization_config.quant_method' = \"awq\""}},
      {with(v40, "quantization_config", {{"quant_method", "fp8"}, {"weight_block_size", {128}}}),
       {"field 'quantization_config.weight_block_size' = an array of 1", "expected [rows, columns]"}},
      {with(v40, "quantization_config", {{"weight_block_size", {128, 128}}, {"scale_fmt", "e8m0"}}),
       {"field 'quantization_config.scale_fmt' = \"e8m0\""}},
      {with(v40o, "compress_ratios", {0, 4, -16}), {"field 'compress_ratios[2]' = -16", "needs a ratio in [2, 65536]"}},
      {with(v40o, "compress_ratios", {0, 4, 70000}), {"field 'compress_ratios[2]' = 70000", "needs a ratio in [2, 65536]"}},
      {with(v40o, "compress_ratios", {0, 4, 16, 0}), {"field 'compress_ratios' = an array of 4", "3 (n_layers)"}},
      {with(v40o, "compress_ratios", {0, 4, 2}), {"field 'kv_source_layers' is missing", "compress ratios 1/2"}},
      {with(v40o, "indexer_qat", "yes"), {"field 'indexer_qat' = \"yes\"", "expected true or false"}},
      {with(v40o, "indexer_qat", 1), {"field 'indexer_qat' = 1", "expected true or false"}},
      {with(args, "indexer_qat", true), {"field 'indexer_qat' = true", "V4.1 config has none"}},
      {with(v40o, "index_head_dim", 192), {"field 'index_head_dim' = 192", "power of two for indexer_qat"}},
      {json{{"text_config", 5}}, {"field 'text_config' = 5", "expected an object"}},
      {json{{"text_config", {{"hidden_size", 256}}}}, {"field 'text_config.num_hidden_layers' is missing"}},
  };
  for (const auto& c : cases) {
    const std::string text = c.input.is_string() ? c.input.get<std::string>() : c.input.dump();
    const std::string message = error_of([&] { parse_config_json(text, "case.json"); });
    EXPECT_EQ(message.rfind("dsv4: config: ", 0), 0u) << message;
    for (const auto& part : c.expected) EXPECT_NE(message.find(part), std::string::npos) << message << "\n  lacks: " << part;
  }
}

// DSpark keys: the same spelling in both forms; without target layers the MTP layers stay window layers.
TEST(ConfigParse, DsparkKeys) {
  json j = released_v41_model_args();
  const ModelConfig with = parse_config_json(j.dump(), "a.json");
  EXPECT_TRUE(with.has_dspark());
  EXPECT_EQ(with.dspark_main_width(), 3 * 5120);
  EXPECT_EQ(resolve_topology(with)[41].kind, AttentionKind::dspark);
  j["dspark_target_layer_ids"] = json::array();
  const ModelConfig without = parse_config_json(j.dump(), "b.json");
  EXPECT_FALSE(without.has_dspark());
  EXPECT_EQ(resolve_topology(without)[41].kind, AttentionKind::sliding);
  EXPECT_EQ(resolve_topology(without)[41].dspark_stage, -1);
  j["dspark_target_layer_ids"] = {37, 38, 39};
  j.erase("dspark_block_size");
  EXPECT_NE(error_of([&] { parse_config_json(j.dump(), "c.json"); }).find("field 'dspark_block_size' is missing"),
            std::string::npos);
}

TEST(ConfigParse, LoadFileErrors) {
  const std::string message = error_of([] { load_config_file("/nonexistent/config.json"); });
  EXPECT_NE(message.find("cannot open config file '/nonexistent/config.json'"), std::string::npos) << message;
}

// ---------------------------------------------------------------------------------------------
// Presets.

TEST(ConfigPresets, EveryPresetValidatesAndResolves) {
  const std::vector<std::string> names = preset_names();
  EXPECT_EQ(names, (std::vector<std::string>{"v4.1-flash", "v4-flash", "v4-pro", "tiny-v4.1", "tiny-v4"}));
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    const ModelConfig c = preset_config(name);
    EXPECT_EQ(c.name, name);
    EXPECT_NO_THROW(validate_config(c));
    const ModelTopology t = resolve_topology(c);
    EXPECT_EQ(t.size(), c.total_layers());
  }
  const std::string message = error_of([] { preset_config("v5"); });
  EXPECT_NE(message.find("unknown preset 'v5'"), std::string::npos) << message;
  EXPECT_NE(message.find("tiny-v4.1"), std::string::npos) << message;
}

TEST(ConfigPresets, ReleasedValuesFromSpec) {
  const ModelConfig pro = preset_config("v4-pro");
  EXPECT_EQ(pro.hidden_size, 7168);
  EXPECT_EQ(pro.num_layers, 61);
  EXPECT_EQ(pro.num_heads, 128);
  EXPECT_EQ(pro.q_lora_rank, 1536);
  EXPECT_EQ(pro.o_groups, 16);
  EXPECT_EQ(pro.index_topk, 1024);
  // (128, 128) + (4, 128) * 29 + (4,)
  EXPECT_EQ(pro.compress_ratios, concat({json{128, 128}, repeated({4, 128}, 29), json{4}}).get<std::vector<int>>());
  EXPECT_EQ(pro.weight_quantization->block_out, 128);
  EXPECT_EQ(pro.rms_norm_eps, 1e-6);
}

TEST(ConfigPresets, TinyPresetsKeepTheReleasedStructure) {
  const ModelConfig v41 = preset_config("tiny-v4.1");
  const ModelTopology t = resolve_topology(v41);
  bool masked_index_source = false, reuses_masked = false, reuses_unmasked = false, non_owning_index = false;
  bool ratio1 = false, ratio2 = false;
  for (const auto& p : t.layers) {
    masked_index_source |= p.uses_candidates;
    non_owning_index |= p.owns_indexer && !p.owns_index_keys;
    if (p.index_source >= 0 && !p.owns_indexer) (t[p.index_source].uses_candidates ? reuses_masked : reuses_unmasked) = true;
    ratio1 |= p.compress_ratio == 1;
    ratio2 |= p.compress_ratio == 2;
  }
  EXPECT_TRUE(masked_index_source && reuses_masked && reuses_unmasked && non_owning_index && ratio1 && ratio2);
  EXPECT_TRUE(t[t.size() - 1].is_mtp);
  // The candidate filter bites within a few hundred tokens.
  EXPECT_LE(v41.candidate_topk_blocks * v41.candidate_block_size, 256);
  EXPECT_GE(v41.candidate_topk_blocks * v41.candidate_block_size, v41.index_topk);

  const ModelTopology t40 = resolve_topology(preset_config("tiny-v4"));
  bool sliding = false, csa = false, hca = false;
  for (const auto& p : t40.layers) {
    sliding |= p.kind == AttentionKind::sliding && !p.is_mtp;
    csa |= p.kind == AttentionKind::csa && p.compress_ratio == 4;
    hca |= p.kind == AttentionKind::hca && p.compress_ratio == 16;
  }
  EXPECT_TRUE(sliding && csa && hca);
}

TEST(ConfigPresets, PresetOrFile) {
  EXPECT_EQ(config_from_preset_or_file("tiny-v4", "").name, "tiny-v4");
  EXPECT_EQ(config_from_preset_or_file("", golden_path("v41a.config.json")).num_layers, 6);
  EXPECT_NE(error_of([] { config_from_preset_or_file("", ""); }).find("expected exactly one of a preset"), std::string::npos);
  EXPECT_NE(error_of([] { config_from_preset_or_file("tiny-v4", "x.json"); }).find("expected exactly one"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Topology.

// SPEC §1.3 "Resulting released schedule", row by row.
TEST(ConfigTopology, V41FlashMatchesTheReleasedSchedule) {
  const ModelTopology t = resolve_topology(preset_config("v4.1-flash"));
  ASSERT_EQ(t.size(), 43);
  const std::vector<int> kv_owners = {2, 8, 14, 20};
  const std::vector<int> index_sources = {2, 8, 14, 20, 24, 28, 32, 36};
  auto in = [](const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  for (int l = 0; l < 43; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const LayerPlan& p = t[l];
    EXPECT_EQ(p.layer, l);
    EXPECT_EQ(p.is_mtp, l >= 40);
    const bool window_only = l < 2 || l >= 40;
    const int ratio = window_only ? 0 : l < 20 ? 2 : 1;
    EXPECT_EQ(p.compress_ratio, ratio);
    EXPECT_EQ(p.kind, l >= 40 ? AttentionKind::dspark : window_only ? AttentionKind::sliding : AttentionKind::compressed);
    EXPECT_EQ(p.dspark_stage, l >= 40 ? l - 40 : -1);
    EXPECT_EQ(p.uses_compress_rope, !window_only);
    const int kv = window_only ? -1 : l < 8 ? 2 : l < 14 ? 8 : l < 20 ? 14 : 20;
    EXPECT_EQ(p.kv_source, kv);
    int index = -1;
    for (int s : index_sources) if (!window_only && s <= l) index = s;
    EXPECT_EQ(p.index_source, index);
    EXPECT_EQ(p.owns_compressor, in(kv_owners, l));
    EXPECT_EQ(p.owns_index_keys, in(kv_owners, l));
    EXPECT_EQ(p.owns_indexer, in(index_sources, l));
    EXPECT_EQ(p.is_candidate_source, l == 20);
    EXPECT_EQ(p.uses_candidates, l == 24 || l == 28 || l == 32 || l == 36);
  }
}

TEST(ConfigTopology, V4FlashEveryCompressedLayerOwnsItsCaches) {
  const ModelTopology t = resolve_topology(preset_config("v4-flash"));
  ASSERT_EQ(t.size(), 44);
  for (int l = 0; l < 44; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const LayerPlan& p = t[l];
    // (0, 0) + (4, 128) * 20 + (4,) + MTP.
    const int ratio = l < 2 || l == 43 ? 0 : l % 2 == 0 ? 4 : 128;
    EXPECT_EQ(p.compress_ratio, ratio);
    EXPECT_EQ(p.is_mtp, l == 43);
    EXPECT_EQ(p.kind, ratio == 0 ? AttentionKind::sliding : ratio == 4 ? AttentionKind::csa : AttentionKind::hca);
    EXPECT_EQ(p.kv_source, ratio > 0 ? l : -1);
    EXPECT_EQ(p.owns_compressor, ratio > 0);
    EXPECT_EQ(p.index_source, ratio == 4 ? l : -1);
    EXPECT_EQ(p.owns_indexer, ratio == 4);
    EXPECT_EQ(p.owns_index_keys, ratio == 4);
    EXPECT_FALSE(p.is_candidate_source || p.uses_candidates);
    EXPECT_EQ(p.uses_compress_rope, ratio > 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Validation: one failing case per rule; the message names the field and the value.

struct RuleCase {
  std::string preset;
  std::function<void(ModelConfig&)> mutate;
  std::vector<std::string> expected;
};

TEST(ConfigValidate, EveryRuleNamesFieldValueAndRule) {
  const std::vector<RuleCase> cases = {
      {"v4.1-flash", [](ModelConfig& c) { c.compress_ratios[5] = 3; },
       {"field 'compress_ratios[5]' = 3: allowed ratios for V4.1 are 0, 1, 2"}},
      {"v4.1-flash", [](ModelConfig& c) { c.compress_ratios.pop_back(); },
       {"field 'compress_ratios' = 39 entries", "num_layers = 40"}},
      {"v4.1-flash", [](ModelConfig& c) { c.layer_kinds.assign(40, AttentionKind::sliding); },
       {"field 'layer_kinds' = 40 entries", "must be empty for V4.1"}},
      {"v4-flash", [](ModelConfig& c) { c.compress_ratios[3] = 1; },
       {"field 'compress_ratios[3]' = 1", "a V4.0 hca layer needs a ratio in [2, "}},
      {"v4-flash", [](ModelConfig& c) { c.compress_ratios[0] = 4; },
       {"field 'compress_ratios[0]' = 4", "sliding layer has ratio 0"}},
      {"v4-flash", [](ModelConfig& c) { c.layer_kinds[2] = AttentionKind::compressed; },
       {"field 'layer_kinds[2]' = compressed"}},
      {"v4-flash", [](ModelConfig& c) { c.layer_kinds.pop_back(); }, {"field 'layer_kinds' = 42 entries"}},
      {"v4-flash", [](ModelConfig& c) { c.kv_source_layers = {2}; }, {"field 'kv_source_layers' = [2]", "empty for V4.0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.indexer_qat = true; }, {"field 'indexer_qat' = true", "V4.1 has not"}},
      {"v4-flash", [](ModelConfig& c) { c.indexer_qat = true, c.index_head_dim = 320; },
       {"field 'index_head_dim' = 320", "power of two for indexer_qat"}},
      {"v4-flash", [](ModelConfig& c) { c.candidate_source_layer = 2; }, {"field 'candidate_source_layer' = 2", "-1 for V4.0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.kv_source_layers = {2, 8, 14, 40}; },
       {"field 'kv_source_layers[3]' = 40", "backbone layers 0..39"}},
      {"v4.1-flash", [](ModelConfig& c) { c.kv_source_layers = {2, 14, 8, 20}; },
       {"field 'kv_source_layers[2]' = 8", "sorted ascending without duplicates"}},
      {"v4.1-flash", [](ModelConfig& c) { c.kv_source_layers = {1, 2, 8, 14, 20}; },
       {"field 'kv_source_layers[0]' = 1", "layer 1 has ratio 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_source_layers = {2, 8, 14, 20, 24, 28, 28, 36}; },
       {"field 'index_source_layers[6]' = 28", "sorted"}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_source_layers.insert(c.index_source_layers.begin(), 0); },
       {"field 'index_source_layers[0]' = 0", "index sources must compress"}},
      {"v4.1-flash", [](ModelConfig& c) { c.kv_source_layers = {8, 14, 20}; },
       {"field 'compress_ratios[2]' = 2", "no kv source at or below it"}},
      {"v4.1-flash", [](ModelConfig& c) { c.kv_source_layers = {2, 8, 14}; },
       {"field 'compress_ratios[20]' = 1", "kv source 14, whose ratio is 2"}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_source_layers = {8, 14, 20}; },
       {"field 'compress_ratios[2]' = 2", "no index source at or below it"}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_source_layers = {2, 8, 14, 24, 28, 32, 36}; c.candidate_source_layer = 24; },
       {"field 'index_source_layers[2]' = 14", "scores the keys of kv source 14", "reads kv source 20"}},
      {"v4.1-flash", [](ModelConfig& c) { c.candidate_source_layer = 21; },
       {"field 'candidate_source_layer' = 21", "one of the index sources"}},
      {"v4.1-flash", [](ModelConfig& c) { c.candidate_topk_blocks = 0; }, {"field 'candidate_topk_blocks' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.candidate_block_size = -8; }, {"field 'candidate_block_size' = -8"}},
      {"v4.1-flash", [](ModelConfig& c) { c.o_groups = 6; }, {"field 'num_heads' = 64", "divisible by o_groups = 6"}},
      {"v4.1-flash", [](ModelConfig& c) { c.o_groups = 0; }, {"field 'o_groups' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.tensor_parallel_size = 3; },
       {"field 'num_heads' = 64", "divisible by tensor_parallel_size = 3"}},
      {"v4.1-flash", [](ModelConfig& c) { c.tensor_parallel_size = 16; },
       {"field 'o_groups' = 8", "tensor_parallel_size = 16"}},
      {"v4.1-flash", [](ModelConfig& c) { c.head_dim = 496; }, {"field 'head_dim' = 496", "multiple of 32"}},
      {"v4-flash", [](ModelConfig& c) { c.head_dim = 544; }, {"field 'head_dim' = 544", "multiple of 64"}},
      {"v4.1-flash", [](ModelConfig& c) { c.rope_head_dim = 63; }, {"field 'rope_head_dim' = 63", "even"}},
      {"v4.1-flash", [](ModelConfig& c) { c.rope_head_dim = 576; }, {"field 'rope_head_dim' = 576", "[2, 512]"}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_head_dim = 112; }, {"field 'index_head_dim' = 112", "multiple of 32"}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_head_dim = 32; }, {"field 'index_head_dim' = 32", "[64, "}},
      {"v4.1-flash", [](ModelConfig& c) { c.index_topk = 0; }, {"field 'index_topk' = 0"}},
      {"v4-flash", [](ModelConfig& c) { c.index_n_heads = 0; }, {"field 'index_n_heads' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.q_lora_rank = 1290; }, {"field 'q_lora_rank' = 1290", "32x32 fp8 weight block"}},
      {"v4-flash", [](ModelConfig& c) { c.hidden_size = 4160; }, {"field 'hidden_size' = 4160", "128x128 fp8 weight block"}},
      {"v4.1-flash", [](ModelConfig& c) { c.weight_quantization->block_in = 0; },
       {"field 'weight_quantization.block_in' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.sliding_window = 0; }, {"field 'sliding_window' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.hidden_size = -5120; }, {"field 'hidden_size' = -5120"}},
      {"v4.1-flash", [](ModelConfig& c) { c.num_layers = 0; }, {"field 'num_layers' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.num_mtp_layers = -1; }, {"field 'num_mtp_layers' = -1"}},
      {"v4.1-flash", [](ModelConfig& c) { c.num_heads = 1 << 20; }, {"field 'num_heads' = 1048576"}},
      {"v4.1-flash", [](ModelConfig& c) { c.rms_norm_eps = 0.0; }, {"field 'rms_norm_eps' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.main_rope.theta = 0.5; }, {"field 'main_rope.theta' = 0.5"}},
      {"v4.1-flash", [](ModelConfig& c) { c.compress_rope.factor = 0.5; }, {"field 'compress_rope.factor' = 0.5"}},
      {"v4.1-flash", [](ModelConfig& c) { c.compress_rope.original_max_position = 0; },
       {"field 'compress_rope.original_max_position' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.compress_rope.beta_slow = -1; }, {"field 'compress_rope.beta_slow' = -1"}},
      {"v4.1-flash", [](ModelConfig& c) { c.dspark_target_layer_ids = {37, 40}; },
       {"field 'dspark_target_layer_ids[1]' = 40", "backbone layers 0..39"}},
      {"v4.1-flash", [](ModelConfig& c) { c.dspark_target_layer_ids = {37, 37}; },
       {"field 'dspark_target_layer_ids[1]' = 37", "listed twice"}},
      {"v4.1-flash", [](ModelConfig& c) { c.dspark_block_size = 0; }, {"field 'dspark_block_size' = 0"}},
      {"v4.1-flash", [](ModelConfig& c) { c.num_mtp_layers = 0; },
       {"field 'dspark_target_layer_ids' = [37, 38, 39]", "no MTP (draft) layers"}},
  };
  for (const auto& rule : cases) {
    ModelConfig c = preset_config(rule.preset);
    rule.mutate(c);
    const std::string message = error_of([&] { validate_config(c); });
    EXPECT_EQ(message.rfind("dsv4: config: " + rule.preset + ": field '", 0), 0u) << message;
    for (const auto& part : rule.expected)
      EXPECT_NE(message.find(part), std::string::npos) << message << "\n  lacks: " << part;
    // resolve_topology validates first.
    EXPECT_THROW(resolve_topology(c), Error);
  }
}

// A pure-window V4.1 model and a V4.1 model without candidates are valid; no indexer means no
// indexer-field checks.
TEST(ConfigValidate, OptionalPartsMayBeAbsent) {
  ModelConfig c = preset_config("v4.1-flash");
  c.candidate_source_layer = -1;
  c.candidate_topk_blocks = 0;
  EXPECT_NO_THROW(validate_config(c));
  c.compress_ratios.assign(40, 0);
  c.kv_source_layers.clear();
  c.index_source_layers.clear();
  c.index_topk = 0;
  const ModelTopology t = resolve_topology(c);
  for (const auto& p : t.layers) EXPECT_EQ(p.kind, p.is_mtp ? AttentionKind::dspark : AttentionKind::sliding);
}

// ---------------------------------------------------------------------------------------------
// dsv4 plan

using test::CliResult;
using test::run_cli;

// The lines of `text` after the first line starting with `header`, up to the next blank line.
std::vector<std::string> section(const std::string& text, const std::string& header) {
  std::istringstream in(text);
  std::vector<std::string> lines;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    if (!inside) {
      inside = line.rfind(header, 0) == 0;
      continue;
    }
    if (line.empty()) break;
    lines.push_back(line);
  }
  return lines;
}

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Row bytes of a cache in a format set section ("  window  v41_fp8  512  528 ...": 4th column).
int64_t row_bytes_in(const std::vector<std::string>& lines, const std::string& cache) {
  for (const auto& line : lines) {
    const std::string trimmed = line.substr(line.find_first_not_of(' '));
    if (trimmed.rfind(cache + " ", 0) != 0) continue;
    const auto w = words(trimmed.substr(cache.size()));
    return std::stoll(w.at(2));
  }
  ADD_FAILURE() << "no '" << cache << "' row";
  return -1;
}

TEST(ConfigPlan, V41FlashRolesAndRowBytes) {
  const CliResult r = run_cli("plan --preset v4.1-flash");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string& out = r.output;
  for (const char* fact : {
           "own compressor + compressed cache: 2, 8, 14, 20\n",
           "own index-key cache: 2, 8, 14, 20\n",
           "own indexer (index sources): 2, 8, 14, 20, 24, 28, 32, 36\n",
           "candidate source: 20\n",
           "candidate consumers: 24-39 (index sources 24, 28, 32, 36 apply the candidate mask; "
           "25-27, 29-31, 33-35, 37-39 reuse their masked picks)\n",
           "window-only: 0-1, 40-42\n",
       })
    EXPECT_NE(out.find(fact), std::string::npos) << "missing: " << fact << "\n" << out;

  // The table agrees with the resolved topology, row by row.
  const ModelTopology t = resolve_topology(preset_config("v4.1-flash"));
  const auto table = section(out, "layer kind");
  ASSERT_EQ(static_cast<int>(table.size()), t.size());
  for (int l = 0; l < t.size(); ++l) {
    SCOPED_TRACE(table[static_cast<size_t>(l)]);
    const auto w = words(table[static_cast<size_t>(l)]);
    ASSERT_EQ(w.size(), 11u);
    const LayerPlan& p = t[l];
    auto id = [](int x) { return x < 0 ? std::string("-") : std::to_string(x); };
    EXPECT_EQ(w[0], std::to_string(l));
    EXPECT_EQ(w[1], attention_kind_name(p.kind));
    EXPECT_EQ(w[2], std::to_string(p.compress_ratio));
    EXPECT_EQ(w[3], p.uses_compress_rope ? "compress" : "main");
    EXPECT_EQ(w[4], id(p.kv_source));
    EXPECT_EQ(w[5], id(p.index_source));
    EXPECT_EQ(w[6], p.owns_compressor ? "own" : "-");
    EXPECT_EQ(w[7], p.owns_indexer ? "own" : p.index_source >= 0 ? "reuse" : "-");
    EXPECT_EQ(w[8], p.owns_index_keys ? "own" : "-");
    const std::string candidates = l == 20                                   ? "source"
                                   : (l == 24 || l == 28 || l == 32 || l == 36) ? "mask"
                                   : l > 24 && l < 40                           ? "masked-picks"
                                                                                : "-";
    EXPECT_EQ(w[9], candidates);
    EXPECT_EQ(w[10], l >= 40 ? "yes" : "-");
  }

  // SPEC §7.2 / §7.4 / §7.1 row sizes.
  const auto native = section(out, "KV format set v4.1-native");
  EXPECT_EQ(row_bytes_in(native, "window"), 528);
  EXPECT_EQ(row_bytes_in(native, "compressed"), 288);
  EXPECT_EQ(row_bytes_in(native, "index keys"), 68);
  const auto ds_mla = section(out, "KV format set fp8_ds_mla");
  EXPECT_EQ(row_bytes_in(ds_mla, "window"), 584);
  EXPECT_EQ(row_bytes_in(ds_mla, "compressed"), 584);
  EXPECT_EQ(row_bytes_in(ds_mla, "index keys"), 132);
}

// Bytes one v4.1-flash sequence holds in v4.1-native caches, from SPEC constants alone: rows of
// 528 B (32 per page, pages aligned to 512), 288 B (64, 256) and 68 B (64, 512); kv sources 2, 8,
// 14 at ratio 2 and 20 at ratio 1, each with index keys; 43 window caches; ratio-2 compressors keep
// fp32 kv and score rows [2, 512] (SPEC §3.3).
int64_t v41_flash_native_sequence_bytes(int64_t context) {
  auto aligned = [](int64_t bytes, int64_t a) { return (bytes + a - 1) / a * a; };
  auto pages = [](int64_t rows, int64_t per_page) { return (rows + per_page - 1) / per_page; };
  const int64_t window_page = aligned(528 * 32, 512), compressed_page = aligned(288 * 64, 256),
                index_page = aligned(68 * 64, 512);
  const int64_t window_pages = pages(std::min<int64_t>(context, 128), 32) + (context > 128 ? 1 : 0);
  int64_t total = 43 * window_pages * window_page;
  for (int ratio : {2, 2, 2, 1}) {
    const int64_t entries = (context + ratio - 1) / ratio;
    total += pages(entries, 64) * (compressed_page + index_page);
    total += ratio == 2 ? 2 * 2 * 512 * 4 : 0;
  }
  return total;
}

TEST(ConfigPlan, CapacityMatchesIndependentArithmetic) {
  std::mt19937_64 rng(7);
  std::vector<int64_t> contexts = {1, 128, 129, 131072};
  for (int i = 0; i < 3; ++i) contexts.push_back(std::uniform_int_distribution<int64_t>(2, 1 << 20)(rng));
  for (int64_t context : contexts) {
    SCOPED_TRACE("context " + std::to_string(context));
    const int64_t gib = std::uniform_int_distribution<int64_t>(1, 200)(rng);
    const CliResult r = run_cli("plan --preset v4.1-flash --kv-format v4.1-native --context " + std::to_string(context) +
                                " --memory " + std::to_string(gib) + "GiB");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const int64_t expected = v41_flash_native_sequence_bytes(context);
    const std::string per_sequence = "per sequence at " + std::to_string(context) + " tokens: " + std::to_string(expected) + " B";
    EXPECT_NE(r.output.find(per_sequence), std::string::npos) << "expected '" << per_sequence << "' in\n" << r.output;
    const int64_t memory = gib << 30;
    const std::string fit = "sequences that fit in " + std::to_string(memory) + " B (" + std::to_string(gib) +
                            ".00 GiB): " + std::to_string(memory / expected) + "\n";
    EXPECT_NE(r.output.find(fit), std::string::npos) << "expected '" << fit << "' in\n" << r.output;
    EXPECT_EQ(r.output.find("KV format set fp8_ds_mla"), std::string::npos);  // restricted to one set
  }
}

TEST(ConfigPlan, MemorySizesAndErrors) {
  const CliResult plain = run_cli("plan --preset tiny-v4.1 --kv-format bf16 --context 100 --memory 1048576");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("sequences that fit in 1048576 B (1.00 MiB)"), std::string::npos) << plain.output;
  const CliResult kib = run_cli("plan --preset tiny-v4 --kv-format bf16 --context 100 --memory 1.5KiB");
  ASSERT_EQ(kib.exit_code, 0) << kib.output;
  EXPECT_NE(kib.output.find("sequences that fit in 1536 B"), std::string::npos) << kib.output;

  const CliResult bad_memory = run_cli("plan --preset tiny-v4 --context 100 --memory 5GB");
  EXPECT_NE(bad_memory.exit_code, 0);
  EXPECT_NE(bad_memory.output.find("dsv4: plan: --memory '5GB'"), std::string::npos) << bad_memory.output;
  const CliResult bad_format = run_cli("plan --preset tiny-v4 --kv-format fp4");
  EXPECT_NE(bad_format.exit_code, 0);
  EXPECT_NE(bad_format.output.find("unknown KV format set 'fp4'"), std::string::npos) << bad_format.output;
  const CliResult neither = run_cli("plan");
  EXPECT_NE(neither.exit_code, 0);
  EXPECT_NE(neither.output.find("expected exactly one of a preset"), std::string::npos) << neither.output;
  const CliResult from_file = run_cli("plan --config " + golden_path("v40a.config.json") + " --kv-format fp8_ds_mla");
  ASSERT_EQ(from_file.exit_code, 0) << from_file.output;
  EXPECT_NE(from_file.output.find("attend every visible compressed entry (HCA): 2\n"), std::string::npos) << from_file.output;
}

}  // namespace
}  // namespace dsv4

// Seeded mutation fuzzing of the config reader over every accepted form: each input either yields a
// config that validates and resolves, or throws dsv4::Error. Nothing else (other exceptions,
// crashes, hangs) is acceptable. By default a fixed number of mutants from a fixed seed, so every
// run tests the same inputs; DSV4_FUZZ_SEED picks another seed (a failure prints the seed and
// iteration to replay), DSV4_FUZZ_SECONDS=<s> is the long local mode: as many mutants as fit.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "dsv4/config.h"
#include "dsv4/error.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// Small configs in the forms the golden files do not cover.
const char* kV41ConfigJsonNested = R"({
  "architectures": ["DeepseekV41ForConditionalGeneration"],
  "text_config": {
    "hidden_size": 256, "num_hidden_layers": 6, "num_nextn_predict_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "sliding_window": 16,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 2, 3, 5],
    "candidate_source_layer_id": 3, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "index_n_heads": 4, "index_head_dim": 128, "index_topk": 8,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "rms_norm_eps": 1e-20
  },
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [32, 32]}
})";

const char* kV40ConfigJsonLegacy = R"({
  "hidden_size": 256, "num_hidden_layers": 4, "num_nextn_predict_layers": 1,
  "num_attention_heads": 4, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 128,
  "o_groups": 2, "o_lora_rank": 64, "sliding_window": 16, "compress_ratios": [0, 4, 128, 4, 0],
  "index_n_heads": 4, "index_head_dim": 128, "index_topk": 8, "rope_theta": 10000,
  "compress_rope_theta": 160000,
  "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                   "original_max_position_embeddings": 65536},
  "rms_norm_eps": 1e-6,
  "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
})";

const char* kV40ModelArgs = R"({
  "dim": 256, "n_layers": 3, "n_mtp_layers": 1, "n_heads": 4, "q_lora_rank": 128, "o_groups": 2,
  "o_lora_rank": 64, "window_size": 16, "compress_ratios": [4, 128, 0, 0], "index_n_heads": 4,
  "index_topk": 8, "original_seq_len": 4096, "rope_factor": 4, "norm_eps": 1e-6, "dtype": "fp8",
  "scale_fmt": "ue8m0"
})";

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string mutate(const std::string& text) {
    switch (pick(8)) {
      case 0: return text.substr(0, pick(text.size() + 1));  // truncation
      case 1: {                                               // a byte changed
        std::string out = text;
        if (!out.empty()) out[pick(out.size())] = static_cast<char>(pick(256));
        return out;
      }
      case 2: {  // wrapped in deep nesting
        const size_t depth = 1 + pick(200);
        return std::string(depth, '[') + text + std::string(depth, ']');
      }
      default: {  // structure-aware: 1-4 edits of the parsed tree
        json tree = json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (tree.is_discarded()) return text;
        const size_t edits = 1 + pick(4);
        for (size_t i = 0; i < edits; ++i) edit(tree);
        return tree.dump();
      }
    }
  }

 private:
  size_t pick(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }

  json random_number() {
    static const json values[] = {
        0, 1, -1, 2, 3, 4, 5, 8, 16, 32, 64, 127, 128, 512, 1024, 65536, -65536,
        std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
        std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
        std::numeric_limits<uint64_t>::max(), 0.5, -0.0, 1e-20, 1e-320, 1e308, -1e308, 3.0, 2.5e9};
    return values[pick(std::size(values))];
  }

  json random_value() {
    switch (pick(7)) {
      case 0: return nullptr;
      case 1: return pick(2) == 1;
      case 2: return std::vector<std::string>{"yarn", "default", "fp8", "bf16", "ue8m0", "", "sliding_attention",
                                              "compressed_sparse_attention", "heavily_compressed_attention"}[pick(9)];
      case 3: return json::array();
      case 4: return json::object();
      case 5: {
        json a = json::array();
        for (size_t n = pick(6); n > 0; --n) a.push_back(static_cast<int>(pick(5)));
        return a;
      }
      default: return random_number();
    }
  }

  // A random node of the tree with its parent (nullptr for the root).
  std::pair<json*, json*> random_node(json& root) {
    json* parent = nullptr;
    json* node = &root;
    while ((node->is_object() || node->is_array()) && !node->empty() && pick(4) != 0) {
      parent = node;
      auto it = node->begin();
      std::advance(it, static_cast<std::ptrdiff_t>(pick(node->size())));
      node = &*it;
    }
    return {parent, node};
  }

  void edit(json& root) {
    auto [parent, node] = random_node(root);
    switch (pick(5)) {
      case 0:  // type swap / new value
        *node = random_value();
        break;
      case 1:  // deletion
        if (parent && parent->is_object()) {
          for (auto it = parent->begin(); it != parent->end(); ++it)
            if (&*it == node) { parent->erase(it.key()); break; }
        } else if (parent && parent->is_array()) {
          parent->erase(static_cast<size_t>(node - &(*parent)[0]));
        }
        break;
      case 2:  // numbers nudged, negated, blown up
        if (node->is_number_integer()) {
          // Wrapping arithmetic (unsigned) so that the mutator itself never overflows.
          const uint64_t v = static_cast<uint64_t>(node->get<int64_t>());
          const uint64_t choices[] = {v + 1, v - 1, 0 - v, v * 2, v / 2, v << 20};
          *node = static_cast<int64_t>(choices[pick(std::size(choices))]);
        } else if (node->is_number_float()) {
          *node = node->get<double>() * (pick(2) ? -1.0 : 1e10);
        } else {
          *node = random_number();
        }
        break;
      case 3:  // arrays grow
        if (node->is_array()) node->push_back(node->empty() ? random_value() : (*node)[pick(node->size())]);
        else *node = random_value();
        break;
      default:  // an unexpected key
        if (node->is_object()) (*node)[std::vector<std::string>{"text_config", "layer_types", "compress_rates",
                                                                "rope_parameters", "kv_source_layer_ids", "dim",
                                                                "n_layers", "hidden_size"}[pick(8)]] = random_value();
        break;
    }
  }

  std::mt19937_64 rng_;
};

TEST(ConfigFuzz, EveryInputParsesOrThrowsDsv4Error) {
  const char* seconds_env = std::getenv("DSV4_FUZZ_SECONDS");
  const char* seed_env = std::getenv("DSV4_FUZZ_SEED");
  const double seconds = seconds_env ? std::atof(seconds_env) : 0.0;
  constexpr int64_t kDefaultIterations = 50000;
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 20261129;
  if (seconds > 0) std::cout << "config fuzz: seed " << seed << ", " << seconds << " s\n";
  else std::cout << "config fuzz: seed " << seed << ", " << kDefaultIterations << " mutants\n";

  const std::string data = std::string(DSV4_TEST_DATA_DIR) + "/golden/";
  const std::vector<std::string> seeds = {read_text(data + "v40a.config.json"), read_text(data + "v41a.config.json"),
                                          kV41ConfigJsonNested, kV40ConfigJsonLegacy, kV40ModelArgs};
  // Every seed is a valid config in its own right.
  for (const auto& s : seeds) ASSERT_NO_THROW(parse_config_json(s, "seed"));

  Mutator mutator(seed);
  int64_t accepted = 0, rejected = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  const auto more = [&](int64_t iteration) {
    return seconds > 0 ? std::chrono::steady_clock::now() < deadline : iteration < kDefaultIterations;
  };
  for (int64_t iteration = 0; more(iteration); ++iteration) {
    std::string text = seeds[static_cast<size_t>(iteration) % seeds.size()];
    // Mutations stack a few rounds deep so that broken inputs are broken in several ways at once.
    for (int round = 0, rounds = 1 + static_cast<int>(iteration % 3); round < rounds; ++round) text = mutator.mutate(text);
    try {
      const ModelConfig c = parse_config_json(text, "fuzz");
      validate_config(c);
      const ModelTopology t = resolve_topology(c);
      ASSERT_EQ(t.size(), c.total_layers());
      for (const auto& p : t.layers) {
        ASSERT_TRUE(p.kv_source >= -1 && p.kv_source <= p.layer) << text;
        ASSERT_TRUE(p.index_source >= -1 && p.index_source <= p.layer) << text;
        ASSERT_EQ(p.compress_ratio > 0, p.kv_source >= 0) << text;
      }
      ++accepted;
    } catch (const Error& e) {
      ASSERT_EQ(std::string(e.what()).rfind("dsv4: config: ", 0), 0u) << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "non-dsv4 exception " << e.what() << " on input (seed " << seed << ", iteration " << iteration
             << "):\n" << text.substr(0, 2000);
    }
  }
  std::cout << "config fuzz: " << accepted << " accepted, " << rejected << " rejected\n";
  // Both outcomes must actually occur, or the mutations are too tame or too destructive to test anything.
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace dsv4

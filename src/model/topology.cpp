// Config validation (SPEC §1.3 invariants plus the shape rules the kernels rely on) and the
// resolution of per-layer roles.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "dsv4/config.h"
#include "dsv4/error.h"

namespace dsv4 {
namespace {

// Sanity limits: far above any released model, low enough that every size product stays in int64.
constexpr int64_t kMaxWidth = int64_t{1} << 20;       // hidden_size, q_lora_rank, o_lora_rank
constexpr int64_t kMaxHeads = int64_t{1} << 14;       // num_heads, index_n_heads
constexpr int64_t kMaxHeadDim = int64_t{1} << 14;     // head_dim, index_head_dim
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxMtpLayers = 64;
constexpr int64_t kMaxRatio = int64_t{1} << 16;
constexpr int64_t kMaxWindow = int64_t{1} << 24;
constexpr int64_t kMaxTopk = int64_t{1} << 24;
constexpr int64_t kMaxCandidateBlocks = int64_t{1} << 30;
constexpr int64_t kMaxCandidateBlockSize = int64_t{1} << 20;
constexpr int64_t kMaxPositions = int64_t{1} << 40;
constexpr int64_t kMaxWeightBlock = 4096;
constexpr int64_t kMaxTensorParallel = 1024;
constexpr int64_t kMaxDsparkBlock = 1024;

// The largest entry of an ascending list that is <= layer, or -1.
int latest_at_or_below(const std::vector<int>& ascending, int layer) {
  auto it = std::upper_bound(ascending.begin(), ascending.end(), layer);
  return it == ascending.begin() ? -1 : *std::prev(it);
}

bool contains(const std::vector<int>& list, int value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

std::string join(const std::vector<int>& list) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < list.size(); ++i) os << (i ? ", " : "") << list[i];
  os << "]";
  return os.str();
}

std::string indexed(const std::string& field, size_t i) { return field + "[" + std::to_string(i) + "]"; }

class ConfigChecker {
 public:
  explicit ConfigChecker(const ModelConfig& c) : c_(c), source_(c.name.empty() ? "config" : c.name) {}

  void run() {
    check_sizes();
    check_ratios();
    if (c_.family == ModelFamily::v4_1) check_v41_sources();
    if (c_.indexer_qat && c_.family == ModelFamily::v4_1)
      invalid("indexer_qat", "true", "selects the V4.0 indexer's Hadamard + FP4 path, which V4.1 has not");
    check_indexer();
    check_rope("main_rope", c_.main_rope);
    check_rope("compress_rope", c_.compress_rope);
    if (!(std::isfinite(c_.rms_norm_eps) && c_.rms_norm_eps > 0.0 && c_.rms_norm_eps < 1.0))
      invalid("rms_norm_eps", c_.rms_norm_eps, "must be a finite number in (0, 1)");
    check_weight_quantization();
    check_dspark();
  }

 private:
  template <class V>
  [[noreturn]] void invalid(const std::string& field, const V& value, const std::string& rule) const {
    fail("config: ", source_, ": field '", field, "' = ", value, ": ", rule);
  }

  void in_range(const std::string& field, int64_t value, int64_t lo, int64_t hi) const {
    if (value < lo || value > hi)
      invalid(field, value, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }

  void multiple_of(const std::string& field, int64_t value, int64_t divisor, const std::string& why) const {
    if (value % divisor != 0) invalid(field, value, "must be a multiple of " + std::to_string(divisor) + " (" + why + ")");
  }

  // Head widths are cut into quantization tiles: V4.1 32-channel FP8/FP4 tiles, V4.0 64-channel
  // fp8_ds_mla tiles (SPEC §7).
  int64_t tile() const { return c_.family == ModelFamily::v4_1 ? 32 : 64; }
  std::string tile_reason() const {
    return c_.family == ModelFamily::v4_1 ? "V4.1 quantizes in 32-channel tiles" : "V4.0 quantizes in 64-channel tiles";
  }

  void check_sizes() const {
    in_range("hidden_size", c_.hidden_size, 1, kMaxWidth);
    in_range("num_layers", c_.num_layers, 1, kMaxLayers);
    in_range("num_mtp_layers", c_.num_mtp_layers, 0, kMaxMtpLayers);
    in_range("num_heads", c_.num_heads, 1, kMaxHeads);
    in_range("head_dim", c_.head_dim, 1, kMaxHeadDim);
    multiple_of("head_dim", c_.head_dim, tile(), tile_reason());
    in_range("rope_head_dim", c_.rope_head_dim, 2, c_.head_dim);
    if (c_.rope_head_dim % 2 != 0) invalid("rope_head_dim", c_.rope_head_dim, "must be even (RoPE rotates channel pairs)");
    in_range("q_lora_rank", c_.q_lora_rank, 1, kMaxWidth);
    in_range("o_groups", c_.o_groups, 1, c_.num_heads);
    if (c_.num_heads % c_.o_groups != 0)
      invalid("num_heads", c_.num_heads, "must be divisible by o_groups = " + std::to_string(c_.o_groups));
    in_range("o_lora_rank", c_.o_lora_rank, 1, kMaxWidth);
    in_range("sliding_window", c_.sliding_window, 1, kMaxWindow);
    in_range("vision_max_n_token", c_.vision_max_n_token, 0, kMaxWindow);
    in_range("tensor_parallel_size", c_.tensor_parallel_size, 1, kMaxTensorParallel);
    if (c_.num_heads % c_.tensor_parallel_size != 0)
      invalid("num_heads", c_.num_heads,
              "must be divisible by tensor_parallel_size = " + std::to_string(c_.tensor_parallel_size));
    if (c_.o_groups % c_.tensor_parallel_size != 0)
      invalid("o_groups", c_.o_groups,
              "must be divisible by tensor_parallel_size = " + std::to_string(c_.tensor_parallel_size) +
                  " (each rank owns whole output groups)");
  }

  void check_ratios() const {
    if (c_.compress_ratios.size() != static_cast<size_t>(c_.num_layers))
      invalid("compress_ratios", std::to_string(c_.compress_ratios.size()) + " entries",
              "must list every backbone layer (num_layers = " + std::to_string(c_.num_layers) + ")");
    if (c_.family == ModelFamily::v4_1) {
      if (!c_.layer_kinds.empty())
        invalid("layer_kinds", std::to_string(c_.layer_kinds.size()) + " entries", "must be empty for V4.1");
      for (size_t l = 0; l < c_.compress_ratios.size(); ++l) {
        const int r = c_.compress_ratios[l];
        if (r != 0 && r != 1 && r != 2) invalid(indexed("compress_ratios", l), r, "allowed ratios for V4.1 are 0, 1, 2");
      }
      return;
    }
    if (c_.layer_kinds.size() != c_.compress_ratios.size())
      invalid("layer_kinds", std::to_string(c_.layer_kinds.size()) + " entries",
              "V4.0 needs one kind per backbone layer (" + std::to_string(c_.num_layers) + ")");
    for (size_t l = 0; l < c_.compress_ratios.size(); ++l) {
      const int r = c_.compress_ratios[l];
      const AttentionKind kind = c_.layer_kinds[l];
      if (kind == AttentionKind::compressed)
        invalid(indexed("layer_kinds", l), attention_kind_name(kind), "V4.0 layers are sliding, csa or hca");
      if (kind == AttentionKind::sliding && r != 0)
        invalid(indexed("compress_ratios", l), r, "a V4.0 sliding layer has ratio 0");
      if (kind != AttentionKind::sliding && (r < 2 || r > kMaxRatio))
        invalid(indexed("compress_ratios", l), r,
                std::string("a V4.0 ") + attention_kind_name(kind) + " layer needs a ratio in [2, " +
                    std::to_string(kMaxRatio) + "]");
    }
    if (!c_.kv_source_layers.empty())
      invalid("kv_source_layers", join(c_.kv_source_layers), "must be empty for V4.0 (every compressed layer is its own source)");
    if (!c_.index_source_layers.empty())
      invalid("index_source_layers", join(c_.index_source_layers), "must be empty for V4.0 (every CSA layer has its own indexer)");
    if (c_.candidate_source_layer != -1)
      invalid("candidate_source_layer", c_.candidate_source_layer, "must be -1 for V4.0 (no candidate filtering)");
  }

  // Entries are compressing backbone layers in ascending order.
  void check_source_list(const std::string& field, const std::vector<int>& list, const char* role) const {
    for (size_t i = 0; i < list.size(); ++i) {
      const int s = list[i];
      if (s < 0 || s >= c_.num_layers)
        invalid(indexed(field, i), s, std::string(role) + " are backbone layers 0.." + std::to_string(c_.num_layers - 1));
      if (i > 0 && s <= list[i - 1]) invalid(indexed(field, i), s, "must be sorted ascending without duplicates");
      if (c_.compress_ratios[static_cast<size_t>(s)] == 0)
        invalid(indexed(field, i), s, std::string(role) + " must compress, but layer " + std::to_string(s) + " has ratio 0");
    }
  }

  void check_v41_sources() const {
    const auto& kv = c_.kv_source_layers;
    const auto& idx = c_.index_source_layers;
    check_source_list("kv_source_layers", kv, "kv sources");
    check_source_list("index_source_layers", idx, "index sources");
    for (int l = 0; l < c_.num_layers; ++l) {
      const int r = c_.compress_ratios[static_cast<size_t>(l)];
      if (r == 0) continue;
      const std::string field = indexed("compress_ratios", static_cast<size_t>(l));
      const int kv_src = latest_at_or_below(kv, l);
      if (kv_src < 0)
        invalid(field, r, "layer " + std::to_string(l) + " compresses but has no kv source at or below it (kv_source_layers = " + join(kv) + ")");
      const int kv_ratio = c_.compress_ratios[static_cast<size_t>(kv_src)];
      if (kv_ratio != r)
        invalid(field, r, "layer " + std::to_string(l) + " reads the compressed cache of kv source " + std::to_string(kv_src) +
                              ", whose ratio is " + std::to_string(kv_ratio) + "; the ratios must match");
      const int idx_src = latest_at_or_below(idx, l);
      if (idx_src < 0)
        invalid(field, r, "layer " + std::to_string(l) + " compresses but has no index source at or below it (index_source_layers = " + join(idx) + ")");
      const int idx_kv = latest_at_or_below(kv, idx_src);
      if (idx_kv != kv_src)
        invalid(indexed("index_source_layers", static_cast<size_t>(std::find(idx.begin(), idx.end(), idx_src) - idx.begin())), idx_src,
                "index source " + std::to_string(idx_src) + " scores the keys of kv source " + std::to_string(idx_kv) +
                    ", but layer " + std::to_string(l) + " that reuses its picks reads kv source " + std::to_string(kv_src));
    }
    const int cand = c_.candidate_source_layer;
    if (cand == -1) return;
    if (!contains(idx, cand))
      invalid("candidate_source_layer", cand, "must be one of the index sources " + join(idx) + " or -1");
    in_range("candidate_topk_blocks", c_.candidate_topk_blocks, 1, kMaxCandidateBlocks);
    in_range("candidate_block_size", c_.candidate_block_size, 1, kMaxCandidateBlockSize);
  }

  bool has_indexer() const {
    if (c_.family == ModelFamily::v4_1) return !c_.index_source_layers.empty();
    return std::find(c_.layer_kinds.begin(), c_.layer_kinds.end(), AttentionKind::csa) != c_.layer_kinds.end();
  }

  void check_indexer() const {
    if (!has_indexer()) return;
    in_range("index_n_heads", c_.index_n_heads, 1, kMaxHeads);
    in_range("index_head_dim", c_.index_head_dim, c_.rope_head_dim, kMaxHeadDim);
    multiple_of("index_head_dim", c_.index_head_dim, tile(), tile_reason());
    in_range("index_topk", c_.index_topk, 1, kMaxTopk);
    if (c_.indexer_qat && (c_.index_head_dim & (c_.index_head_dim - 1)) != 0)
      invalid("index_head_dim", c_.index_head_dim, "must be a power of two for indexer_qat (its Hadamard transform)");
  }

  void check_rope(const std::string& field, const RopeParams& rope) const {
    if (!(std::isfinite(rope.theta) && rope.theta > 1.0))
      invalid(field + ".theta", rope.theta, "must be a finite number above 1");
    if (!rope.yarn) return;
    if (!(std::isfinite(rope.factor) && rope.factor >= 1.0))
      invalid(field + ".factor", rope.factor, "the YaRN factor must be a finite number >= 1");
    in_range(field + ".original_max_position", rope.original_max_position, 1, kMaxPositions);
    if (!(std::isfinite(rope.beta_fast) && rope.beta_fast > 0.0))
      invalid(field + ".beta_fast", rope.beta_fast, "must be a finite positive number");
    if (!(std::isfinite(rope.beta_slow) && rope.beta_slow > 0.0))
      invalid(field + ".beta_slow", rope.beta_slow, "must be a finite positive number");
  }

  void check_weight_quantization() const {
    if (!c_.weight_quantization) return;
    const WeightQuantization& w = *c_.weight_quantization;
    in_range("weight_quantization.block_out", w.block_out, 1, kMaxWeightBlock);
    in_range("weight_quantization.block_in", w.block_in, 1, kMaxWeightBlock);
    // hidden_size and q_lora_rank are both input and output widths of fp8 projections.
    const std::string block = std::to_string(w.block_out) + "x" + std::to_string(w.block_in) + " fp8 weight block";
    for (auto [field, value] : {std::pair<const char*, int64_t>{"hidden_size", c_.hidden_size}, {"q_lora_rank", c_.q_lora_rank}})
      if (value % w.block_out != 0 || value % w.block_in != 0)
        invalid(field, value, "must be a multiple of the " + block);
  }

  // DSpark: distinct backbone target layers, a block size; draft stages are the MTP layers.
  void check_dspark() const {
    const auto& targets = c_.dspark_target_layer_ids;
    if (targets.empty()) return;
    if (c_.num_mtp_layers == 0)
      invalid("dspark_target_layer_ids", join(targets), "names DSpark target layers, but the model has no MTP (draft) layers");
    for (size_t i = 0; i < targets.size(); ++i) {
      if (targets[i] < 0 || targets[i] >= c_.num_layers)
        invalid(indexed("dspark_target_layer_ids", i), targets[i],
                "DSpark target layers are backbone layers 0.." + std::to_string(c_.num_layers - 1));
      if (std::find(targets.begin(), targets.begin() + static_cast<std::ptrdiff_t>(i), targets[i]) !=
          targets.begin() + static_cast<std::ptrdiff_t>(i))
        invalid(indexed("dspark_target_layer_ids", i), targets[i], "is listed twice");
    }
    in_range("dspark_block_size", c_.dspark_block_size, 1, kMaxDsparkBlock);
    in_range("dspark_main_width", c_.dspark_main_width(), 1, kMaxWidth);
  }

  const ModelConfig& c_;
  std::string source_;
};

}  // namespace

void validate_config(const ModelConfig& config) { ConfigChecker(config).run(); }

ModelTopology resolve_topology(const ModelConfig& config) {
  validate_config(config);
  ModelTopology topology;
  topology.layers.resize(static_cast<size_t>(config.total_layers()));
  for (int l = 0; l < config.total_layers(); ++l) {
    LayerPlan& p = topology.layers[static_cast<size_t>(l)];
    p.layer = l;
    p.is_mtp = l >= config.num_layers;
    p.compress_ratio = p.is_mtp ? 0 : config.compress_ratio(l);
    p.uses_compress_rope = p.compress_ratio > 0;
    if (p.is_mtp && config.has_dspark()) {
      p.kind = AttentionKind::dspark;
      p.dspark_stage = l - config.num_layers;
    }
    if (p.compress_ratio == 0) continue;  // sliding window only
    if (config.family == ModelFamily::v4_1) {
      p.kind = AttentionKind::compressed;
      p.kv_source = latest_at_or_below(config.kv_source_layers, l);
      p.index_source = latest_at_or_below(config.index_source_layers, l);
      // Validation guarantees every kv source is also its own index source, so its indexer owns wk/k_norm.
      p.owns_compressor = p.owns_index_keys = p.kv_source == l;
      p.owns_indexer = p.index_source == l;
      p.is_candidate_source = l == config.candidate_source_layer;
      p.uses_candidates = p.owns_indexer && config.candidate_source_layer >= 0 && config.candidate_source_layer < l;
    } else {
      p.kind = config.layer_kinds[static_cast<size_t>(l)];
      p.kv_source = l;
      p.owns_compressor = true;
      if (p.kind == AttentionKind::csa) {
        p.index_source = l;
        p.owns_indexer = p.owns_index_keys = true;
      }
    }
  }
  return topology;
}

}  // namespace dsv4

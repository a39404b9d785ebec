// Attention tensor names: DeepSeek native and transformers deepseek_v4 spellings (SPEC §2.1, §12).
#include <charconv>
#include <limits>
#include <map>
#include <string_view>

#include "weights/weight_names.h"

namespace dsv4 {
namespace {

struct RoleNames {
  WeightRole role;
  const char* native;        // after "layers.{l}."
  const char* transformers;  // after "layers.{l}."; nullptr: no transformers deepseek_v4 name
};

constexpr RoleNames kRoleNames[kNumWeightRoles] = {
    {WeightRole::wq_a, "attn.wq_a.weight", "self_attn.q_a_proj.weight"},
    {WeightRole::q_norm, "attn.q_norm.weight", "self_attn.q_a_norm.weight"},
    {WeightRole::wq_b, "attn.wq_b.weight", "self_attn.q_b_proj.weight"},
    {WeightRole::wkv, "attn.wkv.weight", "self_attn.kv_proj.weight"},
    {WeightRole::kv_norm, "attn.kv_norm.weight", "self_attn.kv_norm.weight"},
    {WeightRole::wo_a, "attn.wo_a.weight", "self_attn.o_a_proj.weight"},
    {WeightRole::wo_b, "attn.wo_b.weight", "self_attn.o_b_proj.weight"},
    {WeightRole::attn_sink, "attn.attn_sink", "self_attn.sinks"},
    {WeightRole::compressor_wkv, "attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"},
    {WeightRole::compressor_wgate, "attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"},
    {WeightRole::compressor_norm, "attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"},
    {WeightRole::compressor_ape, "attn.compressor.ape", "self_attn.compressor.position_bias"},
    {WeightRole::indexer_wq_b, "attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"},
    {WeightRole::indexer_weights_proj, "attn.indexer.weights_proj.weight",
     "self_attn.compressor.indexer.scorer.weights_proj.weight"},
    {WeightRole::indexer_wk, "attn.indexer.wk.weight", nullptr},
    {WeightRole::indexer_k_norm, "attn.indexer.k_norm.weight", nullptr},
    {WeightRole::indexer_compressor_wkv, "attn.indexer.compressor.wkv.weight",
     "self_attn.compressor.indexer.kv_proj.weight"},
    {WeightRole::indexer_compressor_wgate, "attn.indexer.compressor.wgate.weight",
     "self_attn.compressor.indexer.gate_proj.weight"},
    {WeightRole::indexer_compressor_norm, "attn.indexer.compressor.norm.weight",
     "self_attn.compressor.indexer.kv_norm.weight"},
    {WeightRole::indexer_compressor_ape, "attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"},
    // Outside the attention module in both spellings (`mtp.0.main_proj.weight`, `model.layers.{L}.main_proj.weight`).
    {WeightRole::main_proj, "main_proj.weight", nullptr},
    {WeightRole::main_norm, "main_norm.weight", nullptr},
};

constexpr bool roles_in_enum_order() {
  for (int i = 0; i < kNumWeightRoles; ++i)
    if (static_cast<int>(kRoleNames[i].role) != i) return false;
  return true;
}
static_assert(roles_in_enum_order(), "kRoleNames must list the roles in WeightRole order");

const RoleNames& names_of(WeightRole r) { return kRoleNames[static_cast<int>(r)]; }

constexpr std::string_view kWeightSuffix = ".weight";
constexpr std::string_view kNativeScaleSuffix = ".scale";
constexpr std::string_view kTransformersScaleSuffix = ".weight_scale_inv";

// "attn.wq_a.weight" -> "attn.wq_a" + scale suffix; empty for tensors that are not projections.
std::string scale_name(std::string_view tensor, std::string_view suffix) {
  if (!tensor.ends_with(kWeightSuffix)) return {};
  return std::string(tensor.substr(0, tensor.size() - kWeightSuffix.size())) + std::string(suffix);
}

struct SuffixMeaning {
  WeightRole role;
  bool is_scale;
  weight_names::Scheme scheme;
};

// Every accepted spelling of the part after the layer prefix.
const std::map<std::string, SuffixMeaning, std::less<>>& suffix_table() {
  static const auto table = [] {
    std::map<std::string, SuffixMeaning, std::less<>> t;
    for (const RoleNames& n : kRoleNames) {
      for (const auto& [text, scheme] : {std::pair{n.native, weight_names::Scheme::native},
                                         std::pair{n.transformers, weight_names::Scheme::transformers}}) {
        if (!text) continue;
        t[text] = {n.role, false, scheme};
        for (std::string_view suffix : {kNativeScaleSuffix, kTransformersScaleSuffix}) {
          const std::string scale = scale_name(text, suffix);
          if (!scale.empty()) t[scale] = {n.role, true, scheme};
        }
      }
    }
    return t;
  }();
  return table;
}

// Consumes "<prefix><decimal>." from `s` (left unchanged on failure); the number must fit an int
// and be written canonically (no sign, no leading zeros).
std::optional<int> take_index(std::string_view& s, std::string_view prefix) {
  if (!s.starts_with(prefix)) return std::nullopt;
  const std::string_view digits = s.substr(prefix.size());
  int value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  const size_t length = static_cast<size_t>(end - digits.data());
  if (digits.empty() || digits[0] < '0' || digits[0] > '9' || ec != std::errc() || length == digits.size() ||
      digits[length] != '.' || (length > 1 && digits[0] == '0'))
    return std::nullopt;
  s.remove_prefix(prefix.size() + length + 1);
  return value;
}

}  // namespace

const char* weight_role_name(WeightRole r) {
  DSV4_CHECK(static_cast<int>(r) < kNumWeightRoles, "weights: invalid weight role ", static_cast<int>(r));
  return names_of(r).native;
}

namespace weight_names {

std::optional<Parsed> parse(const std::string& name, const ModelConfig& config) {
  std::string_view rest = name;
  Parsed p;
  if (rest.starts_with("model.")) {
    p.style.model_prefix = true;
    rest.remove_prefix(6);
  }
  if (const auto layer = take_index(rest, "layers.")) {
    p.layer = *layer;
  } else if (const auto mtp = take_index(rest, "mtp.")) {
    if (*mtp > std::numeric_limits<int>::max() - config.num_layers) return std::nullopt;
    p.layer = config.num_layers + *mtp;
    p.style.mtp_base = config.num_layers;
  } else {
    return std::nullopt;
  }
  const auto& table = suffix_table();
  const auto it = table.find(rest);
  if (it == table.end()) return std::nullopt;
  p.role = it->second.role;
  p.is_scale = it->second.is_scale;
  p.style.scheme = it->second.scheme;
  return p;
}

std::string name_of(int layer, WeightRole role, Style style, bool scale) {
  const RoleNames& n = names_of(role);
  const bool transformers = style.scheme == Scheme::transformers && n.transformers != nullptr;
  const char* tensor = transformers ? n.transformers : n.native;
  const std::string suffix =
      scale ? scale_name(tensor, transformers ? kTransformersScaleSuffix : kNativeScaleSuffix) : tensor;
  DSV4_CHECK(!suffix.empty(), "weights: tensor '", tensor, "' is not a projection and has no scales");
  const std::string prefix = style.model_prefix ? "model." : "";
  if (style.mtp_base >= 0 && layer >= style.mtp_base)
    return prefix + "mtp." + std::to_string(layer - style.mtp_base) + "." + suffix;
  return prefix + "layers." + std::to_string(layer) + "." + suffix;
}

std::string scale_role_name(WeightRole role) { return scale_name(names_of(role).native, kNativeScaleSuffix); }

}  // namespace weight_names
}  // namespace dsv4

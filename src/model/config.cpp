// Reading the three config forms (SPEC §1, docs/config.md) into a ModelConfig.
#include "dsv4/config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "dsv4/error.h"

namespace dsv4 {

const char* family_name(ModelFamily f) {
  switch (f) {
    case ModelFamily::v4_0: return "V4.0";
    case ModelFamily::v4_1: return "V4.1";
  }
  return "?";
}

const char* attention_kind_name(AttentionKind k) {
  switch (k) {
    case AttentionKind::sliding: return "sliding";
    case AttentionKind::compressed: return "compressed";
    case AttentionKind::csa: return "csa";
    case AttentionKind::hca: return "hca";
    case AttentionKind::dspark: return "dspark";
  }
  return "?";
}

const char* layer_set_name(LayerSet s) {
  switch (s) {
    case LayerSet::all: return "all";
    case LayerSet::draft: return "draft";
  }
  return "?";
}

namespace {

using json = nlohmann::json;

// Config files are a few levels deep; anything deeper is rejected before the parser sees it so
// that no recursion anywhere (parser, destructor, dump) can run away on hostile input.
constexpr int kMaxNestingDepth = 64;
constexpr size_t kMaxShownChars = 48;

// A short rendering of a JSON value for messages (never dumps containers or long strings).
std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array of " + std::to_string(v.size());
    case json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      if (s.size() <= kMaxShownChars) return "\"" + s + "\"";
      return "\"" + s.substr(0, kMaxShownChars) + "...\"";
    }
    default: return v.dump();
  }
}

void check_nesting_depth(const std::string& text, const std::string& source) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxNestingDepth)
        fail("config: ", source, ": JSON nesting depth exceeds ", kMaxNestingDepth, " at byte ", i,
             " (a config is a few levels deep)");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

// Typed access to the fields of one JSON object; every failure names "<prefix><key>" and the value.
// A null value counts as absent (transformers writes unset options as null).
class FieldReader {
 public:
  FieldReader(const json& object, std::string source, std::string prefix)
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  const std::string& source() const { return source_; }
  std::string path(const std::string& key) const { return prefix_ + key; }

  const json* find(const std::string& key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  [[noreturn]] void invalid(const std::string& field, const json& value, const std::string& rule) const {
    fail("config: ", source_, ": field '", field, "' = ", describe(value), ": ", rule);
  }
  [[noreturn]] void missing(const std::string& key, const std::string& why) const {
    fail("config: ", source_, ": field '", path(key), "' is missing: ", why);
  }

  // An integer that fits T; integral floats (16.0) are accepted, anything else is an error.
  template <class T>
  T integer_value(const json& v, const std::string& field) const {
    constexpr auto lo = std::numeric_limits<T>::min();
    constexpr auto hi = std::numeric_limits<T>::max();
    const std::string range = " in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) invalid(field, v, "expected an integer" + range);
      return static_cast<T>(u);
    }
    if (v.is_number_integer()) {
      const int64_t s = v.get<int64_t>();
      if (s < static_cast<int64_t>(lo) || s > static_cast<int64_t>(hi))
        invalid(field, v, "expected an integer" + range);
      return static_cast<T>(s);
    }
    if (v.is_number_float()) {
      const double d = v.get<double>();
      // 2^63 bounds int64 exactly; smaller T are checked against their own limits.
      if (std::trunc(d) == d && d >= static_cast<double>(lo) && d < 9.2233720368547758e18 &&
          d <= static_cast<double>(hi))
        return static_cast<T>(d);
    }
    invalid(field, v, "expected an integer" + range);
  }

  template <class T>
  T integer(const std::string& key, T fallback) const {
    const json* v = find(key);
    return v ? integer_value<T>(*v, path(key)) : fallback;
  }
  template <class T>
  T required_integer(const std::string& key, const std::string& why) const {
    const json* v = find(key);
    if (!v) missing(key, why);
    return integer_value<T>(*v, path(key));
  }

  double number(const std::string& key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) invalid(path(key), *v, "expected a number");
    return v->get<double>();
  }

  bool boolean(const std::string& key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) invalid(path(key), *v, "expected true or false");
    return v->get<bool>();
  }

  std::string string(const std::string& key, const std::string& fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) invalid(path(key), *v, "expected a string");
    return v->get<std::string>();
  }

  const json* array(const std::string& key) const {
    const json* v = find(key);
    if (v && !v->is_array()) invalid(path(key), *v, "expected an array");
    return v;
  }

  std::vector<int> int_list(const std::string& key) const {
    std::vector<int> out;
    if (const json* v = array(key)) {
      out.reserve(v->size());
      for (size_t i = 0; i < v->size(); ++i)
        out.push_back(integer_value<int>((*v)[i], path(key) + "[" + std::to_string(i) + "]"));
    }
    return out;
  }

  // A nested object (absent or null: nullopt).
  std::optional<FieldReader> object(const std::string& key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_object()) invalid(path(key), *v, "expected an object");
    return FieldReader(*v, source_, path(key) + ".");
  }

 private:
  const json& object_;
  std::string source_;
  std::string prefix_;
};

// Key names of the fields that only differ in spelling between config.json and ModelArgs.
struct KeyNames {
  const char* hidden_size;
  const char* num_layers;
  const char* num_mtp_layers;
  const char* num_heads;
  const char* rope_head_dim;
  const char* sliding_window;
  const char* kv_sources;
  const char* index_sources;
  const char* candidate_source;
  const char* norm_eps;
};
constexpr KeyNames kConfigJsonKeys{"hidden_size",          "num_hidden_layers",   "num_nextn_predict_layers",
                                   "num_attention_heads",  "qk_rope_head_dim",    "sliding_window",
                                   "kv_source_layer_ids",  "index_source_layer_ids",
                                   "candidate_source_layer_id", "rms_norm_eps"};
constexpr KeyNames kModelArgsKeys{"dim",         "n_layers",         "n_mtp_layers",
                                  "n_heads",     "rope_head_dim",    "window_size",
                                  "kv_source_layers", "index_source_layers",
                                  "candidate_source_layer", "norm_eps"};

// transformers deepseek_v4 layer types and their default compress rates.
struct V40LayerType {
  const char* name;
  AttentionKind kind;
  int default_rate;
};
constexpr V40LayerType kV40LayerTypes[] = {
    {"sliding_attention", AttentionKind::sliding, 0},
    {"compressed_sparse_attention", AttentionKind::csa, 4},
    {"heavily_compressed_attention", AttentionKind::hca, 128},
};

// Per-layer ratios and (V4.0) kinds as listed in the file, possibly with MTP entries.
struct LayerList {
  std::string field;                  // where the list came from, for messages
  std::vector<int> ratios;
  std::vector<AttentionKind> kinds;   // V4.0 only
};

LayerList layers_from_layer_types(const FieldReader& r) {
  LayerList out{r.path("layer_types"), {}, {}};
  const json& types = *r.array("layer_types");
  const auto rates = r.object("compress_rates");
  for (size_t i = 0; i < types.size(); ++i) {
    const std::string field = r.path("layer_types") + "[" + std::to_string(i) + "]";
    if (!types[i].is_string()) r.invalid(field, types[i], "expected a layer type string");
    const std::string& name = types[i].get_ref<const std::string&>();
    const auto* type = std::find_if(std::begin(kV40LayerTypes), std::end(kV40LayerTypes),
                                    [&](const V40LayerType& t) { return name == t.name; });
    if (type == std::end(kV40LayerTypes))
      r.invalid(field, types[i],
                "expected sliding_attention, compressed_sparse_attention or heavily_compressed_attention");
    int rate = type->default_rate;
    if (type->kind != AttentionKind::sliding && rates) {
      if (!rates->has(type->name))
        r.missing(std::string("compress_rates.") + type->name, "used by " + field);
      rate = rates->integer<int>(type->name, 0);
    }
    out.ratios.push_back(rate);
    out.kinds.push_back(type->kind);
  }
  return out;
}

// A legacy V4.0 ratio list knows only the released rates, as transformers' mapping does.
std::vector<AttentionKind> v40_kinds_from_ratios(const FieldReader& r, const std::string& key,
                                                 const std::vector<int>& ratios) {
  std::vector<AttentionKind> kinds;
  for (size_t i = 0; i < ratios.size(); ++i) {
    if (ratios[i] == 0) kinds.push_back(AttentionKind::sliding);
    else if (ratios[i] == 4) kinds.push_back(AttentionKind::csa);
    else if (ratios[i] == 128) kinds.push_back(AttentionKind::hca);
    else
      r.invalid(r.path(key) + "[" + std::to_string(i) + "]", ratios[i],
                "a V4.0 compress_ratios list maps 0 to sliding, 4 to CSA and 128 to HCA "
                "(other rates need layer_types + compress_rates)");
  }
  return kinds;
}

// DeepSeek's V4.0 code makes a ratio-4 layer CSA (overlapping compressor + indexer) and any other
// ratio HCA (SPEC §12); 1 and 2 never reach here (they mark V4.1), validation bounds the rest.
std::vector<AttentionKind> v40_kinds_of_model_args(const std::vector<int>& ratios) {
  std::vector<AttentionKind> kinds;
  for (int r : ratios) kinds.push_back(r == 0 ? AttentionKind::sliding : r == 4 ? AttentionKind::csa : AttentionKind::hca);
  return kinds;
}

// A rope description in transformers' spelling: rope_type (or type) default | yarn, rope_theta and
// the YaRN parameters. A yarn entry must name its factor and original length; betas default to 32 / 1.
RopeParams rope_from_object(const FieldReader& r, double default_theta) {
  RopeParams rope;
  rope.theta = r.number("rope_theta", default_theta);
  const char* type_key = r.has("rope_type") ? "rope_type" : "type";
  const std::string type = r.string(type_key, "default");
  if (type == "yarn") {
    if (!r.has("factor")) r.missing("factor", "YaRN needs its scaling factor");
    if (!r.has("original_max_position_embeddings"))
      r.missing("original_max_position_embeddings", "YaRN needs its original context length");
    rope.yarn = true;
    rope.factor = r.number("factor", rope.factor);
    rope.original_max_position = r.integer<int64_t>("original_max_position_embeddings", 0);
    rope.beta_fast = r.number("beta_fast", rope.beta_fast);
    rope.beta_slow = r.number("beta_slow", rope.beta_slow);
  } else if (type != "default") {
    r.invalid(r.path(type_key), type, "supported rope types are default and yarn");
  }
  // SPEC §2.4: cos/sin are never scaled; a config asking for it cannot be honoured.
  if (const json* factor = r.find("attention_factor"); factor && r.number("attention_factor", 1.0) != 1.0)
    r.invalid(r.path("attention_factor"), *factor, "dsv4 applies no YaRN attention factor (SPEC §2.4), only 1.0");
  return rope;
}

// transformers deepseek_v4: rope_parameters {main, compress}. V4.1 config.json: rope_theta,
// compress_rope_theta and rope_scaling (YaRN of the compressed layers; absent means none).
void read_config_json_rope(const FieldReader& r, const ModelConfig& released, ModelConfig& c) {
  if (auto params = r.object("rope_parameters")) {
    const char* why = "rope_parameters must hold 'main' and 'compress' entries";
    auto main = params->object("main");
    if (!main) params->missing("main", why);
    auto compress = params->object("compress");
    if (!compress) params->missing("compress", why);
    c.main_rope = rope_from_object(*main, released.main_rope.theta);
    c.compress_rope = rope_from_object(*compress, released.compress_rope.theta);
    return;
  }
  c.main_rope = RopeParams{.theta = r.number("rope_theta", released.main_rope.theta)};
  const double compress_theta = r.number("compress_rope_theta", released.compress_rope.theta);
  if (auto scaling = r.object("rope_scaling")) {
    if (scaling->has("rope_theta")) scaling->invalid(scaling->path("rope_theta"), *scaling->find("rope_theta"),
                                                     "the compressed layers' theta is compress_rope_theta");
    c.compress_rope = rope_from_object(*scaling, compress_theta);
  } else {
    c.compress_rope = RopeParams{.theta = compress_theta};
  }
}

// ModelArgs: the reference applies YaRN (rope_factor, beta_fast, beta_slow) to the compressed
// layers exactly when original_seq_len > 0.
void read_model_args_rope(const FieldReader& r, const ModelConfig& released, ModelConfig& c) {
  const RopeParams& rel = released.compress_rope;
  c.main_rope = RopeParams{.theta = r.number("rope_theta", released.main_rope.theta)};
  c.compress_rope.theta = r.number("compress_rope_theta", rel.theta);
  c.compress_rope.original_max_position = r.integer<int64_t>("original_seq_len", rel.original_max_position);
  c.compress_rope.yarn = c.compress_rope.original_max_position > 0;
  c.compress_rope.factor = r.number("rope_factor", rel.factor);
  c.compress_rope.beta_fast = r.number("beta_fast", rel.beta_fast);
  c.compress_rope.beta_slow = r.number("beta_slow", rel.beta_slow);
}

bool ue8m0_scale_format(const FieldReader& r) {
  const std::string fmt = r.string("scale_fmt", "");
  if (fmt.empty()) return false;  // no scale_fmt: fp32 scale_inv tensors (DeepSeek V3 convention)
  if (fmt != "ue8m0") r.invalid(r.path("scale_fmt"), fmt, "supported scale formats are ue8m0 and none (fp32)");
  return true;
}

std::optional<WeightQuantization> read_quantization_config(const FieldReader& q) {
  const std::string method = q.string("quant_method", "fp8");
  if (method != "fp8") q.invalid(q.path("quant_method"), method, "only fp8 block quantization is supported");
  const std::string fmt = q.string("fmt", "e4m3");
  if (fmt != "e4m3") q.invalid(q.path("fmt"), fmt, "only e4m3 weights are supported");
  const json* block = q.array("weight_block_size");
  if (!block) q.missing("weight_block_size", "fp8 weights need their scale block shape");
  if (block->size() != 2) q.invalid(q.path("weight_block_size"), *block, "expected [rows, columns]");
  WeightQuantization w;
  w.block_out = q.integer_value<int>((*block)[0], q.path("weight_block_size[0]"));
  w.block_in = q.integer_value<int>((*block)[1], q.path("weight_block_size[1]"));
  w.ue8m0_scales = ue8m0_scale_format(q);
  return w;
}

// ModelArgs dtype: fp8 weights use the family's released block (SPEC §10: V4.0 128x128, V4.1 32x32).
std::optional<WeightQuantization> read_model_args_dtype(const FieldReader& r, const ModelConfig& released) {
  const std::string dtype = r.string("dtype", "bf16");
  if (dtype == "bf16") return std::nullopt;
  if (dtype != "fp8") r.invalid(r.path("dtype"), dtype, "expected bf16 or fp8");
  WeightQuantization w = *released.weight_quantization;
  w.ue8m0_scales = ue8m0_scale_format(r);
  return w;
}

ModelConfig parse_root(const json& root, const std::string& source) {
  if (!root.is_object())
    fail("config: ", source, ": the root is ", describe(root), ", expected a JSON object");
  const FieldReader top(root, source, "");
  // The released V4.1 config.json nests the text model's fields under text_config.
  const auto nested = top.object("text_config");
  const FieldReader& r = nested ? *nested : top;

  const bool model_args_keys = r.has("dim") || r.has("n_layers") || r.has("n_heads");
  const bool config_json_keys = r.has("hidden_size") || r.has("num_hidden_layers") || r.has("num_attention_heads");
  if (model_args_keys && config_json_keys)
    fail("config: ", source, ": mixes ModelArgs keys (dim/n_layers/n_heads) with config.json keys "
         "(hidden_size/num_hidden_layers/num_attention_heads); expected one form");
  if (!model_args_keys && !config_json_keys)
    fail("config: ", source, ": neither 'hidden_size' (config.json) nor 'dim' (ModelArgs) is present; "
         "expected a DeepSeek V4 / V4.1 config");
  const bool model_args = model_args_keys;
  const KeyNames& k = model_args ? kModelArgsKeys : kConfigJsonKeys;

  ModelConfig c;
  c.name = source;
  c.num_layers = r.required_integer<int>(k.num_layers, "the number of backbone layers");
  c.num_mtp_layers = r.integer<int>(k.num_mtp_layers, 0);
  if (c.num_layers < 0 || c.num_mtp_layers < 0)
    r.invalid(r.path(c.num_layers < 0 ? k.num_layers : k.num_mtp_layers),
              c.num_layers < 0 ? c.num_layers : c.num_mtp_layers, "a layer count cannot be negative");

  // Per-layer ratios: layer_types (+ compress_rates) in transformers V4.0 configs, else compress_ratios.
  LayerList layers;
  const bool has_layer_types = !model_args && r.has("layer_types");
  const bool has_ratio_list = r.has("compress_ratios");
  if (has_layer_types) {
    layers = layers_from_layer_types(r);
  } else if (has_ratio_list) {
    layers = LayerList{r.path("compress_ratios"), r.int_list("compress_ratios"), {}};
  } else {
    r.missing("compress_ratios", model_args ? "the per-layer compress ratios"
                                            : "the per-layer compress ratios (or layer_types)");
  }

  const bool has_sources = r.has(k.kv_sources) || r.has(k.index_sources) || r.has(k.candidate_source);
  const bool v41_ratios = std::any_of(layers.ratios.begin(), layers.ratios.end(), [](int x) { return x == 1 || x == 2; });
  if (has_layer_types && has_sources)
    fail("config: ", source, ": has both layer_types (V4.0) and ", k.kv_sources, "/", k.index_sources,
         " (V4.1); expected one family");
  c.family = (has_sources || v41_ratios) && !has_layer_types ? ModelFamily::v4_1 : ModelFamily::v4_0;
  const bool v41 = c.family == ModelFamily::v4_1;

  if (!v41 && !has_layer_types)
    layers.kinds = model_args ? v40_kinds_of_model_args(layers.ratios)
                              : v40_kinds_from_ratios(r, "compress_ratios", layers.ratios);
  if (has_layer_types && has_ratio_list) {
    // Both given: they must describe the same layers (a converted config may carry both).
    const std::vector<int> listed = r.int_list("compress_ratios");
    for (size_t i = 0; i < listed.size(); ++i) {
      const int expected = i < layers.ratios.size() ? layers.ratios[i] : 0;
      if (listed[i] != expected)
        r.invalid(r.path("compress_ratios") + "[" + std::to_string(i) + "]", listed[i],
                  "disagrees with layer_types, which gives rate " + std::to_string(expected));
    }
  }

  // Lists cover the backbone and may go on with the MTP layers, which are window-only.
  const int64_t listed = static_cast<int64_t>(layers.ratios.size());
  const int64_t total = static_cast<int64_t>(c.num_layers) + c.num_mtp_layers;
  if (listed < c.num_layers || listed > total)
    fail("config: ", source, ": field '", layers.field, "' = an array of ", listed, ": expected one entry per layer, ",
         c.num_layers, " (", k.num_layers, ") to ", total, " (", k.num_layers, " + ", k.num_mtp_layers, ")");
  for (int64_t i = c.num_layers; i < listed; ++i)
    if (layers.ratios[static_cast<size_t>(i)] != 0)
      r.invalid(layers.field + "[" + std::to_string(i) + "]", layers.ratios[static_cast<size_t>(i)],
                "entries past the " + std::to_string(c.num_layers) +
                    " backbone layers are MTP layers, which are window-only (0)");
  layers.ratios.resize(static_cast<size_t>(c.num_layers));
  if (!layers.kinds.empty()) layers.kinds.resize(static_cast<size_t>(c.num_layers));
  c.compress_ratios = std::move(layers.ratios);
  c.layer_kinds = std::move(layers.kinds);

  // Optional fields default to the family's released values (SPEC §1.1 / §1.2).
  const ModelConfig released = preset_config(v41 ? "v4.1-flash" : "v4-flash");
  c.hidden_size = r.required_integer<int64_t>(k.hidden_size, "the model width");
  c.num_heads = r.required_integer<int>(k.num_heads, "the number of query heads");
  c.head_dim = r.integer<int64_t>("head_dim", released.head_dim);
  c.rope_head_dim = r.integer<int64_t>(k.rope_head_dim, released.rope_head_dim);
  c.q_lora_rank = r.required_integer<int64_t>("q_lora_rank", "the query low-rank width");
  c.o_groups = r.required_integer<int>("o_groups", "the output projection's group count");
  c.o_lora_rank = r.required_integer<int64_t>("o_lora_rank", "the output projection's per-group rank");
  c.sliding_window = r.integer<int64_t>(k.sliding_window, released.sliding_window);
  if (!model_args && r.integer<int>("num_key_value_heads", 1) != 1)
    r.invalid(r.path("num_key_value_heads"), *r.find("num_key_value_heads"),
              "DeepSeek V4 attention has one shared K=V head (MQA)");

  if (v41) {
    const char* why = "V4.1 configs (compress ratios 1/2) name their kv and index sources";
    if (!r.has(k.kv_sources)) r.missing(k.kv_sources, why);
    if (!r.has(k.index_sources)) r.missing(k.index_sources, why);
    c.kv_source_layers = r.int_list(k.kv_sources);
    c.index_source_layers = r.int_list(k.index_sources);
    // No candidate source named: no candidate filtering (the released 20 would not fit other layouts).
    c.candidate_source_layer = r.integer<int>(k.candidate_source, -1);
    c.candidate_topk_blocks = r.integer<int64_t>("candidate_topk_blocks", released.candidate_topk_blocks);
    c.candidate_block_size = r.integer<int64_t>("candidate_block_size", released.candidate_block_size);
  }
  c.index_n_heads = r.integer<int>("index_n_heads", released.index_n_heads);
  c.index_head_dim = r.integer<int64_t>("index_head_dim", released.index_head_dim);
  c.index_topk = r.integer<int64_t>("index_topk", released.index_topk);
  c.rms_norm_eps = r.number(k.norm_eps, released.rms_norm_eps);
  // Image spans (SPEC §14.2): the transformers V4.1 file nests M beside text_config.
  const std::optional<FieldReader> vision = top.object("vision_config");
  c.vision_max_n_token = vision && vision->has("max_image_tokens")
                             ? vision->integer<int64_t>("max_image_tokens", 0)
                             : r.integer<int64_t>("vision_max_n_token", released.vision_max_n_token);
  if (r.integer<int64_t>("vision_n_layers", 1) == 0) c.vision_max_n_token = 0;
  // The official V4.0 code rotates and FP4-quantizes its indexer's q and k; transformers' does not.
  if (const json* qat = r.find("indexer_qat"); qat && v41)
    r.invalid(r.path("indexer_qat"), *qat, "selects the V4.0 indexer's Hadamard + FP4 path; a V4.1 config has none "
                                           "(its FP4 index quantization is always on in reference precision)");
  c.indexer_qat = r.boolean("indexer_qat", !v41 && model_args);
  // Same spelling in both forms. Without target layers the MTP layers are plain window layers (a
  // block size alone means nothing, as in ModelArgs dumps of models without DSpark).
  c.dspark_target_layer_ids = r.int_list("dspark_target_layer_ids");
  if (!c.dspark_target_layer_ids.empty()) {
    if (!r.has("dspark_block_size")) r.missing("dspark_block_size", "DSpark draft layers need their block size");
    c.dspark_block_size = r.integer<int64_t>("dspark_block_size", 0);
  }

  if (model_args) {
    read_model_args_rope(r, released, c);
    c.weight_quantization = read_model_args_dtype(r, released);
  } else {
    read_config_json_rope(r, released, c);
    // quantization_config sits beside text_config in the released V4.1 file.
    const FieldReader& quant_holder = r.has("quantization_config") ? r : top;
    if (auto quant = quant_holder.object("quantization_config")) c.weight_quantization = read_quantization_config(*quant);
  }

  validate_config(c);
  return c;
}

}  // namespace

ModelConfig parse_config_json(const std::string& text, const std::string& source) {
  check_nesting_depth(text, source);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail("config: ", source, ": not valid JSON: ", e.what());
  }
  try {
    return parse_root(root, source);
  } catch (const json::exception& e) {
    // Every access above is type-checked first; this only guards against a missed case.
    fail("config: ", source, ": unexpected JSON structure: ", e.what());
  }
}

ModelConfig load_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("config: cannot open config file '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("config: cannot read config file '", path, "'");
  return parse_config_json(text.str(), path);
}

ModelConfig config_from_preset_or_file(const std::string& preset, const std::string& file) {
  if (preset.empty() == file.empty())
    fail("config: expected exactly one of a preset (", preset.empty() ? "none" : "'" + preset + "'",
         ") and a config file (", file.empty() ? "none" : "'" + file + "'", ")");
  return preset.empty() ? load_config_file(file) : preset_config(preset);
}

}  // namespace dsv4

// Attention weights: the expected set per layer plan, checkpoint analysis (shared by load_weights
// and inspect_weights) and fp8 block dequantization.
#include "dsv4/weights.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <span>
#include <sstream>

#include "dsv4/numeric.h"
#include "weights/weight_names.h"

namespace dsv4 {

int64_t WeightTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

HostTensor WeightTensor::to_f32() const {
  DSV4_CHECK(data != nullptr || numel() == 0, "weights: tensor '", name, "' has no data");
  HostTensor out(DType::f32, shape);
  float* y = out.as<float>();
  const int64_t n = out.numel();
  switch (dtype) {
    case DType::f32:
      if (n > 0) std::memcpy(y, data, out.nbytes());
      return out;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) y[i] = bf16_bits_to_float(static_cast<const uint16_t*>(data)[i]);
      return out;
    case DType::e4m3: {
      DSV4_CHECK(shape.size() == 2 && block_out > 0 && block_in > 0 && scale_data != nullptr,
                 "weights: fp8 tensor '", name, "' ", shape_string(shape), " needs 2-D block scales and block sizes");
      const int64_t rows = shape[0], cols = shape[1];
      const std::vector<int64_t> want{(rows + block_out - 1) / block_out, (cols + block_in - 1) / block_in};
      DSV4_CHECK(scale_shape == want, "weights: fp8 tensor '", name, "' has scales of shape ", shape_string(scale_shape),
                 ", expected ", shape_string(want));
      DSV4_CHECK(scale_dtype == DType::ue8m0 || scale_dtype == DType::f32, "weights: fp8 tensor '", name,
                 "' has scales of dtype ", dtype_name(scale_dtype), ", expected F8_E8M0 or F32");
      const auto* codes = static_cast<const uint8_t*>(data);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t s = (r / block_out) * want[1] + c / block_in;
          const float scale = scale_dtype == DType::ue8m0 ? ue8m0_to_float(static_cast<const uint8_t*>(scale_data)[s])
                                                          : static_cast<const float*>(scale_data)[s];
          y[r * cols + c] = e4m3_to_float(codes[r * cols + c]) * scale;
        }
      }
      return out;
    }
    default:
      fail("weights: tensor '", name, "' has dtype ", dtype_name(dtype), "; only F32, BF16 and F8_E4M3 convert to F32");
  }
}

const WeightTensor& LayerWeights::get(WeightRole r) const {
  const auto& t = tensors[static_cast<int>(r)];
  DSV4_CHECK(t.has_value(), "weights: layer ", layer, " has no tensor '", weight_role_name(r), "'");
  return *t;
}

bool InspectReport::ok() const {
  return missing.empty() &&
         std::all_of(tensors.begin(), tensors.end(), [](const InspectedTensor& t) { return t.problem.empty(); });
}

std::vector<ExpectedWeight> expected_layer_weights(const ModelConfig& config, const LayerPlan& plan) {
  const int64_t hidden = config.hidden_size, head_dim = config.head_dim, q_lora = config.q_lora_rank;
  const int64_t heads = config.num_heads, groups = config.o_groups, o_lora = config.o_lora_rank;
  const int64_t index_heads = config.index_n_heads, index_dim = config.index_head_dim;
  DSV4_CHECK(groups > 0 && (heads * head_dim) % groups == 0, "weights: num_heads * head_dim = ", heads * head_dim,
             " is not divisible by o_groups = ", groups);
  std::vector<ExpectedWeight> w;
  const auto add = [&](WeightRole role, std::vector<int64_t> shape, bool fp8_allowed = false) {
    w.push_back({role, std::move(shape), fp8_allowed});
  };
  add(WeightRole::wq_a, {q_lora, hidden}, true);
  add(WeightRole::q_norm, {q_lora});
  add(WeightRole::wq_b, {heads * head_dim, q_lora}, true);
  add(WeightRole::wkv, {head_dim, hidden}, true);
  add(WeightRole::kv_norm, {head_dim});
  add(WeightRole::wo_a, {groups * o_lora, heads * head_dim / groups}, true);
  add(WeightRole::wo_b, {hidden, groups * o_lora}, true);
  add(WeightRole::attn_sink, {heads});

  const bool v40 = plan.kind == AttentionKind::csa || plan.kind == AttentionKind::hca;
  if (plan.owns_compressor) {
    // The V4.0 CSA compressor overlaps windows: two series of head_dim channels (SPEC §12).
    const int64_t width = plan.kind == AttentionKind::csa ? 2 * head_dim : head_dim;
    add(WeightRole::compressor_wkv, {width, hidden});
    // V4.1 ratio 1 projects each token on its own: no gate (SPEC §10).
    if (v40 || plan.compress_ratio != 1) add(WeightRole::compressor_wgate, {width, hidden});
    add(WeightRole::compressor_norm, {head_dim});
    if (v40) add(WeightRole::compressor_ape, {plan.compress_ratio, width});
  }
  if (plan.owns_indexer) {
    add(WeightRole::indexer_wq_b, {index_heads * index_dim, q_lora}, true);
    add(WeightRole::indexer_weights_proj, {index_heads, hidden});
  }
  if (plan.owns_index_keys && plan.kind == AttentionKind::csa) {
    // V4.0: the indexer compresses its own keys from the hidden states (overlapped, SPEC §12).
    add(WeightRole::indexer_compressor_wkv, {2 * index_dim, hidden});
    add(WeightRole::indexer_compressor_wgate, {2 * index_dim, hidden});
    add(WeightRole::indexer_compressor_norm, {index_dim});
    add(WeightRole::indexer_compressor_ape, {plan.compress_ratio, 2 * index_dim});
  } else if (plan.owns_index_keys) {
    // V4.1: index keys from the main compressor's latent (SPEC §4.1).
    add(WeightRole::indexer_wk, {index_dim, head_dim});
    add(WeightRole::indexer_k_norm, {index_dim});
  }
  if (plan.dspark_stage == 0) {
    // The draft model's entry (SPEC §13.1): main_x = main_norm(main_proj(main_hidden)), for every stage.
    add(WeightRole::main_proj, {hidden, config.dspark_main_width()}, true);
    add(WeightRole::main_norm, {hidden});
  }
  return w;
}

std::string describe_plan(const LayerPlan& plan) {
  std::ostringstream os;
  os << attention_kind_name(plan.kind);
  if (plan.compress_ratio > 0) os << ", ratio " << plan.compress_ratio;
  if (plan.kind == AttentionKind::dspark) os << " draft stage " << plan.dspark_stage;
  if (plan.is_mtp) os << ", MTP";
  if (plan.kind == AttentionKind::compressed) {
    if (plan.owns_compressor) os << ", kv source" << (plan.owns_index_keys ? " with index keys" : "");
    else os << ", reads layer " << plan.kv_source << "'s cache";
    if (plan.owns_indexer) os << ", index source" << (plan.uses_candidates ? " (candidate-filtered)" : "");
    else if (plan.index_source >= 0) os << ", reuses layer " << plan.index_source << "'s picks";
    if (plan.is_candidate_source) os << ", candidate source";
  }
  return os.str();
}

namespace {

struct Located {
  std::string name;
  std::shared_ptr<SafetensorsFile> file;
  const SafetensorsEntry* entry = nullptr;
};

struct Resolved {
  Located tensor;
  std::optional<Located> scale;
};

// A checkpoint checked against a topology: the report `dsv4 inspect` prints, the tensors to load,
// and one message per problem as load_weights throws them.
struct Analysis {
  InspectReport report;
  std::vector<std::array<std::optional<Resolved>, kNumWeightRoles>> layers;
  std::vector<std::string> errors;  // "layer 3 tensor '...' has shape [..], expected [..]"
};

std::string allowed_dtypes(bool fp8_allowed) {
  return fp8_allowed ? "BF16, F32 or F8_E4M3 with block scales" : "BF16 or F32";
}

// The problem of a fp8 tensor's scale tensor, empty when it fits the tensor's block layout.
std::string scale_problem(const SafetensorsEntry& scale, const std::vector<int64_t>& shape,
                          const WeightQuantization& q) {
  if (scale.dtype != DType::ue8m0 && scale.dtype != DType::f32)
    return std::string("has dtype ") + dtype_name(scale.dtype) + ", expected F8_E8M0 or F32 block scales";
  const std::vector<int64_t> want{(shape[0] + q.block_out - 1) / q.block_out, (shape[1] + q.block_in - 1) / q.block_in};
  if (scale.shape != want)
    return "has shape " + shape_string(scale.shape) + ", expected " + shape_string(want) + " (" +
           std::to_string(q.block_out) + "x" + std::to_string(q.block_in) + " blocks of " + shape_string(shape) + ")";
  return {};
}

struct Found {
  std::vector<Located> tensors, scales;
};

InspectedTensor inspected_row(const Located& t, std::string role, int layer, std::string problem = {}) {
  return InspectedTensor{t.name, std::move(role), layer, dtype_name(t.entry->dtype), t.entry->shape, std::move(problem)};
}

// Checks what the checkpoint holds for one role of one layer against what the plan expects:
// appends the rows and problems to `a`, and resolves the role when everything fits.
void check_role(int layer, WeightRole role, const LayerPlan& plan, const std::optional<ExpectedWeight>& expected,
                const Found& f, weight_names::Style style, const ModelConfig& config, Analysis& a) {
  std::vector<InspectedTensor> rows;
  for (const Located& t : f.tensors) rows.push_back(inspected_row(t, weight_role_name(role), layer));
  for (const Located& s : f.scales) rows.push_back(inspected_row(s, weight_names::scale_role_name(role), layer));
  const auto tensor_rows = std::span(rows).first(f.tensors.size());
  const auto scale_rows = std::span(rows).subspan(f.tensors.size());
  // Each row reports its first problem.
  const auto flag = [&](InspectedTensor& t, const std::string& problem) {
    if (!t.problem.empty()) return;
    t.problem = problem;
    a.errors.push_back("layer " + std::to_string(layer) + " tensor '" + t.checkpoint_name + "' " + problem);
  };

  if (f.tensors.empty()) {
    if (expected) {
      const std::string name = weight_names::name_of(layer, role, style);
      a.report.missing.push_back(name);
      a.errors.push_back("layer " + std::to_string(layer) + " has no tensor '" + name + "' (" +
                         weight_role_name(role) + ", expected shape " + shape_string(expected->shape) + ")");
    }
    for (InspectedTensor& s : scale_rows)
      flag(s, "holds block scales of '" + weight_names::name_of(layer, role, style) + "', which the checkpoint lacks");
  } else if (f.tensors.size() > 1) {
    for (size_t i = 0; i < f.tensors.size(); ++i)
      flag(tensor_rows[i], "stores " + std::string(weight_role_name(role)) + ", as does '" +
                               f.tensors[i == 0 ? 1 : 0].name + "'");
  } else if (!expected) {
    flag(tensor_rows[0], "is not used by layer " + std::to_string(layer) + " (" + describe_plan(plan) + ")");
  } else {
    const SafetensorsEntry& e = *f.tensors[0].entry;
    const bool fp8 = e.dtype == DType::e4m3;
    if (e.shape != expected->shape) {
      flag(tensor_rows[0], "has shape " + shape_string(e.shape) + ", expected " + shape_string(expected->shape));
    } else if (!(e.dtype == DType::bf16 || e.dtype == DType::f32 || (fp8 && expected->fp8_allowed))) {
      flag(tensor_rows[0], std::string("has dtype ") + dtype_name(e.dtype) + ", expected " +
                               allowed_dtypes(expected->fp8_allowed));
    } else if (fp8 && !config.weight_quantization) {
      flag(tensor_rows[0], "is F8_E4M3, but the config has no weight quantization (quantization_config) to give "
                           "its block size");
    } else if (fp8 && f.scales.empty()) {
      flag(tensor_rows[0], "is F8_E4M3 without block scales '" + weight_names::name_of(layer, role, style, true) + "'");
    } else if (fp8 && f.scales.size() > 1) {
      flag(tensor_rows[0], "has two block scale tensors, '" + f.scales[0].name + "' and '" + f.scales[1].name + "'");
    }
    for (size_t i = 0; i < f.scales.size(); ++i) {
      if (!fp8) {
        flag(scale_rows[i], "holds block scales, but '" + f.tensors[0].name + "' is " + dtype_name(e.dtype) +
                                ", not F8_E4M3");
      } else if (config.weight_quantization && e.shape == expected->shape) {
        const std::string problem = scale_problem(*f.scales[i].entry, e.shape, *config.weight_quantization);
        if (!problem.empty()) flag(scale_rows[i], problem);
      }
    }
    if (std::all_of(rows.begin(), rows.end(), [](const InspectedTensor& t) { return t.problem.empty(); }))
      a.layers[static_cast<size_t>(layer)][static_cast<int>(role)] =
          Resolved{f.tensors[0], fp8 ? std::optional<Located>(f.scales[0]) : std::nullopt};
  }
  a.report.tensors.insert(a.report.tensors.end(), rows.begin(), rows.end());
}

Analysis analyze(const Checkpoint& ckpt, const ModelConfig& config, const ModelTopology& topology, LayerSet set) {
  Analysis a;
  const int num_layers = topology.size();
  a.layers.resize(static_cast<size_t>(num_layers));

  std::map<const SafetensorsFile*, std::shared_ptr<SafetensorsFile>> owner_of;
  for (const auto& f : ckpt.files()) owner_of[f.get()] = f;

  // Sort the checkpoint's attention tensors by layer and role.
  std::vector<std::array<Found, kNumWeightRoles>> found(static_cast<size_t>(num_layers));
  std::vector<InspectedTensor> beyond;  // attention tensors of layers the config does not have
  weight_names::Style style;            // how the checkpoint spells names, for the missing ones
  for (const std::string& name : ckpt.names()) {
    const auto parsed = weight_names::parse(name, config);
    if (!parsed) {
      a.report.unexpected.push_back(name);
      continue;
    }
    if (parsed->style.scheme == weight_names::Scheme::transformers) style.scheme = parsed->style.scheme;
    style.model_prefix = style.model_prefix || parsed->style.model_prefix;
    style.mtp_base = std::max(style.mtp_base, parsed->style.mtp_base);
    const auto [file, entry] = ckpt.find(name);
    const Located t{name, owner_of.at(file), entry};
    if (parsed->layer >= num_layers) {
      const std::string role = parsed->is_scale ? weight_names::scale_role_name(parsed->role)
                                                : weight_role_name(parsed->role);
      std::ostringstream problem;
      problem << "belongs to layer " << parsed->layer << ", but the config has " << num_layers << " layers ("
              << config.num_layers << " + " << config.num_mtp_layers << " MTP)";
      beyond.push_back(inspected_row(t, role, parsed->layer, problem.str()));
      continue;
    }
    Found& f = found[static_cast<size_t>(parsed->layer)][static_cast<int>(parsed->role)];
    (parsed->is_scale ? f.scales : f.tensors).push_back(t);
  }

  for (int l = 0; l < num_layers; ++l) {
    const LayerPlan& plan = topology[l];
    if (!layer_in_set(plan, set)) continue;
    std::array<std::optional<ExpectedWeight>, kNumWeightRoles> expected;
    for (ExpectedWeight& e : expected_layer_weights(config, plan)) expected[static_cast<int>(e.role)] = std::move(e);
    const auto& layer_found = found[static_cast<size_t>(l)];
    // A drafter's draft layers are what it loads: never optional there.
    if (plan.is_mtp && set == LayerSet::all && std::all_of(layer_found.begin(), layer_found.end(),
                                   [](const Found& f) { return f.tensors.empty() && f.scales.empty(); })) {
      a.report.absent_mtp_layers.push_back(l);
      continue;
    }
    for (int r = 0; r < kNumWeightRoles; ++r)
      check_role(l, static_cast<WeightRole>(r), plan, expected[r], layer_found[r], style, config, a);
  }
  for (InspectedTensor& t : beyond) {
    a.errors.push_back("layer " + std::to_string(t.layer) + " tensor '" + t.checkpoint_name + "' " + t.problem);
    a.report.tensors.push_back(std::move(t));
  }
  return a;
}

// The bytes of a tensor in the mapping, or an aligned copy when the file places them at an
// address that is not a multiple of the element size.
const void* aligned_data(const Located& t, std::vector<std::shared_ptr<const void>>& keep) {
  const std::byte* p = t.file->data(*t.entry);
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(t.entry->dtype) == 0) return p;
  auto copy = std::make_shared<HostTensor>(t.file->read(t.name));
  keep.push_back(copy);
  return copy->data();
}

WeightTensor make_weight(const Resolved& r, const ModelConfig& config) {
  auto keep = std::make_shared<std::vector<std::shared_ptr<const void>>>();
  keep->push_back(r.tensor.file);
  WeightTensor w;
  w.name = r.tensor.name;
  w.dtype = r.tensor.entry->dtype;
  w.shape = r.tensor.entry->shape;
  w.data = aligned_data(r.tensor, *keep);
  if (r.scale) {
    keep->push_back(r.scale->file);
    w.scale_dtype = r.scale->entry->dtype;
    w.scale_shape = r.scale->entry->shape;
    w.scale_data = aligned_data(*r.scale, *keep);
    w.block_out = config.weight_quantization->block_out;
    w.block_in = config.weight_quantization->block_in;
  }
  w.owner = keep;
  return w;
}

}  // namespace

ModelWeights load_weights(const std::string& path, const ModelConfig& config, const ModelTopology& topology,
                          LayerSet layers) {
  DSV4_CHECK(topology.size() == config.total_layers(), "weights: topology has ", topology.size(),
             " layers, the config ", config.total_layers());
  DSV4_CHECK(layers == LayerSet::all || config.has_dspark(), "weights: the layer set '", layer_set_name(layers),
             "' holds the DSpark draft layers, but config ", config.name, " has none (no dspark_target_layer_ids)");
  const Checkpoint ckpt = Checkpoint::open(path);
  const Analysis a = analyze(ckpt, config, topology, layers);
  if (!a.errors.empty()) {
    if (a.errors.size() == 1) fail("weights: ", a.errors[0]);
    fail("weights: ", a.errors[0], " (and ", a.errors.size() - 1, a.errors.size() == 2 ? " more problem" : " more problems",
         "; `dsv4 inspect` lists them)");
  }
  ModelWeights weights;
  weights.layers.resize(static_cast<size_t>(topology.size()));
  for (int l = 0; l < topology.size(); ++l) {
    LayerWeights& lw = weights.layers[static_cast<size_t>(l)];
    lw.layer = l;
    for (int r = 0; r < kNumWeightRoles; ++r)
      if (const auto& resolved = a.layers[static_cast<size_t>(l)][r]) lw.tensors[r] = make_weight(*resolved, config);
  }
  weights.owners.assign(ckpt.files().begin(), ckpt.files().end());
  return weights;
}

InspectReport inspect_weights(const std::string& path, const ModelConfig& config) {
  const ModelTopology topology = resolve_topology(config);
  return analyze(Checkpoint::open(path), config, topology, LayerSet::all).report;
}

}  // namespace dsv4

// Checkpoint names of attention tensors: DeepSeek native (`layers.{l}.attn.wq_a.weight`) and
// transformers deepseek_v4 (`layers.{l}.self_attn.q_a_proj.weight`), both optionally under
// `model.`; fp8 block scales as `<name without .weight>.scale` or `.weight_scale_inv`.
#pragma once

#include <optional>
#include <string>

#include "dsv4/config.h"
#include "dsv4/weights.h"

namespace dsv4::weight_names {

enum class Scheme : uint8_t { native, transformers };

// How a checkpoint spells its names, so that names it lacks are reported in its own style.
struct Style {
  Scheme scheme = Scheme::native;
  bool model_prefix = false;
  // >= 0 when MTP layers are spelled `mtp.{j}` (layer mtp_base + j, mtp_base = num_layers).
  int mtp_base = -1;
};

struct Parsed {
  int layer = 0;
  WeightRole role = WeightRole::wq_a;
  bool is_scale = false;   // the role's fp8 block scales rather than the tensor itself
  Style style;
};

// nullopt for anything that is not an attention tensor (attn_norm, MoE, embeddings, ...).
// Layers are `layers.{l}` or, for MTP layers, also `mtp.{j}` (= layer num_layers + j).
std::optional<Parsed> parse(const std::string& name, const ModelConfig& config);

// The checkpoint name of a role (or of its scales, native `.scale` / transformers
// `.weight_scale_inv`) in the given style. V4.1-only roles have no transformers name and are
// spelled natively.
std::string name_of(int layer, WeightRole role, Style style, bool scale = false);

// Native name of a role's scales without the layer prefix, e.g. "attn.wq_a.scale".
std::string scale_role_name(WeightRole role);

}  // namespace dsv4::weight_names

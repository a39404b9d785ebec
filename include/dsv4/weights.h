// Attention weights of a model: name mapping (transformers and DeepSeek native names), fp8 block
// scales, shape checks against the resolved topology, random weights and a checkpoint writer.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/safetensors.h"
#include "dsv4/tensor.h"

namespace dsv4 {

// Every attention tensor a layer may have. Names are DeepSeek's native ones (weight_role_name).
enum class WeightRole : uint8_t {
  wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink,
  compressor_wkv, compressor_wgate, compressor_norm, compressor_ape,
  indexer_wq_b, indexer_weights_proj, indexer_wk, indexer_k_norm,
  // V4.0 CSA: the indexer's own compressor
  indexer_compressor_wkv, indexer_compressor_wgate, indexer_compressor_norm, indexer_compressor_ape,
  // DSpark stage 0: the projection of the target model's hidden states to the draft width, and its norm
  main_proj, main_norm,
  count
};
inline constexpr int kNumWeightRoles = static_cast<int>(WeightRole::count);
// Native name without the layer prefix, e.g. "attn.wq_a.weight", "attn.attn_sink".
const char* weight_role_name(WeightRole r);

// A weight as stored: dtype bf16 / f32 / e4m3 (then with block scales).
struct WeightTensor {
  std::string name;                      // name in the checkpoint
  DType dtype = DType::bf16;
  std::vector<int64_t> shape;            // [out, in] for projections
  const void* data = nullptr;            // host memory kept alive by `owner`
  // fp8 only: [ceil(out/block_out), ceil(in/block_in)] ue8m0 bytes or f32.
  DType scale_dtype = DType::f32;
  std::vector<int64_t> scale_shape;
  const void* scale_data = nullptr;
  int block_out = 0, block_in = 0;
  std::shared_ptr<const void> owner;

  bool is_fp8() const { return dtype == DType::e4m3; }
  int64_t numel() const;
  // fp32 copy, fp8 dequantized with its block scales (exact).
  HostTensor to_f32() const;
};

struct LayerWeights {
  int layer = 0;
  std::array<std::optional<WeightTensor>, kNumWeightRoles> tensors;
  bool has(WeightRole r) const { return tensors[static_cast<int>(r)].has_value(); }
  // Throws "dsv4: weights: layer L has no tensor 'attn.indexer.wk.weight'".
  const WeightTensor& get(WeightRole r) const;
};

struct ModelWeights {
  std::vector<LayerWeights> layers;      // total_layers() entries
  std::vector<std::shared_ptr<const void>> owners;
};

// The tensors a layer must have, with their shapes, for the given plan.
struct ExpectedWeight {
  WeightRole role;
  std::vector<int64_t> shape;
  bool fp8_allowed;                      // may be stored as e4m3 + block scales
};
std::vector<ExpectedWeight> expected_layer_weights(const ModelConfig& config, const LayerPlan& plan);

// A layer's role in words, as messages and `dsv4 inspect` print it, e.g.
// "compressed, ratio 2, kv source with index keys, index source".
std::string describe_plan(const LayerPlan& plan);

// Loads and checks every attention tensor (shape, dtype, scales). `path`: a .safetensors file, a
// sharded checkpoint's index JSON or a directory. Names may be DeepSeek native or transformers
// deepseek_v4 ones (docs/weights.md); other tensors are ignored. Tensors stay in the file mapping
// (copied only when misaligned for their dtype). Errors name layer, tensor, shape and expectation;
// an MTP layer absent from the checkpoint as a whole is left empty. With LayerSet::draft only the
// DSpark draft layers are loaded (and required); the backbone's tensors are ignored and its layers left empty.
ModelWeights load_weights(const std::string& path, const ModelConfig& config, const ModelTopology& topology,
                          LayerSet layers = LayerSet::all);

// What `dsv4 inspect` prints: per layer, found / missing / unexpected tensors.
struct InspectedTensor {
  std::string checkpoint_name;
  std::string role;                      // native name, empty when not recognized
  int layer = -1;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string problem;                   // empty when the tensor is as expected
};
struct InspectReport {
  std::vector<InspectedTensor> tensors;
  std::vector<std::string> missing;      // "layers.3.attn.indexer.wk.weight"
  std::vector<std::string> unexpected;   // checkpoint names not recognized as attention tensors
  // MTP layers of which the checkpoint holds no tensor at all. They are optional (transformers
  // checkpoints leave the draft layers out): load_weights leaves them empty.
  std::vector<int> absent_mtp_layers;
  // True when nothing is missing and every recognized tensor is as expected (tensors that are not
  // attention tensors do not count).
  bool ok() const;
};
InspectReport inspect_weights(const std::string& path, const ModelConfig& config);

// Deterministic random weights for any config (so the tool runs without a checkpoint): bf16, fp32
// sinks, the fp8-capable projections as e4m3 + block scales when `fp8` and the config has a weight
// quantization. Projections ~ N(0, 1/in), norms 1 ± 0.1, sinks and position biases ~ N(0, 0.01),
// so activations stay of order one. Values depend on (seed, layer, role, row) only, not on the
// thread count or on `fp8`.
ModelWeights random_weights(const ModelConfig& config, const ModelTopology& topology, uint64_t seed, bool fp8);

// Writes the weights with native names (`layers.{l}.attn.*`), fp8 scales as `*.scale`.
void save_weights(const ModelWeights& weights, const std::string& path);

}  // namespace dsv4

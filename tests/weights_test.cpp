// Attention weights: golden checkpoints under both naming schemes, the expected shapes of the
// released configs, load errors, fp8 block dequantization, random weights and their round trip,
// and `dsv4 inspect`.
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "dsv4/config.h"
#include "dsv4/safetensors.h"
#include "dsv4/weights.h"
#include "test_util.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

using test::kGolden;


using test::error_of;

// Every tensor of a checkpoint, by name, so that tests can edit and rewrite it.
std::map<std::string, HostTensor> read_all(const std::string& path) {
  const Checkpoint ckpt = Checkpoint::open(path);
  std::map<std::string, HostTensor> out;
  for (const std::string& name : ckpt.names()) out[name] = ckpt.find(name).first->read(name);
  return out;
}

void write_all(const std::map<std::string, HostTensor>& tensors, const std::string& path) {
  SafetensorsWriter w;
  for (const auto& [name, t] : tensors) w.add(name, t);
  w.write(path);
}

bool same_bytes(const WeightTensor& a, const WeightTensor& b) {
  const size_t n = static_cast<size_t>(a.numel()) * dtype_size(a.dtype);
  if (a.dtype != b.dtype || a.shape != b.shape || std::memcmp(a.data, b.data, n) != 0) return false;
  if (a.is_fp8() != b.is_fp8()) return false;
  if (!a.is_fp8()) return true;
  int64_t scales = 1;
  for (int64_t d : a.scale_shape) scales *= d;
  return a.scale_dtype == b.scale_dtype && a.scale_shape == b.scale_shape && a.block_out == b.block_out &&
         a.block_in == b.block_in &&
         std::memcmp(a.scale_data, b.scale_data, static_cast<size_t>(scales) * dtype_size(a.scale_dtype)) == 0;
}

// Independent decoders: e4m3fn by its definition, a ue8m0 byte as 2^(b - 127).
float decode_e4m3(uint8_t code) {
  const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
  const float magnitude =
      exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}
float decode_ue8m0(uint8_t byte) { return std::ldexp(1.0f, byte - 127); }

ModelConfig golden_config(const std::string& set) { return load_config_file(kGolden + set + ".config.json"); }

// ---------------------------------------------------------------------------------------------
// Golden checkpoints.

TEST(Weights, GoldenV40TransformersNamesLoad) {
  const ModelConfig config = golden_config("v40a");
  const ModelTopology topology = resolve_topology(config);
  const std::string path = kGolden + "v40a.weights.safetensors";
  const ModelWeights weights = load_weights(path, config, topology);
  ASSERT_EQ(weights.layers.size(), static_cast<size_t>(config.total_layers()));

  // Every checkpoint tensor became exactly one loaded weight, with the file's values.
  const Checkpoint ckpt = Checkpoint::open(path);
  std::set<std::string> loaded;
  for (const LayerWeights& lw : weights.layers) {
    for (const auto& t : lw.tensors) {
      if (!t) continue;
      EXPECT_TRUE(loaded.insert(t->name).second) << t->name;
      const auto [file, entry] = ckpt.find(t->name);
      EXPECT_EQ(t->shape, entry->shape) << t->name;
      const HostTensor want = file->read_as(t->name, DType::f32), got = t->to_f32();
      ASSERT_EQ(want.nbytes(), got.nbytes()) << t->name;
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.nbytes()), 0) << t->name;
    }
  }
  EXPECT_EQ(loaded.size(), ckpt.names().size());

  const LayerWeights& csa = weights.layers[1];
  EXPECT_EQ(csa.get(WeightRole::wq_a).name, "layers.1.self_attn.q_a_proj.weight");
  EXPECT_EQ(csa.get(WeightRole::compressor_ape).shape, (std::vector<int64_t>{4, 1024}));
  EXPECT_EQ(csa.get(WeightRole::indexer_compressor_ape).name, "layers.1.self_attn.compressor.indexer.position_bias");
  EXPECT_EQ(csa.get(WeightRole::indexer_weights_proj).shape, (std::vector<int64_t>{4, 256}));
  EXPECT_FALSE(csa.has(WeightRole::indexer_wk));
  EXPECT_EQ(weights.layers[2].get(WeightRole::compressor_ape).shape, (std::vector<int64_t>{16, 512}));
  EXPECT_FALSE(weights.layers[2].has(WeightRole::indexer_wq_b));
  EXPECT_FALSE(weights.layers[0].has(WeightRole::compressor_wkv));
  // The config's MTP layer is not in a transformers checkpoint: left empty, and asking says so.
  ASSERT_EQ(config.num_mtp_layers, 1);
  EXPECT_EQ(std::count_if(weights.layers[3].tensors.begin(), weights.layers[3].tensors.end(),
                          [](const auto& t) { return t.has_value(); }),
            0);
  EXPECT_EQ(error_of([&] { weights.layers[3].get(WeightRole::wq_a); }),
            "dsv4: weights: layer 3 has no tensor 'attn.wq_a.weight'");

  const InspectReport report = inspect_weights(path, config);
  EXPECT_TRUE(report.ok());
  EXPECT_EQ(report.tensors.size(), 38u);
  EXPECT_TRUE(report.unexpected.empty());
  EXPECT_TRUE(report.missing.empty());
  EXPECT_EQ(report.absent_mtp_layers, std::vector<int>{3});
}

TEST(Weights, GoldenV41ShardedNativeNamesLoad) {
  const ModelConfig config = golden_config("v41a");
  const ModelTopology topology = resolve_topology(config);
  const ModelWeights weights = load_weights(kGolden + "v41a.weights.index.json", config, topology);
  ASSERT_EQ(weights.layers.size(), 6u);
  const auto count = [](const LayerWeights& lw) {
    return std::count_if(lw.tensors.begin(), lw.tensors.end(), [](const auto& t) { return t.has_value(); });
  };
  // 8 per layer; kv sources add compressor (+gate at ratio 2) and wk/k_norm, index sources wq_b/weights_proj.
  EXPECT_EQ(count(weights.layers[0]), 8);
  EXPECT_EQ(count(weights.layers[1]), 8 + 3 + 2 + 2);
  EXPECT_EQ(count(weights.layers[2]), 8);
  EXPECT_EQ(count(weights.layers[3]), 8 + 2 + 2 + 2);
  EXPECT_EQ(count(weights.layers[4]), 8 + 2);
  EXPECT_EQ(count(weights.layers[5]), 8);
  EXPECT_EQ(weights.layers[1].get(WeightRole::compressor_wgate).dtype, DType::f32);
  EXPECT_EQ(weights.layers[3].get(WeightRole::indexer_wk).shape, (std::vector<int64_t>{128, 512}));
  EXPECT_EQ(weights.layers[4].get(WeightRole::indexer_wq_b).name, "layers.4.attn.indexer.wq_b.weight");

  const InspectReport report = inspect_weights(kGolden + "v41a.weights.index.json", config);
  EXPECT_TRUE(report.ok());
  EXPECT_EQ(report.tensors.size(), 8u * 6 + 7 + 6 + 2);
  // attn_norm belongs to the block, not the attention.
  EXPECT_EQ(report.unexpected.size(), 6u);
  for (const std::string& name : report.unexpected) EXPECT_NE(name.find("attn_norm"), std::string::npos) << name;
}

// ---------------------------------------------------------------------------------------------
// Expected shapes, against SPEC §1.1 / §1.2 / §2.1 for the released configs.

std::map<WeightRole, std::vector<int64_t>> expected_shapes(const ModelConfig& config, int layer) {
  std::map<WeightRole, std::vector<int64_t>> out;
  for (const ExpectedWeight& e : expected_layer_weights(config, resolve_topology(config)[layer])) out[e.role] = e.shape;
  return out;
}

TEST(Weights, ExpectedShapesOfV41Flash) {
  const ModelConfig c = preset_config("v4.1-flash");
  using S = std::vector<int64_t>;
  const auto window = expected_shapes(c, 0);
  EXPECT_EQ(window.size(), 8u);
  EXPECT_EQ(window.at(WeightRole::wq_a), (S{1280, 5120}));
  EXPECT_EQ(window.at(WeightRole::wq_b), (S{32768, 1280}));
  EXPECT_EQ(window.at(WeightRole::wkv), (S{512, 5120}));
  EXPECT_EQ(window.at(WeightRole::wo_a), (S{8192, 4096}));
  EXPECT_EQ(window.at(WeightRole::wo_b), (S{5120, 8192}));
  EXPECT_EQ(window.at(WeightRole::attn_sink), (S{64}));
  const auto kv2 = expected_shapes(c, 2);  // ratio 2 kv source and index source
  EXPECT_EQ(kv2.at(WeightRole::compressor_wkv), (S{512, 5120}));
  EXPECT_EQ(kv2.at(WeightRole::compressor_wgate), (S{512, 5120}));
  EXPECT_EQ(kv2.at(WeightRole::indexer_wq_b), (S{4096, 1280}));
  EXPECT_EQ(kv2.at(WeightRole::indexer_weights_proj), (S{32, 5120}));
  EXPECT_EQ(kv2.at(WeightRole::indexer_wk), (S{128, 512}));
  EXPECT_EQ(kv2.at(WeightRole::indexer_k_norm), (S{128}));
  EXPECT_EQ(kv2.count(WeightRole::compressor_ape), 0u);
  EXPECT_EQ(expected_shapes(c, 3).size(), 8u);                       // consumer of layer 2
  EXPECT_EQ(expected_shapes(c, 20).count(WeightRole::compressor_wgate), 0u);  // ratio 1: no gate
  EXPECT_EQ(expected_shapes(c, 20).size(), 8u + 2 + 2 + 2);
  const auto idx24 = expected_shapes(c, 24);  // index source reading layer 20's keys
  EXPECT_EQ(idx24.size(), 10u);
  EXPECT_EQ(idx24.count(WeightRole::indexer_wk), 0u);
  EXPECT_EQ(expected_shapes(c, 41).size(), 8u);  // DSpark stage 1
  const auto stage0 = expected_shapes(c, 40);    // DSpark stage 0: also the draft model's entry
  EXPECT_EQ(stage0.size(), 10u);
  EXPECT_EQ(stage0.at(WeightRole::main_proj), (S{5120, 3 * 5120}));
  EXPECT_EQ(stage0.at(WeightRole::main_norm), (S{5120}));
  // Projections may be fp8, norms and sinks and the compressor/indexer bf16 ones may not.
  for (const ExpectedWeight& e : expected_layer_weights(c, resolve_topology(c)[2])) {
    const bool fp8 = e.role == WeightRole::wq_a || e.role == WeightRole::wq_b || e.role == WeightRole::wkv ||
                     e.role == WeightRole::wo_a || e.role == WeightRole::wo_b || e.role == WeightRole::indexer_wq_b;
    EXPECT_EQ(e.fp8_allowed, fp8) << weight_role_name(e.role);
  }
}

TEST(Weights, ExpectedShapesOfV4FlashAndPro) {
  using S = std::vector<int64_t>;
  const ModelConfig flash = preset_config("v4-flash");
  const auto csa = expected_shapes(flash, 2);
  EXPECT_EQ(csa.at(WeightRole::wq_a), (S{1024, 4096}));
  EXPECT_EQ(csa.at(WeightRole::compressor_wkv), (S{1024, 4096}));
  EXPECT_EQ(csa.at(WeightRole::compressor_ape), (S{4, 1024}));
  EXPECT_EQ(csa.at(WeightRole::compressor_norm), (S{512}));
  EXPECT_EQ(csa.at(WeightRole::indexer_compressor_wkv), (S{256, 4096}));
  EXPECT_EQ(csa.at(WeightRole::indexer_compressor_ape), (S{4, 256}));
  EXPECT_EQ(csa.at(WeightRole::indexer_compressor_norm), (S{128}));
  EXPECT_EQ(csa.at(WeightRole::indexer_wq_b), (S{8192, 1024}));
  EXPECT_EQ(csa.at(WeightRole::indexer_weights_proj), (S{64, 4096}));
  EXPECT_EQ(csa.count(WeightRole::indexer_wk), 0u);
  const auto hca = expected_shapes(flash, 3);
  EXPECT_EQ(hca.at(WeightRole::compressor_wgate), (S{512, 4096}));
  EXPECT_EQ(hca.at(WeightRole::compressor_ape), (S{128, 512}));
  EXPECT_EQ(hca.count(WeightRole::indexer_wq_b), 0u);
  const ModelConfig pro = preset_config("v4-pro");
  const auto pro0 = expected_shapes(pro, 0);  // HCA in V4-Pro
  EXPECT_EQ(pro0.at(WeightRole::wo_a), (S{16 * 1024, 128 * 512 / 16}));
  EXPECT_EQ(pro0.at(WeightRole::wq_b), (S{128 * 512, 1536}));
  EXPECT_EQ(pro0.at(WeightRole::compressor_ape), (S{128, 512}));
}

// ---------------------------------------------------------------------------------------------
// Load errors.

// Each test edits a valid checkpoint for the v41a config (random weights, written once).
class WeightsErrors : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const ModelConfig config = golden_config("v41a");
    TempDir dir;
    save_weights(random_weights(config, resolve_topology(config), 11, false), dir.file("good.safetensors"));
    good_ = new std::map<std::string, HostTensor>(read_all(dir.file("good.safetensors")));
  }
  static void TearDownTestSuite() { delete good_; }
  void SetUp() override {
    config_ = golden_config("v41a");
    topology_ = resolve_topology(config_);
    tensors_ = *good_;
  }
  // Writes the edited tensors and returns load_weights' error message.
  void write_checkpoint() { write_all(tensors_, dir_.file("bad.safetensors")); }
  std::string load_error() {
    write_checkpoint();
    return error_of([&] { load_weights(dir_.file("bad.safetensors"), config_, topology_); });
  }
  InspectReport inspect() { return inspect_weights(dir_.file("bad.safetensors"), config_); }

  static inline std::map<std::string, HostTensor>* good_ = nullptr;
  TempDir dir_;
  ModelConfig config_;
  ModelTopology topology_;
  std::map<std::string, HostTensor> tensors_;
};

TEST_F(WeightsErrors, TheUneditedCheckpointLoads) {
  write_all(tensors_, dir_.file("bad.safetensors"));
  EXPECT_NO_THROW(load_weights(dir_.file("bad.safetensors"), config_, topology_));
  EXPECT_TRUE(inspect().ok());
}

TEST_F(WeightsErrors, MissingTensor) {
  tensors_.erase("layers.3.attn.indexer.wk.weight");
  EXPECT_EQ(load_error(), "dsv4: weights: layer 3 has no tensor 'layers.3.attn.indexer.wk.weight' "
                          "(attn.indexer.wk.weight, expected shape [128, 512])");
  const InspectReport r = inspect();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.missing, std::vector<std::string>{"layers.3.attn.indexer.wk.weight"});
}

TEST_F(WeightsErrors, WrongShape) {
  tensors_["layers.3.attn.wkv.weight"] = HostTensor(DType::bf16, {512, 255});
  EXPECT_EQ(load_error(),
            "dsv4: weights: layer 3 tensor 'layers.3.attn.wkv.weight' has shape [512, 255], expected [512, 256]");
}

TEST_F(WeightsErrors, SeveralProblemsReportTheFirstAndACount) {
  tensors_["layers.0.attn.wq_a.weight"] = HostTensor(DType::bf16, {128, 2});
  tensors_["layers.5.attn.wo_b.weight"] = HostTensor(DType::bf16, {2, 128});
  tensors_.erase("layers.5.attn.kv_norm.weight");
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.weight' has shape [128, 2], expected "
                          "[128, 256] (and 2 more problems; `dsv4 inspect` lists them)");
  const InspectReport r = inspect();
  EXPECT_EQ(r.missing.size(), 1u);
  EXPECT_EQ(std::count_if(r.tensors.begin(), r.tensors.end(), [](const auto& t) { return !t.problem.empty(); }), 2);
}

TEST_F(WeightsErrors, WrongDtype) {
  tensors_["layers.2.attn.kv_norm.weight"] = HostTensor(DType::f16, {512});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 2 tensor 'layers.2.attn.kv_norm.weight' has dtype F16, expected BF16 "
                          "or F32");
  // fp8 where the tensor may not be fp8.
  tensors_["layers.2.attn.kv_norm.weight"] = HostTensor(DType::bf16, {512});
  tensors_["layers.1.attn.indexer.weights_proj.weight"] = HostTensor(DType::e4m3, {4, 256});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 1 tensor 'layers.1.attn.indexer.weights_proj.weight' has dtype "
                          "F8_E4M3, expected BF16 or F32");
}

TEST_F(WeightsErrors, TensorTheLayerPlanDoesNotUse) {
  tensors_["layers.2.attn.indexer.wk.weight"] = HostTensor(DType::bf16, {128, 512});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 2 tensor 'layers.2.attn.indexer.wk.weight' is not used by layer 2 "
                          "(compressed, ratio 2, reads layer 1's cache, reuses layer 1's picks)");
}

TEST_F(WeightsErrors, TensorOfALayerBeyondTheConfig) {
  tensors_["layers.6.attn.wq_a.weight"] = HostTensor(DType::bf16, {128, 256});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 6 tensor 'layers.6.attn.wq_a.weight' belongs to layer 6, but the "
                          "config has 6 layers (6 + 0 MTP)");
}

TEST_F(WeightsErrors, SameRoleUnderTwoNames) {
  tensors_["model.layers.0.attn.wq_a.weight"] = tensors_["layers.0.attn.wq_a.weight"];
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.weight' stores attn.wq_a.weight, as "
                          "does 'model.layers.0.attn.wq_a.weight' (and 1 more problem; `dsv4 inspect` lists them)");
}

TEST_F(WeightsErrors, ScalesOfANonFp8Tensor) {
  tensors_["layers.0.attn.wq_a.scale"] = HostTensor(DType::ue8m0, {1, 2});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.scale' holds block scales, but "
                          "'layers.0.attn.wq_a.weight' is BF16, not F8_E4M3");
}

TEST_F(WeightsErrors, Fp8WithoutAQuantizationConfig) {
  tensors_["layers.0.attn.wq_a.weight"] = HostTensor(DType::e4m3, {128, 256});
  tensors_["layers.0.attn.wq_a.scale"] = HostTensor(DType::ue8m0, {1, 2});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.weight' is F8_E4M3, but the config has "
                          "no weight quantization (quantization_config) to give its block size");
}

TEST_F(WeightsErrors, Fp8ScalesMissingOrMisshaped) {
  config_.weight_quantization = WeightQuantization{.block_out = 32, .block_in = 32, .ue8m0_scales = true};
  tensors_["layers.0.attn.wq_a.weight"] = HostTensor(DType::e4m3, {128, 256});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.weight' is F8_E4M3 without block "
                          "scales 'layers.0.attn.wq_a.scale'");
  tensors_["layers.0.attn.wq_a.scale"] = HostTensor(DType::ue8m0, {4, 4});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.scale' has shape [4, 4], expected "
                          "[4, 8] (32x32 blocks of [128, 256])");
  tensors_["layers.0.attn.wq_a.scale"] = HostTensor(DType::bf16, {4, 8});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.scale' has dtype BF16, expected "
                          "F8_E8M0 or F32 block scales");
  tensors_["layers.0.attn.wq_a.scale"] = HostTensor(DType::f32, {4, 8});
  tensors_["layers.0.attn.wq_a.weight_scale_inv"] = HostTensor(DType::f32, {4, 8});
  EXPECT_EQ(load_error(), "dsv4: weights: layer 0 tensor 'layers.0.attn.wq_a.weight' has two block scale tensors, "
                          "'layers.0.attn.wq_a.scale' and 'layers.0.attn.wq_a.weight_scale_inv'");
  tensors_.erase("layers.0.attn.wq_a.scale");
  write_checkpoint();  // the transformers spelling of the scales alone is fine
  EXPECT_NO_THROW(load_weights(dir_.file("bad.safetensors"), config_, topology_));
}

TEST_F(WeightsErrors, MisalignedTensorsAreCopiedAligned) {
  // A 1-byte non-attention tensor sorted first shifts every tensor after it off alignment.
  tensors_["a.odd"] = HostTensor(DType::u8, {1});
  write_all(tensors_, dir_.file("odd.safetensors"));
  const ModelWeights w = load_weights(dir_.file("odd.safetensors"), config_, topology_);
  const WeightTensor& sink = w.layers[0].get(WeightRole::attn_sink);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(sink.data) % 4, 0u);
  EXPECT_EQ(std::memcmp(sink.data, tensors_["layers.0.attn.attn_sink"].data(), 16), 0);
}

// ---------------------------------------------------------------------------------------------
// Name spellings.

TEST(Weights, ModelPrefixAndMtpNamesAreAccepted) {
  TempDir dir;
  const ModelConfig config = golden_config("v40a");
  std::map<std::string, HostTensor> tensors;
  for (auto& [name, t] : read_all(kGolden + "v40a.weights.safetensors")) tensors["model." + name] = std::move(t);
  // The MTP layer (layer 3 = mtp.0) in native spelling, as DeepSeek's checkpoints name it.
  const ModelTopology topology = resolve_topology(config);
  const ModelWeights mtp = random_weights(config, topology, 5, false);
  for (const auto& t : mtp.layers[3].tensors) {
    if (!t) continue;
    std::string name = t->name;
    name.replace(0, std::string("layers.3.").size(), "mtp.0.");
    HostTensor copy(t->dtype, t->shape);
    std::memcpy(copy.data(), t->data, copy.nbytes());
    tensors[name] = std::move(copy);
  }
  write_all(tensors, dir.file("prefixed.safetensors"));
  const ModelWeights w = load_weights(dir.file("prefixed.safetensors"), config, topology);
  EXPECT_EQ(w.layers[1].get(WeightRole::compressor_ape).name, "model.layers.1.self_attn.compressor.position_bias");
  EXPECT_EQ(w.layers[3].get(WeightRole::wkv).name, "mtp.0.attn.wkv.weight");
  EXPECT_TRUE(inspect_weights(dir.file("prefixed.safetensors"), config).absent_mtp_layers.empty());

  // Missing names are reported in the checkpoint's own spelling.
  tensors.erase("model.layers.2.self_attn.sinks");
  write_all(tensors, dir.file("prefixed.safetensors"));
  EXPECT_EQ(inspect_weights(dir.file("prefixed.safetensors"), config).missing,
            std::vector<std::string>{"model.layers.2.self_attn.sinks"});
}

TEST(Weights, NamesThatOnlyLookLikeAttentionAreNotAttention) {
  TempDir dir;
  const ModelConfig config = golden_config("v41a");
  auto tensors = read_all(kGolden + "v41a.weights-00001-of-00002.safetensors");
  for (auto& [name, t] : read_all(kGolden + "v41a.weights-00002-of-00002.safetensors")) tensors[name] = std::move(t);
  const std::vector<std::string> odd = {"layers.01.attn.wq_a.weight", "layers.-1.attn.wq_a.weight",
                                        "layers.99999999999.attn.wq_a.weight", "layers.0.attn.wq_a",
                                        "layers.0.attn.rotary.inv_freq", "xlayers.0.attn.wq_a.weight",
                                        "layers.0.self_attn.wq_a.weight", "model.model.layers.0.attn.wq_a.weight"};
  for (const std::string& name : odd) tensors[name] = HostTensor(DType::bf16, {1});
  write_all(tensors, dir.file("odd.safetensors"));
  const InspectReport r = inspect_weights(dir.file("odd.safetensors"), config);
  EXPECT_TRUE(r.ok());
  for (const std::string& name : odd)
    EXPECT_NE(std::find(r.unexpected.begin(), r.unexpected.end(), name), r.unexpected.end()) << name;
}

// ---------------------------------------------------------------------------------------------
// fp8 dequantization.

TEST(Weights, Fp8DequantizationIsExact) {
  // A hand-made 5 x 7 tensor in 2 x 4 blocks with ue8m0 and with f32 scales.
  std::vector<uint8_t> codes(35);
  for (size_t i = 0; i < codes.size(); ++i) {
    codes[i] = static_cast<uint8_t>(i * 37 + 11);
    if ((codes[i] & 0x7f) == 0x7f) codes[i] = 0x35;  // no NaN codes in a weight
  }
  const std::vector<uint8_t> ue8m0 = {120, 127, 130, 101, 140, 127};  // [3, 2]
  const std::vector<float> f32 = {0.5f, -3.0f, 1e-3f, 7.25f, 1.0f, 0.125f};
  WeightTensor w;
  w.name = "w";
  w.dtype = DType::e4m3;
  w.shape = {5, 7};
  w.data = codes.data();
  w.scale_shape = {3, 2};
  w.block_out = 2;
  w.block_in = 4;
  for (const bool use_ue8m0 : {true, false}) {
    w.scale_dtype = use_ue8m0 ? DType::ue8m0 : DType::f32;
    w.scale_data = use_ue8m0 ? static_cast<const void*>(ue8m0.data()) : f32.data();
    const HostTensor y = w.to_f32();
    for (int r = 0; r < 5; ++r) {
      for (int c = 0; c < 7; ++c) {
        const int s = (r / 2) * 2 + c / 4;
        const float scale = use_ue8m0 ? decode_ue8m0(ue8m0[s]) : f32[s];
        EXPECT_EQ(y.as<float>()[r * 7 + c], decode_e4m3(codes[r * 7 + c]) * scale) << r << "," << c;
      }
    }
  }
  w.scale_shape = {2, 2};
  EXPECT_EQ(error_of([&] { w.to_f32(); }), "dsv4: weights: fp8 tensor 'w' has scales of shape [2, 2], expected [3, 2]");
}

TEST(Weights, RandomFp8WeightsDequantizeCloseToTheirBf16Twins) {
  const ModelConfig config = preset_config("tiny-v4.1");
  const ModelTopology topology = resolve_topology(config);
  const ModelWeights fp8 = random_weights(config, topology, 3, true);
  const ModelWeights bf16 = random_weights(config, topology, 3, false);
  int fp8_tensors = 0;
  for (int l = 0; l < topology.size(); ++l) {
    for (int r = 0; r < kNumWeightRoles; ++r) {
      const auto& q = fp8.layers[l].tensors[r];
      if (!q) continue;
      const WeightTensor& b = *bf16.layers[l].tensors[r];
      if (!q->is_fp8()) {
        EXPECT_TRUE(same_bytes(*q, b)) << q->name;
        continue;
      }
      ++fp8_tensors;
      EXPECT_EQ(q->scale_dtype, DType::ue8m0);
      EXPECT_EQ(q->block_out, 32);
      const HostTensor deq = q->to_f32(), ref = b.to_f32();
      const int64_t cols = q->shape[1], scale_cols = q->scale_shape[1];
      for (int64_t i = 0; i < deq.numel(); ++i) {
        const int64_t s = (i / cols / 32) * scale_cols + (i % cols) / 32;
        const float scale = decode_ue8m0(static_cast<const uint8_t*>(q->scale_data)[s]);
        const float code_value = decode_e4m3(static_cast<const uint8_t*>(q->data)[i]);
        ASSERT_EQ(deq.as<float>()[i], code_value * scale) << q->name << " " << i;
        // e4m3 keeps 3 mantissa bits (relative error <= 2^-4, subnormals 2^-10 of the scale) and
        // the bf16 twin 8 (2^-9).
        const float want = ref.as<float>()[i];
        ASSERT_LE(std::fabs(deq.as<float>()[i] - want), 0x1p-4f * 1.01f * std::fabs(want) + scale * 0x1p-10f)
            << q->name << " " << i;
      }
    }
  }
  // wq_a, wq_b, wkv, wo_a, wo_b of every layer and wq_b of every indexer.
  const auto indexers = std::count_if(topology.layers.begin(), topology.layers.end(),
                                      [](const LayerPlan& p) { return p.owns_indexer; });
  EXPECT_GT(indexers, 0);
  EXPECT_EQ(fp8_tensors, 5 * topology.size() + indexers);
}

// ---------------------------------------------------------------------------------------------
// Random weights.

TEST(Weights, RandomWeightsAreDeterministicAndScaled) {
  const ModelConfig config = preset_config("tiny-v4.1");
  const ModelTopology topology = resolve_topology(config);
  omp_set_num_threads(1);
  const ModelWeights a = random_weights(config, topology, 42, false);
  omp_set_num_threads(2);
  const ModelWeights b = random_weights(config, topology, 42, false);
  const ModelWeights c = random_weights(config, topology, 43, false);
  for (int l = 0; l < topology.size(); ++l) {
    for (const ExpectedWeight& e : expected_layer_weights(config, topology[l])) {
      const WeightTensor& wa = a.layers[l].get(e.role);
      EXPECT_EQ(wa.shape, e.shape);
      EXPECT_TRUE(same_bytes(wa, b.layers[l].get(e.role))) << wa.name;
      EXPECT_FALSE(same_bytes(wa, c.layers[l].get(e.role))) << wa.name;
      const HostTensor x = wa.to_f32();
      double sum = 0, sum2 = 0, lo = 1e30, hi = -1e30;
      for (int64_t i = 0; i < x.numel(); ++i) {
        const double v = x.as<float>()[i];
        sum += v, sum2 += v * v, lo = std::min(lo, v), hi = std::max(hi, v);
      }
      const double n = static_cast<double>(x.numel()), mean = sum / n, rms = std::sqrt(sum2 / n);
      const std::string role = weight_role_name(e.role);
      if (role.find("norm") != std::string::npos) {
        EXPECT_GE(lo, 0.9 - 0x1p-8) << wa.name;  // bf16 rounding of the U(0.9, 1.1) draws
        EXPECT_LE(hi, 1.1 + 0x1p-7) << wa.name;
        EXPECT_NEAR(mean, 1.0, 0.1 * 3 / std::sqrt(3 * n)) << wa.name;  // 3 sigma of U(0.9, 1.1)
      } else if (e.role == WeightRole::attn_sink || role.find("ape") != std::string::npos) {
        EXPECT_LT(std::fabs(mean), 0.5) << wa.name;
        EXPECT_LT(rms, 0.5) << wa.name;
      } else if (n >= 4096) {
        const double want = 1.0 / std::sqrt(static_cast<double>(e.shape[1]));
        EXPECT_NEAR(rms, want, want * 5 / std::sqrt(n)) << wa.name;  // the rms of n normals: ~5 sigma
        EXPECT_NEAR(mean, 0.0, want * 5 / std::sqrt(n)) << wa.name;
      }
    }
  }
}

TEST(Weights, SaveLoadRoundTripKeepsEveryByte) {
  for (const std::string preset : {"tiny-v4.1", "tiny-v4"}) {
    for (const bool fp8 : {false, true}) {
      TempDir dir;
      const ModelConfig config = preset_config(preset);
      const ModelTopology topology = resolve_topology(config);
      const ModelWeights original = random_weights(config, topology, 9, fp8);
      save_weights(original, dir.file("w.safetensors"));
      const ModelWeights back = load_weights(dir.file("w.safetensors"), config, topology);
      int count = 0;
      for (int l = 0; l < topology.size(); ++l) {
        for (int r = 0; r < kNumWeightRoles; ++r) {
          ASSERT_EQ(original.layers[l].tensors[r].has_value(), back.layers[l].tensors[r].has_value());
          if (!original.layers[l].tensors[r]) continue;
          ++count;
          EXPECT_TRUE(same_bytes(*original.layers[l].tensors[r], *back.layers[l].tensors[r]))
              << preset << " fp8=" << fp8 << " " << back.layers[l].tensors[r]->name;
          EXPECT_EQ(original.layers[l].tensors[r]->name, back.layers[l].tensors[r]->name);
        }
      }
      EXPECT_GT(count, 8 * topology.size());
      EXPECT_TRUE(inspect_weights(dir.file("w.safetensors"), config).ok());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dsv4 inspect.

using test::CliResult;
using test::run_cli;

TEST(WeightsCli, InspectRecognizesEveryGoldenTensor) {
  const CliResult v40 =
      run_cli("inspect --config " + kGolden + "v40a.config.json " + kGolden + "v40a.weights.safetensors");
  EXPECT_EQ(v40.exit_code, 0) << v40.output;
  for (const std::string& name : Checkpoint::open(kGolden + "v40a.weights.safetensors").names()) {
    const size_t at = v40.output.find(name + " ");
    ASSERT_NE(at, std::string::npos) << name;
    const std::string line = v40.output.substr(at, v40.output.find('\n', at) - at);
    EXPECT_NE(line.find("-> attn."), std::string::npos) << line;
    EXPECT_EQ(line.substr(line.size() - 2), "OK") << line;
  }
  EXPECT_NE(v40.output.find("layer 3 (sliding, MTP):\n  no tensors in the checkpoint"), std::string::npos)
      << v40.output;
  EXPECT_NE(v40.output.find("OK: 38 attention tensors, 0 with problems, 0 missing, 0 not attention"),
            std::string::npos)
      << v40.output;

  const CliResult v41 =
      run_cli("inspect --config " + kGolden + "v41a.config.json " + kGolden + "v41a.weights.index.json");
  EXPECT_EQ(v41.exit_code, 0) << v41.output;
  EXPECT_NE(v41.output.find("not attention, ignored (6):\n  layers.0.attn_norm.weight"), std::string::npos)
      << v41.output;
}

TEST(WeightsCli, InspectFailsOnAMismatchAndNamesIt) {
  // The V4.0 checkpoint against the V4.1 config: nothing fits.
  const CliResult r = run_cli("inspect --config " + kGolden + "v41a.config.json " + kGolden + "v40a.weights.safetensors");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("layers.0.self_attn.q_a_proj.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("has shape [192, 256], expected [128, 256]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("missing ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("FAILED"), std::string::npos) << r.output;

  const CliResult preset = run_cli("inspect --preset tiny-v4 " + kGolden + "v40a.weights.safetensors");
  EXPECT_EQ(preset.exit_code, 1) << preset.output;
  const CliResult absent = run_cli("inspect --preset tiny-v4 /nonexistent.safetensors");
  EXPECT_EQ(absent.exit_code, 1);
  EXPECT_NE(absent.output.find("dsv4: safetensors: cannot open '/nonexistent.safetensors'"), std::string::npos)
      << absent.output;
}

}  // namespace
}  // namespace dsv4

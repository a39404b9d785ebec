#include "cuda/engine/layer_weights.h"

#include "dsv4/numeric.h"
#include "model/layer_recipe.h"

namespace dsv4::cuda {
namespace {

// Gate projections are placed right after their kv projection (no alignment gap).
bool follows_its_kv(WeightRole role) {
  return role == WeightRole::compressor_wgate || role == WeightRole::indexer_compressor_wgate;
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// How a weight is kept on the device (the header's rules).
DType device_dtype(const WeightRecipe& use, DType stored, Precision precision) {
  if (!use.projection) return DType::f32;
  if (stored == DType::e4m3) return DType::e4m3;
  if (precision == Precision::fp32 || (use.fp32_product && stored == DType::f32)) return DType::f32;
  return DType::bf16;
}

// A bf16 device copy of a bf16 or f32 projection (f32 values rounded).
void upload_bf16(const WeightTensor& w, const DeviceWeight& d, cudaStream_t stream) {
  const int64_t n = w.numel();
  if (w.dtype == DType::bf16) {
    copy_to_device(d.data, w.data, static_cast<size_t>(n) * 2, stream);
    return;
  }
  const HostTensor values = w.to_f32();
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) bits[static_cast<size_t>(i)] = float_to_bf16_bits(values.as<float>()[i]);
  copy_to_device(d.data, bits.data(), bits.size() * 2, stream);
}

void upload_f32(const WeightTensor& w, const DeviceWeight& d, cudaStream_t stream) {
  const HostTensor values = w.to_f32();
  copy_to_device(d.data, values.data(), values.nbytes(), stream);
}

// The codes and block scales of an e4m3 projection, byte for byte.
void upload_e4m3(const WeightTensor& w, const DeviceWeight& d, cudaStream_t stream) {
  copy_to_device(d.data, w.data, static_cast<size_t>(w.numel()), stream);
  copy_to_device(d.scale, w.scale_data, static_cast<size_t>(element_count(w.scale_shape)) * dtype_size(w.scale_dtype),
                 stream);
}

}  // namespace

TensorView DeviceWeight::scale_view() const {
  if (dtype != DType::e4m3) return {};
  return TensorView::contiguous(scale, scale_dtype, scale_shape, Device::cuda, device);
}

TensorView DeviceWeight::view(const std::vector<int64_t>& as_shape) const {
  DSV4_CHECK(element_count(as_shape) == element_count(shape), "engine: a weight of shape ", shape_string(shape),
             " cannot be viewed as ", shape_string(as_shape));
  return TensorView::contiguous(data, dtype, as_shape, Device::cuda, device);
}

DeviceLayerWeights::DeviceLayerWeights(const ModelConfig& config, const LayerRecipe& recipe,
                                       const LayerWeights& weights, cudaStream_t stream)
    : layer_(recipe.plan.layer) {
  const LayerPlan& plan = recipe.plan;
  int device = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&device));
  const std::vector<ExpectedWeight> expected = expected_layer_weights(config, plan);
  std::vector<size_t> offsets, scale_offsets;  // per expected weight (scales: e4m3 only)
  size_t bytes = 0;
  for (const ExpectedWeight& e : expected) {
    DSV4_CHECK(weights.has(e.role), "engine: layer ", plan.layer, " has no weight '", weight_role_name(e.role), "'");
    const WeightTensor& w = weights.get(e.role);
    DSV4_CHECK(w.shape == e.shape, "engine: layer ", plan.layer, " weight '", weight_role_name(e.role), "' has shape ",
               shape_string(w.shape), ", expected ", shape_string(e.shape));
    DSV4_CHECK(!w.is_fp8() || e.fp8_allowed, "engine: layer ", plan.layer, " weight '", weight_role_name(e.role),
               "' is fp8, which the reference does not allow for this tensor");
    DSV4_CHECK(w.dtype == DType::bf16 || w.dtype == DType::f32 || w.dtype == DType::e4m3, "engine: layer ", plan.layer,
               " weight '", weight_role_name(e.role), "' has dtype ", dtype_name(w.dtype),
               ", expected BF16, F32 or F8_E4M3");
    DeviceWeight& d = weights_[static_cast<size_t>(e.role)];
    const WeightRecipe use = weight_recipe(e.role);
    d.dtype = device_dtype(use, w.dtype, recipe.precision);
    d.shape = e.shape;
    d.device = device;
    if (recipe.round_bf16 && w.is_fp8() && use.fp8_activations) d.activation_block = w.block_in;
    if (!follows_its_kv(e.role)) bytes = align_workspace(bytes);
    offsets.push_back(bytes);
    bytes += static_cast<size_t>(element_count(e.shape)) * dtype_size(d.dtype);
    if (d.dtype == DType::e4m3) {
      d.scale_dtype = w.scale_dtype;
      d.scale_shape = w.scale_shape;
      d.block_out = w.block_out;
      d.block_in = w.block_in;
      d.f32_product = recipe.precision == Precision::fp32;
      bytes = align_workspace(bytes);
      scale_offsets.push_back(bytes);
      bytes += static_cast<size_t>(element_count(w.scale_shape)) * dtype_size(w.scale_dtype);
    } else {
      scale_offsets.push_back(0);
    }
  }
  memory_ = DeviceBuffer(bytes);
  for (size_t i = 0; i < expected.size(); ++i) {
    const WeightRole role = expected[i].role;
    DeviceWeight& d = weights_[static_cast<size_t>(role)];
    d.data = static_cast<std::byte*>(memory_.data()) + offsets[i];
    if (d.dtype == DType::e4m3) {
      d.scale = static_cast<std::byte*>(memory_.data()) + scale_offsets[i];
      upload_e4m3(weights.get(role), d, stream);
    } else if (d.dtype == DType::bf16) {
      upload_bf16(weights.get(role), d, stream);
    } else {
      upload_f32(weights.get(role), d, stream);
    }
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
}

const DeviceWeight& DeviceLayerWeights::get(WeightRole role) const {
  const DeviceWeight& w = weights_[static_cast<size_t>(role)];
  DSV4_CHECK(w.present(), "engine: layer ", layer_, " has no weight '", weight_role_name(role), "'");
  return w;
}

TensorView DeviceLayerWeights::fused(WeightRole kv, WeightRole gate) const {
  const DeviceWeight& k = get(kv);
  if (!has(gate)) return k.view();
  const DeviceWeight& g = get(gate);
  DSV4_CHECK(g.data == static_cast<std::byte*>(k.data) + element_count(k.shape) * dtype_size(k.dtype) &&
                 g.shape[1] == k.shape[1] && g.dtype == k.dtype,
             "engine: layer ", layer_, " weights '", weight_role_name(kv), "' and '", weight_role_name(gate),
             "' are not stored as one fused projection");
  return TensorView::contiguous(k.data, k.dtype, {k.shape[0] + g.shape[0], k.shape[1]}, Device::cuda, k.device);
}

}  // namespace dsv4::cuda

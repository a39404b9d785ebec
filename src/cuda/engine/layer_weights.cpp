#include "cuda/engine/layer_weights.h"

#include "dsv4/cuda/projection.h"
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

// A bf16 device copy of a projection.
void upload_bf16(const WeightTensor& w, const DeviceWeight& d, cudaStream_t stream) {
  const int64_t n = w.numel();
  if (w.dtype == DType::bf16) {
    copy_to_device(d.data, w.data, static_cast<size_t>(n) * 2, stream);
  } else if (w.dtype == DType::e4m3) {
    DeviceBuffer codes(static_cast<size_t>(n));
    DeviceBuffer scales(static_cast<size_t>(element_count(w.scale_shape)) * dtype_size(w.scale_dtype));
    copy_to_device(codes.data(), w.data, codes.bytes(), stream);
    copy_to_device(scales.data(), w.scale_data, scales.bytes(), stream);
    run_dequantize_weight({.weight = codes.view(DType::e4m3, w.shape),
                           .weight_scale = scales.view(w.scale_dtype, w.scale_shape),
                           .block_out = w.block_out,
                           .block_in = w.block_in,
                           .out = d.view()},
                          stream);
    // The temporaries are freed on return: the conversion must have finished.
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream));
  } else {
    const HostTensor values = w.to_f32();
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) bits[static_cast<size_t>(i)] = float_to_bf16_bits(values.as<float>()[i]);
    copy_to_device(d.data, bits.data(), bits.size() * 2, stream);
  }
}

void upload_f32(const WeightTensor& w, const DeviceWeight& d, cudaStream_t stream) {
  const HostTensor values = w.to_f32();
  copy_to_device(d.data, values.data(), values.nbytes(), stream);
}

}  // namespace

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
  std::vector<size_t> offsets;
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
    const bool keep_f32 = !use.projection || (use.fp32_product && w.dtype == DType::f32);
    d.dtype = keep_f32 ? DType::f32 : DType::bf16;
    d.shape = e.shape;
    d.device = device;
    if (recipe.round_bf16 && w.is_fp8() && use.fp8_activations) d.activation_block = w.block_in;
    if (!follows_its_kv(e.role)) bytes = align_workspace(bytes);
    offsets.push_back(bytes);
    bytes += static_cast<size_t>(element_count(e.shape)) * dtype_size(d.dtype);
  }
  memory_ = DeviceBuffer(bytes);
  for (size_t i = 0; i < expected.size(); ++i) {
    const WeightRole role = expected[i].role;
    DeviceWeight& d = weights_[static_cast<size_t>(role)];
    d.data = static_cast<std::byte*>(memory_.data()) + offsets[i];
    if (d.dtype == DType::bf16) upload_bf16(weights.get(role), d, stream);
    else upload_f32(weights.get(role), d, stream);
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

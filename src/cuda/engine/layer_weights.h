// A layer's attention weights on the device, uploaded once when the engine is created and kept
// in one allocation per layer, as the layer recipe's weight_recipe says: fp8 projections as they
// are stored (e4m3 codes and their block scales; run_linear multiplies them, LinearParams), other
// projections as bf16 (f32 weights rounded) except fp32 compressor projections, which the
// reference multiplies in fp32, and every projection in Precision::fp32, whose GEMMs are fp32;
// vectors (norm weights, attn_sink, position biases) as f32. A compressor's gate projection
// follows its kv projection directly, so that the two multiply as one fused [kv; gate] GEMM
// (compressor.h).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "dsv4/config.h"
#include "dsv4/cuda/runtime.h"
#include "model/layer_recipe.h"
#include "dsv4/weights.h"

namespace dsv4::cuda {

struct DeviceWeight {
  void* data = nullptr;         // inside the layer's allocation
  DType dtype = DType::bf16;
  std::vector<int64_t> shape;   // empty: the layer has no such weight
  int device = 0;
  // > 0: the reference quantizes the activation to fp8 in tiles of this many input channels
  // before this projection (fp8 checkpoint weight, Precision::reference).
  int activation_block = 0;
  // e4m3 weights: the block scales as the checkpoint stores them, [ceil(rows / block_out),
  // ceil(in / block_in)] over the stored rows (also for wo_a viewed per group: LinearParams
  // takes that layout), inside the layer's allocation.
  void* scale = nullptr;
  DType scale_dtype = DType::ue8m0;
  std::vector<int64_t> scale_shape;
  int block_out = 0;
  int block_in = 0;
  // e4m3 weights in Precision::fp32: dequantized to f32 and multiplied in fp32 (LinearParams).
  bool f32_product = false;

  bool present() const { return !shape.empty(); }
  TensorView view() const { return TensorView::contiguous(data, dtype, shape, Device::cuda, device); }
  // The block scales of an e4m3 weight; absent (TensorView{}) for other dtypes.
  TensorView scale_view() const;
  // The same elements in another shape of equal size (e.g. wo_a as [groups, rank, in]).
  TensorView view(const std::vector<int64_t>& as_shape) const;
};

class DeviceLayerWeights {
 public:
  // Checks every tensor the plan needs against its expected shape (expected_layer_weights), then
  // uploads and converts it on `stream`, waiting for the copies to finish.
  DeviceLayerWeights(const ModelConfig& config, const LayerRecipe& recipe, const LayerWeights& weights,
                     cudaStream_t stream);

  bool has(WeightRole role) const { return weights_[static_cast<size_t>(role)].present(); }
  // Throws naming the layer and the tensor when the layer has no such weight.
  const DeviceWeight& get(WeightRole role) const;
  // [kv rows + gate rows, in]: the kv projection and the gate projection stored right after it
  // (just the kv projection when the layer has no `gate`).
  TensorView fused(WeightRole kv, WeightRole gate) const;
  int64_t device_bytes() const { return static_cast<int64_t>(memory_.bytes()); }

 private:
  int layer_ = -1;
  DeviceBuffer memory_;
  std::array<DeviceWeight, kNumWeightRoles> weights_;
};

}  // namespace dsv4::cuda

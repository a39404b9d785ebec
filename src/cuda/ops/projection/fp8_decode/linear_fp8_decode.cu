// The fp8_decode implementation of run_linear: e4m3 weights at up to kLinearFp8DecodeMaxRows rows
// on tensor cores, the weight converted in registers (linear_fp8_decode_kernel.cuh). The kernels
// are instantiated per token-tile count in src/cuda/instantiations/linear_fp8_decode_t*.cu.
//
// Work split: a block per 64 weight rows of a group; when that makes fewer blocks than
// kTargetBlocks (two per SM of an H200), K is split too, and a second kernel adds the splits'
// fp32 partial sums in ascending order. The split depends on the weight's shape only, never on the
// token count or the device, so a row's bits do not depend on the batch it is in.
#include <algorithm>
#include <string>

#include "cuda/common/device_math.cuh"
#include "cuda/ops/projection/fp8_decode/linear_fp8_decode_kernel.cuh"

namespace dsv4::cuda {

extern template void launch_linear_fp8_decode<1>(const Fp8DecodeLaunch&, cudaStream_t);
extern template void launch_linear_fp8_decode<2>(const Fp8DecodeLaunch&, cudaStream_t);
extern template void launch_linear_fp8_decode<4>(const Fp8DecodeLaunch&, cudaStream_t);
extern template void launch_linear_fp8_decode<8>(const Fp8DecodeLaunch&, cudaStream_t);

namespace {

constexpr int64_t kTargetBlocks = 264;
constexpr int64_t kMaxSplits = 32;
static_assert(kLinearFp8DecodeMaxRows == 8 * 8, "the largest instantiation has 8 token tiles");

struct SplitK {
  int splits;
  int split_k;  // channels per split
};

SplitK split_k(const LinearShape& s) {
  const int64_t blocks = std::max<int64_t>(1, (s.out + kFp8DecodeBlockRows - 1) / kFp8DecodeBlockRows * s.groups);
  const int64_t steps = std::max<int64_t>(1, (s.in + kFp8DecodeBlockK - 1) / kFp8DecodeBlockK);
  const int64_t wanted = std::clamp<int64_t>((kTargetBlocks + blocks - 1) / blocks, 1, std::min(kMaxSplits, steps));
  const int64_t steps_per_split = (steps + wanted - 1) / wanted;
  return {static_cast<int>((steps + steps_per_split - 1) / steps_per_split),
          static_cast<int>(steps_per_split * kFp8DecodeBlockK)};
}

size_t partial_bytes(const LinearShape& s) {
  const SplitK k = split_k(s);
  return k.splits > 1 ? align_workspace(static_cast<size_t>(k.splits * s.rows * s.groups * s.out) * 4) : 0;
}

// y[i] = Σ_split partial[split][i], splits added in ascending order.
__global__ void reduce_splits_kernel(const float* partial, int splits, int64_t n, void* y, DType y_dtype) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float sum = partial[i];
    for (int split = 1; split < splits; ++split) sum += partial[split * n + i];
    store_float(y, y_dtype, i, sum);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::string supports(const LinearParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability_at_least(80, device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_shared_memory(fp8_decode_shared_bytes(8), device); !why_not.empty()) return why_not;
  if (p.weight.dtype != DType::e4m3) return std::string("weight is ") + dtype_name(p.weight.dtype) + ", needs e4m3";
  if (p.f32_product) return "f32_product needs an fp32 product, the tensor cores multiply bf16";
  const LinearShape s = linear_shape(p);
  if (s.rows > kLinearFp8DecodeMaxRows)
    return std::to_string(s.rows) + " rows, supports up to " + std::to_string(kLinearFp8DecodeMaxRows);
  if (s.in % 16 != 0) return "input size " + std::to_string(s.in) + " is not a multiple of 16";
  if (p.block_in % 16 != 0) return "block_in " + std::to_string(p.block_in) + " is not a multiple of 16";
  if (s.out > INT32_MAX / 2 || s.groups > 65535) return "more weight rows or groups than the grid addresses";
  if (!aligned16(p.weight.data)) return "weight is not 16-byte aligned";
  if (!needs_activation_copy(p, DType::bf16) && !aligned16(p.x.data)) return "x is not 16-byte aligned";
  return "";
}

// What supports() checks of the call itself (no device, no addresses): the workspace is sized for
// the calls it may take only, so large prefill steps and other weights add nothing.
bool call_supported(const LinearParams& p, const LinearShape& s) {
  return p.weight.dtype == DType::e4m3 && !p.f32_product && s.rows <= kLinearFp8DecodeMaxRows;
}

size_t workspace_bytes(const LinearParams& p) {
  const LinearShape s = linear_shape(p);
  return call_supported(p, s) ? activation_copy_bytes(p, DType::bf16) + partial_bytes(s) : 0;
}

void run(const LinearParams& p, void* workspace, cudaStream_t stream) {
  const LinearShape s = linear_shape(p);
  auto* cursor = static_cast<std::byte*>(workspace);
  Fp8DecodeLaunch a;
  a.x = static_cast<const uint16_t*>(p.x.data);
  if (needs_activation_copy(p, DType::bf16)) {
    launch_prepare_activation(p, DType::bf16, cursor, stream);
    a.x = reinterpret_cast<const uint16_t*>(cursor);
    cursor += activation_copy_bytes(p, DType::bf16);
  }
  a.weight = p.weight.ptr<const uint8_t>();
  a.scale = p.weight_scale.data;
  a.ue8m0_scale = p.weight_scale.dtype == DType::ue8m0;
  a.scale_rows = scale_rows(p.weight, p.weight_scale, p.block_out);
  a.scale_cols = static_cast<int>(p.weight_scale.shape[p.weight_scale.rank - 1]);
  a.block_in = p.block_in;
  a.rows = static_cast<int>(s.rows);
  a.groups = static_cast<int>(s.groups);
  a.out = static_cast<int>(s.out);
  a.in = static_cast<int>(s.in);
  const SplitK k = split_k(s);
  a.splits = k.splits;
  a.split_k = k.split_k;
  a.y = p.y.data;
  a.y_dtype = p.y.dtype;
  if (k.splits > 1) a.partial = reinterpret_cast<float*>(cursor);
  if (s.rows <= 8) launch_linear_fp8_decode<1>(a, stream);
  else if (s.rows <= 16) launch_linear_fp8_decode<2>(a, stream);
  else if (s.rows <= 32) launch_linear_fp8_decode<4>(a, stream);
  else launch_linear_fp8_decode<8>(a, stream);
  check_launch("linear (fp8_decode)");
  if (k.splits > 1) {
    const int64_t n = s.rows * s.groups * s.out;
    constexpr int kThreads = 256;
    reduce_splits_kernel<<<elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(a.partial, k.splits, n, p.y.data,
                                                                                     p.y.dtype);
    check_launch("linear (fp8_decode split-K)");
  }
}

}  // namespace

const LinearImplementation kLinearFp8Decode = {"fp8_decode", &supports, &workspace_bytes, &run};

}  // namespace dsv4::cuda

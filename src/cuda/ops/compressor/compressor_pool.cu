// Compressor pooling: a pooling kernel (one block per token), run_rms_norm on the latents, and a
// kernel storing the chunks' last rows in the per-sequence rings.
#include <cmath>

#include "cuda/common/check_args.h"
#include "cuda/common/device_math.cuh"
#include "dsv4/cuda/compressor.h"
#include "dsv4/cuda/qkv.h"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxRatio = 1024;

struct PoolLaunch {
  const float* rows = nullptr;  // [tokens, row_width]
  int64_t row_width = 0;
  const int32_t* position = nullptr;
  const int32_t* state_slot = nullptr;
  float* state = nullptr;       // [slots, ring_rows, row_width]
  int64_t slots = 0;
  int ring_rows = 0;  // rows of a sequence's ring (>= the pooling span)
  const float* bias = nullptr;  // [ratio, coff·dim]
  int ratio = 1;
  bool overlap = false;
  bool gated = true;
  int dim = 0;
  void* latent = nullptr;
  DType latent_dtype = DType::bf16;
  int64_t tokens = 0;
};

// The projected row of position q for token t (position p, ring `slot`): from this step's rows when
// the token q is in the same chunk, else from the ring; null before position 0.
__device__ const float* projected_row(const PoolLaunch& a, int64_t t, int64_t p, int32_t slot, int64_t q) {
  if (q < 0) return nullptr;
  const int64_t u = t - (p - q);
  if (u >= 0 && a.state_slot[u] == slot && a.position[u] == q) return a.rows + u * a.row_width;
  return a.state + (static_cast<int64_t>(slot) * a.ring_rows + q % a.ring_rows) * a.row_width;
}

// latent[t] = pooled entry for group-closing tokens, 0 for the others, NaN without a valid ring.
__global__ void __launch_bounds__(kThreads) pool_kernel(PoolLaunch a) {
  __shared__ const float* slot_rows[2 * kMaxRatio];
  const int64_t t = blockIdx.x;
  const int64_t p = a.position[t];
  const int32_t slot = a.state_slot[t];
  const bool closes = p >= 0 && (p + 1) % a.ratio == 0;
  const bool slot_valid = slot >= 0 && slot < a.slots;
  if (!closes || !slot_valid) {
    for (int c = threadIdx.x; c < a.dim; c += kThreads)
      store_float(a.latent, a.latent_dtype, t * a.dim + c, closes ? NAN : 0.0f);
    return;
  }
  const int64_t w = (p + 1) / a.ratio - 1;
  const int own = a.overlap ? a.ratio : 0;
  const int num_slots = a.gated ? own + a.ratio : 1;
  for (int s = threadIdx.x; s < a.ratio; s += kThreads) {
    slot_rows[own + s] = projected_row(a, t, p, slot, w * a.ratio + s);
    if (a.overlap) slot_rows[s] = w > 0 ? projected_row(a, t, p, slot, (w - 1) * a.ratio + s) : nullptr;
  }
  __syncthreads();
  const int coff = a.overlap ? 2 : 1;
  const int kv_width = coff * a.dim;
  for (int c = threadIdx.x; c < a.dim; c += kThreads) {
    float pooled;
    if (!a.gated) {
      pooled = slot_rows[0][c];
    } else {
      // As reference::softmax_pool: logits in slot order, their max, exp, sum, then the weighted sum.
      auto column = [&](int i) { return (a.overlap && i < a.ratio ? 0 : (coff - 1) * a.dim) + c; };
      auto logit = [&](int i) {
        const float bias = a.bias ? a.bias[(i % a.ratio) * kv_width + column(i)] : 0.0f;
        return slot_rows[i][kv_width + column(i)] + bias;
      };
      float m = -INFINITY;
      for (int i = 0; i < num_slots; ++i)
        if (slot_rows[i]) m = fmaxf(m, logit(i));
      float denominator = 0.0f;
      for (int i = 0; i < num_slots; ++i)
        if (slot_rows[i]) denominator += expf(logit(i) - m);
      pooled = 0.0f;
      for (int i = 0; i < num_slots; ++i)
        if (slot_rows[i]) pooled += slot_rows[i][column(i)] * (expf(logit(i) - m) / denominator);
    }
    store_float(a.latent, a.latent_dtype, t * a.dim + c, pooled);
  }
}

// Stores each token's row at [slot][p % ring_rows] unless a later token of its chunk takes that place.
__global__ void __launch_bounds__(kThreads) store_state_kernel(PoolLaunch a) {
  const int64_t t = blockIdx.x;
  const int64_t p = a.position[t];
  const int32_t slot = a.state_slot[t];
  if (p < 0 || slot < 0 || slot >= a.slots) return;
  const int64_t later = t + a.ring_rows;
  if (later < a.tokens && a.state_slot[later] == slot && a.position[later] == p + a.ring_rows) return;
  float* dst = a.state + (static_cast<int64_t>(slot) * a.ring_rows + p % a.ring_rows) * a.row_width;
  for (int64_t c = threadIdx.x; c < a.row_width; c += kThreads) dst[c] = a.rows[t * a.row_width + c];
}

}  // namespace

void validate_compressor_pool(const CompressorPoolParams& p) {
  constexpr const char* op = "compressor_pool";
  DSV4_CHECK(p.ratio >= 1 && p.ratio <= kMaxRatio, op, ": ratio is ", p.ratio, ", expected 1 ... ", kMaxRatio);
  DSV4_CHECK(p.gated || (p.ratio == 1 && !p.overlap), op, ": an ungated compressor has ratio 1 without overlap, got ratio ",
             p.ratio, p.overlap ? " with overlap" : "");
  const int64_t tokens = p.rows.shape[0], dim = p.latent.shape[1];
  const int64_t coff = p.overlap ? 2 : 1;
  const int64_t row_width = (p.gated ? 2 : 1) * coff * dim, span = coff * p.ratio;
  check_tensors(op, {
      {"rows", &p.rows, {kAnyDim, row_width}, {DType::f32}},
      {"token_position", &p.token_position, {tokens}, {DType::i32}},
      {"state_slot", &p.state_slot, {tokens}, {DType::i32}},
      {"state", &p.state, {kAnyDim, kAnyDim, row_width}, {DType::f32}},
      {"position_bias", &p.position_bias, {p.ratio, coff * dim}, {DType::f32}, true},
      {"norm_weight", &p.norm_weight, {dim}, {DType::bf16, DType::f32}},
      {"latent", &p.latent, {tokens, kAnyDim}, {DType::bf16, DType::f32}},
  });
  DSV4_CHECK(p.state.shape[1] >= span, op, ": argument 'state' has ", p.state.shape[1],
             " rows per sequence, expected at least the span ", span);
  DSV4_CHECK(std::isfinite(p.eps) && p.eps > 0.0f, op, ": eps is ", p.eps, ", expected finite and > 0");
  DSV4_CHECK(p.gated || !is_present(p.position_bias), op, ": an ungated compressor has no position_bias");
  DSV4_CHECK(dim <= 16384, op, ": latents of ", dim, " channels exceed the supported 16384");
}

void run_compressor_pool(const CompressorPoolParams& p, cudaStream_t stream) {
  validate_compressor_pool(p);
  PoolLaunch a;
  a.tokens = p.rows.shape[0];
  a.dim = static_cast<int>(p.latent.shape[1]);
  if (a.tokens == 0 || a.dim == 0) return;
  a.rows = p.rows.ptr<const float>();
  a.row_width = p.rows.shape[1];
  a.position = p.token_position.ptr<const int32_t>();
  a.state_slot = p.state_slot.ptr<const int32_t>();
  a.state = p.state.ptr<float>();
  a.slots = p.state.shape[0];
  a.ring_rows = static_cast<int>(p.state.shape[1]);
  if (is_present(p.position_bias)) a.bias = p.position_bias.ptr<const float>();
  a.ratio = p.ratio;
  a.overlap = p.overlap;
  a.gated = p.gated;
  a.latent = p.latent.data;
  a.latent_dtype = p.latent.dtype;
  const unsigned blocks = static_cast<unsigned>(a.tokens);
  pool_kernel<<<blocks, kThreads, 0, stream>>>(a);
  check_launch("compressor_pool");

  run_rms_norm({.x = p.latent, .weight = p.norm_weight, .eps = p.eps, .out = p.latent}, stream);

  store_state_kernel<<<blocks, kThreads, 0, stream>>>(a);
  check_launch("compressor_pool");
}

}  // namespace dsv4::cuda

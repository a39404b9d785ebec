// The synthetic residual stream of `dsv4 run` and `dsv4 bench --op step` (docs/cli.md, "Inputs"):
// layer-0 inputs from a counter-based generator keyed by (seed, sequence, position, attempt), and
// between layers hidden <- RMSNorm(hidden + attn_out) (no weight, eps 1e-6). The host loops (cpu
// backend) and the kernels (cuda backend, synthetic_inputs.cu) compute the same bits: the value
// and norm formulas below are shared, and the norm sums its squares in one fixed order that a warp
// reduction follows (32 strided partial sums, then halving pairwise). Also what both commands
// drive the backbone with: which layers run_layer takes, and the DSpark draft layers' inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "dsv4/backend_util.h"

#ifdef __CUDACC__
#define DSV4_SYNTHETIC_HD __host__ __device__
#else
#define DSV4_SYNTHETIC_HD
#endif

namespace dsv4::cli {

// Which token a row holds. `attempt` tells apart the tokens a position gets in successive verify
// steps (0 without speculation).
struct TokenKey {
  int64_t sequence;
  int64_t position;
  int64_t attempt;
};

DSV4_SYNTHETIC_HD inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// SplitMix64: each draw adds the golden gamma to the state, so draw k of a state is random access.
inline constexpr uint64_t kSplitmixGamma = 0x9E3779B97F4A7C15ull;
DSV4_SYNTHETIC_HD inline uint64_t splitmix64(uint64_t& state) { return splitmix64_mix(state += kSplitmixGamma); }

// The generator state of a token's row; its value h comes from draw h + 1 of it.
DSV4_SYNTHETIC_HD inline uint64_t token_state(uint64_t seed, TokenKey key) {
  uint64_t state = seed;
  state = splitmix64(state) ^ static_cast<uint64_t>(key.sequence);
  state = splitmix64(state) ^ static_cast<uint64_t>(key.position);
  if (key.attempt > 0) state = splitmix64(state) ^ static_cast<uint64_t>(key.attempt);
  return state;
}

// Uniform on [-sqrt(3), sqrt(3)] (unit variance) from 64 random bits.
struct UniformScale {
  double half_width = std::sqrt(3.0);
  double scale = 2.0 * std::sqrt(3.0) / 18446744073709551616.0;  // 2^64
};
DSV4_SYNTHETIC_HD inline float token_value(uint64_t state, int64_t h, UniformScale u) {
  const uint64_t bits = splitmix64_mix(state + static_cast<uint64_t>(h + 1) * kSplitmixGamma);
#ifdef __CUDA_ARCH__
  return __double2float_rn(__dsub_rn(__dmul_rn(__ull2double_rn(bits), u.scale), u.half_width));
#else
  const double scaled = static_cast<double>(bits) * u.scale;  // its own statement: never fused
  return static_cast<float>(scaled - u.half_width);
#endif
}

// The partial sums of the norm: lane j of 32 sums the squares of columns j, j + 32, ... in order.
inline constexpr int kNormLanes = 32;

// 1 / sqrt(mean of squares + eps) from the sum of squares of `cols` values.
DSV4_SYNTHETIC_HD inline float inverse_rms(double sum_sq, int64_t cols) {
#ifdef __CUDA_ARCH__
  return __double2float_rn(
      __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(__ddiv_rn(sum_sq, static_cast<double>(cols)), 1e-6))));
#else
  return static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + 1e-6));
#endif
}

// --- on an engine's rows: host loops for host rows (cpu backend), kernels queued on the engine's
// stream for device rows (cuda backend) ------------------------------------------------------------

// The layer-0 inputs of tokens into the first rows of engine rows.
class TokenInputs {
 public:
  TokenInputs(const Engine& engine, int64_t capacity_rows);
  ~TokenInputs();
  TokenInputs(const TokenInputs&) = delete;
  TokenInputs& operator=(const TokenInputs&) = delete;

  // Rows [0, keys.size()) of `rows` get the inputs of `keys`. Device rows: the keys are uploaded
  // (which waits for the engine's stream) and a kernel queued after the upload writes the rows.
  void fill(uint64_t seed, const std::vector<TokenKey>& keys, DeviceRows& rows);

 private:
  CUstream_st* stream_;  // nullptr: host rows
  int64_t capacity_rows_;
  TokenKey* device_keys_ = nullptr;  // [capacity_rows]
};

// hidden <- RMSNorm(hidden + attn_out) for the first `rows` rows; device rows: queued on the
// engine's stream, not waited for.
void chain_residual(DeviceRows& hidden, const DeviceRows& attn_out, int64_t rows);

// The layers the residual stream runs with run_layer, 0 .. n−1: every layer but the DSpark draft
// layers (the trailing MTP layers of a DSpark model), which take the target's hidden states
// (run_draft_context) and draft blocks instead (docs/speculative.md).
int backbone_layer_count(const ModelConfig& config);

// When `layer` is a DSpark target layer: queues the copy of its inputs (the first `rows` rows of
// `inputs`) to its columns of `main_hidden` ([rows, hidden_size x |dspark_target_layer_ids|], what
// run_draft_context takes).
void keep_draft_inputs(const ModelConfig& config, int layer, const DeviceRows& inputs, int64_t rows,
                       DeviceRows& main_hidden);

// --- host (cpu backend) -------------------------------------------------------------------------

// rows [keys.size(), hidden]: the layer-0 inputs of the tokens.
void fill_token_inputs(uint64_t seed, const std::vector<TokenKey>& keys, float* rows, int64_t hidden);
// hidden <- RMSNorm(hidden + attn_out), row by row ([rows, cols] each).
void chain_residual(float* hidden, const float* attn_out, int64_t rows, int64_t cols);

// --- device (cuda backend, synthetic_inputs.cu): queued on `stream`, never synchronizing ---------

void launch_fill_token_inputs(uint64_t seed, const TokenKey* keys, int64_t rows, float* out, int64_t hidden,
                              CUstream_st* stream);
void launch_chain_residual(float* hidden, const float* attn_out, int64_t rows, int64_t cols, CUstream_st* stream);
// Row copies placed by data on the device, so that a captured step graph replays them with each
// step's placement: span = {first source row, first destination index, rows} (device i64[3]);
// source row span[0] + t (t < span[2], at most max_rows) goes to destination row map[span[1] + t]
// (device i64; -1: not kept) or, without a map, span[1] + t. Rows of `cols` floats.
void launch_copy_span_rows(const float* source, float* dest, int64_t cols, const int64_t* span, const int64_t* map,
                           int64_t max_rows, CUstream_st* stream);

}  // namespace dsv4::cli

// The q / kv path between the projections and the attention (SPEC §2.2, §4.2, §8): RMSNorm, RoPE
// from a precomputed table, the QAT fake quantizers, and the insert of the finished row into a
// paged cache in its byte format.
//
// Rounding follows the reference where outputs are bf16: the normalized row and the rotated row
// are rounded to bf16 before the next step (with f32 outputs, or bf16_rounding = false for cache
// inserts, everything stays fp32, the precision of the transformers V4.0 goldens). The norm sums
// squares in double and the RoPE products are IEEE-rounded fp32 (no fused multiply-add), so bf16
// results equal the CPU reference bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "dsv4/cuda/runtime.h"
#include "dsv4/tensor.h"

namespace dsv4::cuda {

// The RoPE table of a layer: [max_positions, rope_dim] f32, row p = [cos(p·f_0) … cos(p·f_{n−1}),
// sin(p·f_0) … sin(p·f_{n−1})] with the angle float(p)·f_i in fp32 (as reference::apply_rope),
// n = rope_dim / 2 = frequencies.size(). Upload it once per layer kind.
HostTensor rope_table(const std::vector<float>& frequencies, int64_t max_positions);

// y = weight · x · rsqrt(mean(x²) + eps) per row (no weight: plain normalization).
struct RmsNormParams {
  TensorView x;          // [rows, dim] bf16 | f32
  TensorView weight;     // optional: [dim] bf16 | f32
  float eps = 1e-6f;     // > 0 (V4.1: 1e-20)
  TensorView out;        // [rows, dim] bf16 | f32; may be x
};

void validate_rms_norm(const RmsNormParams& p);
void run_rms_norm(const RmsNormParams& p, cudaStream_t stream);

// Per head of every token: optional weightless RMS normalization (V4.0 q), RoPE on the last
// rope_dim channels at the token's position (inverse: the output's un-rotation, SPEC §6.1), then
// the optional Hadamard rotation, then optional QAT (the indexer queries: fp4_ue8m0_32). Tokens
// whose position is outside the table get NaN in their rotated channels.
//
// hadamard (the official V4.0 indexer's rotate_activation, SPEC §15.2): every row becomes
// dims^-1/2 · H · row, H the Sylvester Hadamard matrix (H_ij = (−1)^popcount(i & j)), over all
// its channels; fp32 butterflies, the scale multiplied once, one rounding (to bf16 where the
// rows are rounded). dims must be a power of two.
struct RopeHeadsParams {
  TensorView x;               // [tokens, heads, head_dim] bf16 | f32
  TensorView token_position;  // [tokens] i32
  TensorView rope_table;      // [max_positions, rope_dim] f32, rope_dim even and <= head_dim
  bool inverse = false;
  bool head_norm = false;     // V4.0: q ← q · rsqrt(mean(q²) + eps) per head, before RoPE
  float eps = 1e-6f;          // head_norm only
  bool hadamard = false;      // after RoPE, before quant (V4.0 indexer QAT)
  RowQuantizer quant = RowQuantizer::none;
  TensorView out;             // [tokens, heads, head_dim] bf16 | f32; may be x
};

void validate_rope_heads(const RopeHeadsParams& p);
void run_rope_heads(const RopeHeadsParams& p, cudaStream_t stream);

// A finished cache row per token: optional RMSNorm with a weight (window kv: kv_norm; index keys:
// k_norm), RoPE at token_position + position_offset (a compressed entry rotates at its group's
// first position: offset 1 - ratio on the closing token), the optional Hadamard rotation (as in
// rope_heads: V4.0 index keys), QAT, then the row is encoded into
// `cache` at slots[t] (skipped when negative or when the position is outside the RoPE table).
struct CacheInsertParams {
  TensorView rows;            // [tokens, dim] bf16 | f32 (projection output, or the latent)
  TensorView norm_weight;     // optional: [dim] bf16 | f32
  float eps = 1e-6f;          // with norm_weight
  TensorView token_position;  // [tokens] i32 (optional without rope_table)
  int64_t position_offset = 0;
  TensorView rope_table;      // optional: [max_positions, rope_dim] f32 (absent: no RoPE)
  bool hadamard = false;      // after RoPE, before quant (V4.0 indexer QAT); dim a power of two
  RowQuantizer quant = RowQuantizer::none;
  bool bf16_rounding = true;  // round after the norm, after RoPE and after the Hadamard, as the reference
  TensorView slots;           // [tokens] i64, -1: not stored
  PagedCache cache;           // writer (its block_table is not read)
  TensorView out;             // optional: [tokens, dim] bf16 | f32, the row as encoded (every token)
};

void validate_cache_insert(const CacheInsertParams& p);
void run_cache_insert(const CacheInsertParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda

// The CPU reference operations of the attention layer (SPEC §2-§6, §12), one plain function per
// operation on fp32 buffers with explicit shapes. They are the ground truth the engine is built
// from and the oracle the CUDA kernels are tested against.
//
// Numerics: every function computes in fp32, with dot products and sums of squares accumulated in
// double and rounded once (the fp32 value closest to the exact one, whatever order another
// implementation sums in); where the official V4.1 code rounds its output to bf16, a `bf16` flag
// rounds the result (SPEC §8.1).
// Buffers are row-major and contiguous; shapes are given per argument. Functions that loop over
// independent outputs use OpenMP; no reduction order depends on the thread count, so results are
// bitwise identical for any number of threads.
#pragma once

#include <cstdint>
#include <vector>

#include "dsv4/config.h"
#include "model/layer_recipe.h"  // CompressorGeometry

namespace dsv4::reference {

// Loops over fewer multiply-adds (or elements) than this run on one thread: below it, starting a
// parallel region costs more than it saves, a lot more on a loaded machine.
inline constexpr int64_t kMinParallelWork = int64_t{1} << 21;

// Rounds x [n] to bf16 in place when `enabled`.
void round_bf16(float* x, int64_t n, bool enabled = true);

// ---------------------------------------------------------------------------------------------
// Projections

struct LinearNumerics {
  // > 0: quantize every activation row to fp8 e4m3 in blocks of this many columns with ue8m0
  // scales before the product (the reference's act_quant in front of an fp8-weight GEMM).
  int64_t fp8_activation_block = 0;
  bool bf16_output = false;
};

// y [n, out] = x [n, in] · w [out, in]ᵀ (accumulated in double, rounded to fp32). y must not alias x.
void linear(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y,
            const LinearNumerics& numerics);

// Grouped low-rank output projection (SPEC §6.2): o [n, groups, in] (group g = heads g·H/G …),
// w [groups, rank, in] → y [n, groups, rank].
void grouped_linear(const float* o, int64_t n, int64_t groups, int64_t in, const float* w, int64_t rank,
                    float* y, bool bf16_output);

// ---------------------------------------------------------------------------------------------
// Normalization

// y [n, dim] = weight [dim] · x · rsqrt(mean(x²) + eps) per row; weight nullptr: no weight (the
// V4.0 per-head q normalization). y may be x.
void rms_norm(const float* x, int64_t n, int64_t dim, const float* weight, float eps, float* y, bool bf16_output);

// ---------------------------------------------------------------------------------------------
// Rotary embedding (SPEC §2.3, §2.4)


// Rotates the last rope_dim channels of every head of x [n, heads, head_dim] by the angles
// float(positions[t]) · freqs[i] (interleaved pairs (2i, 2i+1)); `inverse` rotates by the negated
// angles. freqs [rope_dim / 2], positions [n].
void apply_rope(float* x, int64_t n, int64_t heads, int64_t head_dim, const float* freqs, int64_t rope_dim,
                const int64_t* positions, bool inverse, bool bf16_output);

// ---------------------------------------------------------------------------------------------
// Hadamard rotation (SPEC §15.2, the V4.0 indexer's rotate_activation)

// Every row of x [n, dim] (dim a power of two) becomes dim^-1/2 · H · row, in place, where
// H_ij = (−1)^popcount(i & j) is the Sylvester Hadamard matrix (scipy.linalg.hadamard's order),
// over all dim channels of the row, RoPE and NoPE alike. The sums are exact (double) and the
// scaled result is rounded once to fp32 (then to bf16 with `bf16_output`). H/√dim is symmetric and
// orthonormal: the transform is its own inverse.
void hadamard_rows(float* x, int64_t n, int64_t dim, bool bf16_output);

// ---------------------------------------------------------------------------------------------
// Fake quantization of rows (SPEC §8.2), in place, tile by tile.

// x [n, dim]: fp8 e4m3 with a ue8m0 scale per `tile` channels, on channels [0, quantized_dims)
// of every row (V4.1: all 512 with tile 32; V4.0: the 448 NoPE channels with tile 64).
void fake_quant_fp8_rows(float* x, int64_t n, int64_t dim, int64_t quantized_dims, int64_t tile);
// x [n, dim]: fp4 e2m1 with a ue8m0 scale per 32 channels (indexer queries and keys: V4.1, and
// V4.0's official QAT, whose kernel multiplies amax by fp32(1/6) where this divides by 6; the
// scales agree for every bf16 amax, SPEC §15.2).
void fake_quant_fp4_ue8m0_rows(float* x, int64_t n, int64_t dim);
// x [n, dim]: fp4 e2m1 with an e4m3 scale per 16 channels (V4.1 compressed rows).
void fake_quant_fp4_e4m3_rows(float* x, int64_t n, int64_t dim);

// ---------------------------------------------------------------------------------------------
// Compressor (SPEC §3, §12)

// One compressed entry pooled from `slots` source rows, independently per channel c < dim:
//   pooled[c] = Σ_s softmax_s(score[s][c] + bias[s][c]) · kv[s][c]
// kv[s], score[s], bias[s]: pointers to `dim` floats; a slot with kv[s] == nullptr is absent
// (weight 0, the missing first half of V4.0 CSA entry 0); score == nullptr: no gate, exactly one
// slot, pooled = kv[0] (V4.1 ratio 1); bias == nullptr or bias[s] == nullptr: no position bias.
void softmax_pool(const float* const* kv, const float* const* score, const float* const* bias, int64_t slots,
                  int64_t dim, float* pooled);

// How a layer's compressor maps tokens to compressed entries.

// The pooled (pre-norm) vector of entry `w` [dim]. row(p) returns the projected row (row_width())
// of the token at position p, for every p of the entry's span; bias [ratio, coff·dim] or nullptr.
template <class RowAt>
void pool_compressed_entry(const CompressorGeometry& g, int64_t w, const RowAt& row, const float* bias, float* pooled);

// ---------------------------------------------------------------------------------------------
// Indexer (SPEC §4)

// Index scores of one query against keys [n, dim]: for j < n_visible
//   score[j] = Σ_h weight[h] · relu(q[h] · key[j]),   q [heads, dim], weight [heads];
// j >= n_visible gets −inf. bf16 (the reference): every dot, every weighted term and the
// fp32 sum over heads are rounded to bf16. `partial`: the heads are a tensor-parallel rank's share;
// the sum stays fp32 and is rounded once the ranks' partial sums are added up.
void index_scores(const float* q, const float* weight, int64_t heads, int64_t dim, const float* keys, int64_t n,
                  int64_t n_visible, bool bf16, float* scores, bool partial = false);

// Two-level candidate filtering at the candidate source (SPEC §4.5): scores [n] (causally
// masked), blocks of block_size positions scored by their max, the block of the newest visible
// position forced in, the best top_blocks blocks (ties: lower block first) without −inf ones.
// mask [n]: 1 for positions of kept blocks.
void select_candidate_blocks(const float* scores, int64_t n, int64_t n_visible, int64_t block_size,
                             int64_t top_blocks, uint8_t* mask);

// The top-k picks (SPEC §4.6): among entries j < n_visible whose score is not −inf, the k with
// the largest scores (NaN ranks below every number; ties: lower j first), sorted ascending and
// padded with −1. scores [n], picks [k].
void select_topk(const float* scores, int64_t n, int64_t n_visible, int64_t k, int32_t* picks);

// ---------------------------------------------------------------------------------------------
// Attention (SPEC §5.2)

// Sparse MQA attention of one query with a per-head sink: rows[i] (i < n) point to `dim` floats
// that are key and value at once; q [heads, dim], sink [heads], out [heads, dim]:
//   out[h] = Σ_i e_i · row_i / (Σ_i e_i + exp(sink[h] − m)),  e_i = exp(scale · q[h]·row_i − m).
// bf16 (the reference kernel): e_i is rounded to bf16 before it multiplies the values (the
// denominator keeps fp32) and the output is rounded to bf16.
void sparse_attention(const float* q, int64_t heads, int64_t dim, const float* const* rows, int64_t n,
                      const float* sink, float scale, bool bf16, float* out);

// ---------------------------------------------------------------------------------------------

template <class RowAt>
void pool_compressed_entry(const CompressorGeometry& g, int64_t w, const RowAt& row, const float* bias, float* pooled) {
  const int64_t coff = g.overlap ? 2 : 1;
  const int64_t kv_width = coff * g.dim;  // the score columns follow the kv columns
  std::vector<const float*> kv(static_cast<size_t>(g.span()), nullptr), score(kv.size(), nullptr),
      slot_bias(kv.size(), nullptr);
  // Slot s < ratio (overlap): channels [0, dim) of window w − 1; the last `ratio` slots: channels
  // [(coff − 1)·dim, coff·dim) of window w. Bias rows follow the token's offset in its window.
  const int64_t own = g.overlap ? g.ratio : 0;
  for (int64_t s = 0; s < g.ratio; ++s) {
    const float* r = row(w * g.ratio + s);
    kv[own + s] = r + (coff - 1) * g.dim;
    if (g.gated) score[own + s] = r + kv_width + (coff - 1) * g.dim;
    if (bias) slot_bias[own + s] = bias + s * kv_width + (coff - 1) * g.dim;
    if (g.overlap && w > 0) {
      const float* prev = row((w - 1) * g.ratio + s);
      kv[s] = prev;
      score[s] = prev + kv_width;
      if (bias) slot_bias[s] = bias + s * kv_width;
    }
  }
  softmax_pool(kv.data(), g.gated ? score.data() : nullptr, bias ? slot_bias.data() : nullptr, g.span(), g.dim,
               pooled);
}

}  // namespace dsv4::reference

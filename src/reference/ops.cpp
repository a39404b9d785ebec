#include "reference/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>

#include "dsv4/error.h"
#include "dsv4/numeric.h"

namespace dsv4::reference {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Dot product accumulated in double (then rounded once to fp32): the fp32 result closest to the
// exact one, whatever order a GEMM on the other side sums in. Eight running sums in a fixed order
// keep it vectorizable without reassociation and identical on every thread.
float dot(const float* a, const float* b, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(a[i + k]) * b[i + k];
  double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += static_cast<double>(a[i]) * b[i];
  return static_cast<float>(sum);
}

float maybe_bf16(float x, bool bf16) { return bf16 ? round_to_bf16(x) : x; }

// NaN ranks below every number (and below −inf) in the top-k orders.
bool ranks_before(float a, int64_t ia, float b, int64_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// Applies quantize(tile, tile, length) to every tile of every row; the last tile of a row may be
// shorter when `quantized_dims` is not a multiple of `tile`.
template <class Quantize>
void for_each_tile(float* x, int64_t n, int64_t dim, int64_t quantized_dims, int64_t tile, const Quantize& quantize) {
  DSV4_CHECK(tile > 0 && quantized_dims >= 0 && quantized_dims <= dim, "reference: fake quantization: tile ", tile,
             " over ", quantized_dims, " of ", dim, " channels is not a valid tiling");
#pragma omp parallel for schedule(static) if (n * dim >= kMinParallelWork)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < quantized_dims; c += tile) {
      float* t = x + r * dim + c;
      quantize(t, static_cast<int>(std::min(tile, quantized_dims - c)));
    }
}

}  // namespace

void round_bf16(float* x, int64_t n, bool enabled) {
  if (!enabled) return;
#pragma omp parallel for schedule(static) if (n >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) x[i] = round_to_bf16(x[i]);
}

void linear(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y,
            const LinearNumerics& numerics) {
  std::vector<float> quantized;
  if (numerics.fp8_activation_block > 0) {
    quantized.assign(x, x + n * in);
    fake_quant_fp8_rows(quantized.data(), n, in, in, numerics.fp8_activation_block);
    x = quantized.data();
  }
  // Output column outer, token inner: a thread reuses one weight row for consecutive tokens.
#pragma omp parallel for collapse(2) schedule(static) if (n * out * in >= kMinParallelWork)
  for (int64_t o = 0; o < out; ++o)
    for (int64_t t = 0; t < n; ++t) y[t * out + o] = maybe_bf16(dot(x + t * in, w + o * in, in), numerics.bf16_output);
}

void grouped_linear(const float* o, int64_t n, int64_t groups, int64_t in, const float* w, int64_t rank, float* y,
                    bool bf16_output) {
#pragma omp parallel for collapse(3) schedule(static) if (n * groups * rank * in >= kMinParallelWork)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rank; ++r)
      for (int64_t t = 0; t < n; ++t)
        y[(t * groups + g) * rank + r] = maybe_bf16(dot(o + (t * groups + g) * in, w + (g * rank + r) * in, in), bf16_output);
}

void rms_norm(const float* x, int64_t n, int64_t dim, const float* weight, float eps, float* y, bool bf16_output) {
#pragma omp parallel for schedule(static) if (n * dim >= kMinParallelWork)
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double squares = 0.0;
    for (int64_t c = 0; c < dim; ++c) squares += static_cast<double>(xr[c]) * xr[c];
    const float mean = static_cast<float>(squares / static_cast<double>(dim));
    const float inv_rms = 1.0f / std::sqrt(mean + eps);
    for (int64_t c = 0; c < dim; ++c) {
      const float normalized = xr[c] * inv_rms;
      yr[c] = maybe_bf16(weight ? weight[c] * normalized : normalized, bf16_output);
    }
  }
}

void apply_rope(float* x, int64_t n, int64_t heads, int64_t head_dim, const float* freqs, int64_t rope_dim,
                const int64_t* positions, bool inverse, bool bf16_output) {
  DSV4_CHECK(rope_dim % 2 == 0 && rope_dim <= head_dim, "reference: rope: rope_dim ", rope_dim,
             " must be even and at most head_dim ", head_dim);
  const int64_t pairs = rope_dim / 2;
#pragma omp parallel for schedule(static) if (n * heads * rope_dim >= kMinParallelWork)
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> cos_a(static_cast<size_t>(pairs)), sin_a(static_cast<size_t>(pairs));
    const float p = static_cast<float>(positions[t]);
    for (int64_t i = 0; i < pairs; ++i) {
      const float angle = p * freqs[i];
      cos_a[i] = std::cos(angle);
      sin_a[i] = inverse ? -std::sin(angle) : std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* r = x + (t * heads + h) * head_dim + (head_dim - rope_dim);
      for (int64_t i = 0; i < pairs; ++i) {
        const float a = r[2 * i], b = r[2 * i + 1];
        r[2 * i] = maybe_bf16(a * cos_a[i] - b * sin_a[i], bf16_output);
        r[2 * i + 1] = maybe_bf16(a * sin_a[i] + b * cos_a[i], bf16_output);
      }
    }
  }
}

void hadamard_rows(float* x, int64_t n, int64_t dim, bool bf16_output) {
  DSV4_CHECK(dim > 0 && (dim & (dim - 1)) == 0, "reference: hadamard: a row of ", dim,
             " channels is not a power of two");
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
#pragma omp parallel for schedule(static) if (n * dim >= kMinParallelWork)
  for (int64_t r = 0; r < n; ++r) {
    float* row = x + r * dim;
    // Butterflies in double: sums of up to dim bf16 / fp32 values, exact in practice.
    std::vector<double> v(row, row + dim);
    for (int64_t half = 1; half < dim; half *= 2)
      for (int64_t first = 0; first < dim; first += 2 * half)
        for (int64_t i = first; i < first + half; ++i) {
          const double a = v[i], b = v[i + half];
          v[i] = a + b;
          v[i + half] = a - b;
        }
    for (int64_t c = 0; c < dim; ++c) row[c] = maybe_bf16(static_cast<float>(v[c] * scale), bf16_output);
  }
}

void fake_quant_fp8_rows(float* x, int64_t n, int64_t dim, int64_t quantized_dims, int64_t tile) {
  for_each_tile(x, n, dim, quantized_dims, tile, [](float* t, int len) { fake_quant_fp8_ue8m0(t, t, len); });
}

void fake_quant_fp4_ue8m0_rows(float* x, int64_t n, int64_t dim) {
  for_each_tile(x, n, dim, dim, 32, [](float* t, int len) { fake_quant_fp4_ue8m0(t, t, len); });
}

void fake_quant_fp4_e4m3_rows(float* x, int64_t n, int64_t dim) {
  for_each_tile(x, n, dim, dim, 16, [](float* t, int len) { fake_quant_fp4_e4m3(t, t, len); });
}

void softmax_pool(const float* const* kv, const float* const* score, const float* const* bias, int64_t slots,
                  int64_t dim, float* pooled) {
  if (!score) {
    DSV4_CHECK(slots == 1 && kv[0], "reference: softmax_pool: an ungated entry has exactly one slot, got ", slots);
    std::copy(kv[0], kv[0] + dim, pooled);
    return;
  }
  std::vector<float> logit(static_cast<size_t>(slots));
  for (int64_t c = 0; c < dim; ++c) {
    float m = -kInf;
    for (int64_t s = 0; s < slots; ++s) {
      logit[s] = kv[s] ? score[s][c] + (bias && bias[s] ? bias[s][c] : 0.0f) : -kInf;
      m = std::max(m, logit[s]);
    }
    float denominator = 0.0f;
    for (int64_t s = 0; s < slots; ++s) {
      logit[s] = kv[s] ? std::exp(logit[s] - m) : 0.0f;
      denominator += logit[s];
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < slots; ++s)
      if (kv[s]) sum += kv[s][c] * (logit[s] / denominator);
    pooled[c] = sum;
  }
}

void index_scores(const float* q, const float* weight, int64_t heads, int64_t dim, const float* keys, int64_t n,
                  int64_t n_visible, bool bf16, float* scores, bool partial) {
  for (int64_t j = 0; j < n; ++j) {
    if (j >= n_visible) {
      scores[j] = -kInf;
      continue;
    }
    float sum = 0.0f;
    for (int64_t h = 0; h < heads; ++h) {
      const float relu = std::max(maybe_bf16(dot(q + h * dim, keys + j * dim, dim), bf16), 0.0f);
      sum += maybe_bf16(relu * weight[h], bf16);
    }
    scores[j] = partial ? sum : maybe_bf16(sum, bf16);
  }
}

void select_candidate_blocks(const float* scores, int64_t n, int64_t n_visible, int64_t block_size,
                             int64_t top_blocks, uint8_t* mask) {
  DSV4_CHECK(block_size > 0, "reference: candidate blocks: block size ", block_size, " must be positive");
  const int64_t visible = std::clamp<int64_t>(n_visible, 0, n);
  const int64_t blocks = (n + block_size - 1) / block_size;
  std::vector<float> block_score(static_cast<size_t>(blocks), -kInf);
  for (int64_t j = 0; j < visible; ++j)
    if (!std::isnan(scores[j])) block_score[j / block_size] = std::max(block_score[j / block_size], scores[j]);
  // The newest visible position's block may be partly filled: always kept.
  if (visible > 0) block_score[(visible - 1) / block_size] = kInf;
  std::vector<int64_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  const int64_t keep = std::clamp<int64_t>(top_blocks, 0, blocks);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&](int64_t a, int64_t b) { return ranks_before(block_score[a], a, block_score[b], b); });
  std::fill(mask, mask + n, uint8_t{0});
  for (int64_t i = 0; i < keep; ++i) {
    const int64_t b = order[i];
    if (block_score[b] == -kInf) continue;
    std::fill(mask + b * block_size, mask + std::min(n, (b + 1) * block_size), uint8_t{1});
  }
}

void select_topk(const float* scores, int64_t n, int64_t n_visible, int64_t k, int32_t* picks) {
  std::vector<int64_t> eligible;
  for (int64_t j = 0; j < std::min(n, n_visible); ++j)
    if (scores[j] != -kInf) eligible.push_back(j);
  const int64_t taken = std::min<int64_t>(k, static_cast<int64_t>(eligible.size()));
  std::partial_sort(eligible.begin(), eligible.begin() + taken, eligible.end(),
                    [&](int64_t a, int64_t b) { return ranks_before(scores[a], a, scores[b], b); });
  std::sort(eligible.begin(), eligible.begin() + taken);
  for (int64_t i = 0; i < k; ++i) picks[i] = i < taken ? static_cast<int32_t>(eligible[i]) : -1;
}

void sparse_attention(const float* q, int64_t heads, int64_t dim, const float* const* rows, int64_t n,
                      const float* sink, float scale, bool bf16, float* out) {
  std::vector<float> logit(static_cast<size_t>(n));
  std::vector<float> acc(static_cast<size_t>(dim));
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * dim;
    float m = -kInf;
    for (int64_t i = 0; i < n; ++i) {
      logit[i] = dot(qh, rows[i], dim) * scale;
      m = std::max(m, logit[i]);
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    double sum = 0.0;  // rounded once, like the dot products
    for (int64_t i = 0; i < n; ++i) {
      const float e = std::exp(logit[i] - m);
      sum += e;
      const float weight = maybe_bf16(e, bf16);
      for (int64_t c = 0; c < dim; ++c) acc[c] += weight * rows[i][c];
    }
    const float denominator = static_cast<float>(sum + std::exp(sink[h] - m));
    float* oh = out + h * dim;
    for (int64_t c = 0; c < dim; ++c) oh[c] = maybe_bf16(n > 0 ? acc[c] / denominator : 0.0f, bf16);
  }
}

}  // namespace dsv4::reference

// The reference operations (src/reference/ops.h) against independent computations written here:
// double-precision formulas, brute-force selections, the SPEC's worked numbers, and SPEC §8.1's
// rounding sequence of every bf16 path spelled out one scalar at a time (bit-exact: the sequence
// is deterministic). Inputs come from fixed seeds. Bounds: where a bound is not bit equality, its
// comment gives the error measured on these inputs and why the bound is a small multiple of it.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "dsv4/error.h"
#include "dsv4/numeric.h"
#include "reference/ops.h"

namespace dsv4::reference {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> random_values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

bool is_bf16(float x) { return round_to_bf16(x) == x; }

// |a − b| within a bf16 rounding of the double formula (half an ulp is 2^-9 relative; one ulp
// allows for the fp32 sum landing on the other side of a rounding boundary than the double one).
// A coarse check of the formula; the rounding sequence itself is checked bit for bit by
// ReferenceOpsBf16.*.
void expect_bf16_close(float a, double b, const char* what) {
  EXPECT_TRUE(is_bf16(a)) << what;
  EXPECT_LE(std::abs(a - b), std::abs(b) * 0x1p-7 + 1e-30) << what << ": " << a << " vs " << b;
}

// The largest error |a − b| / max(|b|, 1) a test sees against a double formula, checked against
// its bound and printed ("measured ...") when the meter goes out of scope, so that a run shows the
// measurement each bound was derived from.
class ErrorMeter {
 public:
  ErrorMeter(const char* what, double bound) : what_(what), bound_(bound) {}
  ~ErrorMeter() {
    std::printf("measured %s: %.3g (bound %.3g)\n", what_, worst_, bound_);
    EXPECT_LE(worst_, bound_) << what_;
  }
  void add(double a, double b) { worst_ = std::max(worst_, std::abs(a - b) / std::max(std::abs(b), 1.0)); }

 private:
  const char* what_;
  double bound_, worst_ = 0;
};

double dot_double(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// ---------------------------------------------------------------------------------------------

TEST(ReferenceOps, LinearMatchesTheDoubleProduct) {
  const int64_t n = 5, in = 70, out = 13;  // 70: a tail after the 8-wide sums
  const auto x = random_values(n * in, 1), w = random_values(out * in, 2);
  std::vector<float> y(n * out), y16(n * out);
  linear(x.data(), n, in, w.data(), out, y.data(), {});
  linear(x.data(), n, in, w.data(), out, y16.data(), {.bf16_output = true});
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < out; ++o) {
      const double expected = dot_double(x.data() + t * in, w.data() + o * in, in);
      EXPECT_EQ(y[t * out + o], static_cast<float>(expected));  // one rounding of the exact dot
      expect_bf16_close(y16[t * out + o], expected, "bf16 output");
    }
}

TEST(ReferenceOps, LinearQuantizesActivationsToFp8PerBlock) {
  const int64_t n = 3, in = 64, out = 7;
  auto x = random_values(n * in, 3);
  x[5] = 40.0f;  // one large value sets the scale of the first block only
  const auto w = random_values(out * in, 4);
  std::vector<float> y(n * out);
  linear(x.data(), n, in, w.data(), out, y.data(), {.fp8_activation_block = 32});
  std::vector<float> quantized = x;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < in; c += 32) fake_quant_fp8_ue8m0(&quantized[t * in + c], &quantized[t * in + c], 32);
  ASSERT_NE(quantized, x);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < out; ++o)
      EXPECT_EQ(y[t * out + o], static_cast<float>(dot_double(quantized.data() + t * in, w.data() + o * in, in)));
  // The large value coarsens its own block (scale 2^-3: steps of up to 2^-3) but not the second one.
  EXPECT_NE(quantized[1], x[1]);
  for (int64_t c = 32; c < 64; ++c) EXPECT_NEAR(quantized[c], x[c], std::abs(x[c]) / 16 + 0x1p-10);
}

TEST(ReferenceOps, GroupedLinearProjectsEachGroupWithItsOwnWeights) {
  const int64_t n = 3, groups = 2, in = 24, rank = 5;
  const auto o = random_values(n * groups * in, 5), w = random_values(groups * rank * in, 6);
  std::vector<float> y(n * groups * rank);
  grouped_linear(o.data(), n, groups, in, w.data(), rank, y.data(), false);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < rank; ++r)
        EXPECT_EQ(y[(t * groups + g) * rank + r],
                  static_cast<float>(dot_double(o.data() + (t * groups + g) * in, w.data() + (g * rank + r) * in, in)));
}

TEST(ReferenceOps, RmsNormWithAndWithoutWeight) {
  // Measured 8.2e-8 (a few fp32 roundings of values up to ~3); bound 4x.
  ErrorMeter fp32("rms_norm fp32 vs double", 3e-7);
  const int64_t n = 4, dim = 48;
  const auto x = random_values(n * dim, 7, 3.0f), weight = random_values(dim, 8);
  std::vector<float> y(n * dim), plain(n * dim), y16(n * dim);
  rms_norm(x.data(), n, dim, weight.data(), 1e-6f, y.data(), false);
  rms_norm(x.data(), n, dim, nullptr, 1e-6f, plain.data(), false);
  rms_norm(x.data(), n, dim, weight.data(), 1e-6f, y16.data(), true);
  for (int64_t r = 0; r < n; ++r) {
    const double rms = std::sqrt(dot_double(x.data() + r * dim, x.data() + r * dim, dim) / dim + 1e-6);
    for (int64_t c = 0; c < dim; ++c) {
      const double normalized = x[r * dim + c] / rms;
      fp32.add(plain[r * dim + c], normalized);
      fp32.add(y[r * dim + c], weight[c] * normalized);
      expect_bf16_close(y16[r * dim + c], weight[c] * normalized, "bf16 rms_norm");
    }
  }
  // In place, and eps 1e-20 on a zero row gives zeros, not NaN.
  std::vector<float> zero(dim, 0.0f);
  rms_norm(zero.data(), 1, dim, weight.data(), 1e-20f, zero.data(), true);
  for (float v : zero) EXPECT_EQ(v, 0.0f);
}

TEST(ReferenceOps, RopeFrequenciesPlainAndYarn) {
  RopeParams plain{.theta = 10000.0};
  const auto f = rope_frequencies(plain, 64);
  ASSERT_EQ(f.size(), 32u);
  // Relative errors: measured ~1e-7 (fp32 pow and division, a few ulps); bounds 4x.
  ErrorMeter plain_error("rope frequencies vs double (relative)", 4e-7), yarn_error("YaRN frequencies vs double (relative)", 6e-7);
  for (int i = 0; i < 32; ++i) plain_error.add(f[i] / std::pow(10000.0, -2.0 * i / 64), 1.0);

  // SPEC §2.4: base 160000, original 65536, factor 16, betas 32 / 1 give low 15 and high 25.
  RopeParams yarn{.theta = 160000.0, .yarn = true, .factor = 16.0, .original_max_position = 65536,
                  .beta_fast = 32.0, .beta_slow = 1.0};
  const auto g = rope_frequencies(yarn, 64);
  for (int i = 0; i < 32; ++i) {
    const double base = std::pow(160000.0, -2.0 * i / 64);
    const double ramp = std::clamp((i - 15.0) / 10.0, 0.0, 1.0);
    const double expected = base / 16.0 * ramp + base * (1.0 - ramp);
    yarn_error.add(g[i] / expected, 1.0);
  }
  EXPECT_FLOAT_EQ(g[15], static_cast<float>(std::pow(160000.0, -30.0 / 64)));  // untouched below low
  EXPECT_NEAR(g[31], std::pow(160000.0, -62.0 / 64) / 16.0, 1e-6 * g[31]);     // fully scaled above high
}

TEST(ReferenceOps, RopeRotatesInterleavedPairsOfTheTail) {
  // Measured 5.8e-8 and 6.0e-8 (fp32 cos / sin and products); bounds 4x.
  ErrorMeter rotation("rope fp32 vs double", 2.5e-7), round_trip("rope forward + inverse", 2.5e-7);
  const int64_t n = 3, heads = 2, head_dim = 24, rope_dim = 8;
  const auto x = random_values(n * heads * head_dim, 9);
  const std::vector<float> freqs = {1.0f, 0.5f, 0.125f, 0.01f};
  const std::vector<int64_t> positions = {0, 7, 1000};
  std::vector<float> y = x;
  apply_rope(y.data(), n, heads, head_dim, freqs.data(), rope_dim, positions.data(), false, false);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const float* a = x.data() + (t * heads + h) * head_dim;
      const float* b = y.data() + (t * heads + h) * head_dim;
      for (int64_t c = 0; c < head_dim - rope_dim; ++c) EXPECT_EQ(b[c], a[c]);
      for (int64_t i = 0; i < rope_dim / 2; ++i) {
        const double angle = static_cast<double>(static_cast<float>(positions[t]) * freqs[i]);
        const double re = a[head_dim - rope_dim + 2 * i], im = a[head_dim - rope_dim + 2 * i + 1];
        rotation.add(b[head_dim - rope_dim + 2 * i], re * std::cos(angle) - im * std::sin(angle));
        rotation.add(b[head_dim - rope_dim + 2 * i + 1], re * std::sin(angle) + im * std::cos(angle));
      }
    }
  apply_rope(y.data(), n, heads, head_dim, freqs.data(), rope_dim, positions.data(), true, false);
  for (size_t i = 0; i < x.size(); ++i) round_trip.add(y[i], x[i]);
}

// Tiles quantize independently: a tile of tiny values next to a tile of large ones keeps its
// precision (one scale for both would flush it to zero).
TEST(ReferenceOps, FakeQuantizationScalesEachTileOnItsOwn) {
  struct Case { const char* name; int64_t tile; void (*quantize)(float*, int64_t, int64_t); double tolerance; };
  const Case cases[] = {
      {"fp8 32", 32, [](float* x, int64_t n, int64_t d) { fake_quant_fp8_rows(x, n, d, d, 32); }, 1.0 / 16},
      {"fp4 ue8m0 32", 32, [](float* x, int64_t n, int64_t d) { fake_quant_fp4_ue8m0_rows(x, n, d); }, 0.5},
      {"fp4 e4m3 16", 16, [](float* x, int64_t n, int64_t d) { fake_quant_fp4_e4m3_rows(x, n, d); }, 0.5},
  };
  for (const Case& c : cases) {
    const int64_t dim = 4 * c.tile;
    auto x = random_values(2 * dim, 10);
    for (int64_t i = 0; i < c.tile; ++i) x[i] *= 1e-3f, x[c.tile + i] *= 1e3f;
    std::vector<float> q = x;
    c.quantize(q.data(), 2, dim);
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t t = 0; t < 4; ++t) {
        float amax = 0;
        for (int64_t i = 0; i < c.tile; ++i) amax = std::max(amax, std::abs(x[r * dim + t * c.tile + i]));
        for (int64_t i = 0; i < c.tile; ++i) {
          const int64_t k = r * dim + t * c.tile + i;
          EXPECT_LE(std::abs(q[k] - x[k]), c.tolerance * amax) << c.name << " element " << k;
        }
      }
    std::vector<float> again = q;
    c.quantize(again.data(), 2, dim);
    EXPECT_EQ(again, q) << c.name << ": quantized values are on the grid";
  }
  // V4.0 rows: only the NoPE channels, 64-channel tiles; the RoPE tail stays as it is.
  auto row = random_values(192, 11);
  std::vector<float> q = row;
  fake_quant_fp8_rows(q.data(), 1, 192, 128, 64);
  EXPECT_NE(std::vector<float>(q.begin(), q.begin() + 128), std::vector<float>(row.begin(), row.begin() + 128));
  EXPECT_EQ(std::vector<float>(q.begin() + 128, q.end()), std::vector<float>(row.begin() + 128, row.end()));
}

// ---------------------------------------------------------------------------------------------
// Compressor

// Σ_s softmax_s(score + bias) · kv per channel in double; absent slots (null kv) are skipped.
std::vector<double> pool_double(const std::vector<const float*>& kv, const std::vector<const float*>& score,
                                const std::vector<const float*>& bias, int64_t dim) {
  std::vector<double> out(dim);
  for (int64_t c = 0; c < dim; ++c) {
    double m = -INFINITY, denominator = 0, sum = 0;
    for (size_t s = 0; s < kv.size(); ++s)
      if (kv[s]) m = std::max(m, static_cast<double>(score[s][c]) + (bias[s] ? bias[s][c] : 0.0));
    for (size_t s = 0; s < kv.size(); ++s) {
      if (!kv[s]) continue;
      const double e = std::exp(score[s][c] + (bias[s] ? bias[s][c] : 0.0) - m);
      denominator += e;
      sum += e * kv[s][c];
    }
    out[c] = sum / denominator;
  }
  return out;
}

TEST(ReferenceOps, SoftmaxPoolPerChannel) {
  // Measured 1.1e-7 (fp32 exponentials and sums); bound 4x.
  ErrorMeter pool("softmax_pool fp32 vs double", 4.5e-7);
  const int64_t dim = 16, slots = 4;
  const auto values = random_values(slots * dim * 3, 12, 4.0f);
  std::vector<const float*> kv, score, bias;
  for (int64_t s = 0; s < slots; ++s) {
    kv.push_back(&values[s * dim]);
    score.push_back(&values[(slots + s) * dim]);
    bias.push_back(s == 2 ? nullptr : &values[(2 * slots + s) * dim]);
  }
  kv[1] = nullptr;  // absent slot
  std::vector<float> out(dim);
  softmax_pool(kv.data(), score.data(), bias.data(), slots, dim, out.data());
  const auto expected = pool_double(kv, score, bias, dim);
  for (int64_t c = 0; c < dim; ++c) pool.add(out[c], expected[c]);

  // No gate: the single slot is copied.
  softmax_pool(kv.data(), nullptr, nullptr, 1, dim, out.data());
  EXPECT_EQ(out, std::vector<float>(kv[0], kv[0] + dim));
}

// V4.0 CSA (overlap, bias), HCA (bias), V4.1 ratio 2 (no bias) and ratio 1 (no gate) entries from
// projected token rows, against the pooling formulas of SPEC §3.2 / §12 written out here.
TEST(ReferenceOps, CompressedEntriesPoolTheirWindows) {
  // Measured 1.8e-7 (fp32 exponentials and sums over up to 8 slots); bound 4x.
  ErrorMeter pool("compressed entries fp32 vs double", 7e-7);
  const int64_t dim = 8, ratio = 4;
  for (const bool overlap : {true, false}) {
    const CompressorGeometry g{.ratio = ratio, .overlap = overlap, .gated = true, .dim = dim};
    const int64_t coff = overlap ? 2 : 1, width = g.row_width();
    const auto rows = random_values(3 * ratio * width, 13, 2.0f);
    const auto bias = random_values(ratio * coff * dim, 14);
    const auto row = [&](int64_t p) { return rows.data() + p * width; };
    for (int64_t w : {0, 1, 2}) {
      std::vector<float> pooled(dim);
      pool_compressed_entry(g, w, row, bias.data(), pooled.data());
      std::vector<const float*> kv, score, b;
      if (overlap)  // first series (channels [0, dim)) of window w − 1
        for (int64_t s = 0; s < ratio; ++s) {
          kv.push_back(w > 0 ? row((w - 1) * ratio + s) : nullptr);
          score.push_back(w > 0 ? row((w - 1) * ratio + s) + coff * dim : nullptr);
          b.push_back(bias.data() + s * coff * dim);
        }
      for (int64_t s = 0; s < ratio; ++s) {  // last series of window w
        kv.push_back(row(w * ratio + s) + (coff - 1) * dim);
        score.push_back(row(w * ratio + s) + coff * dim + (coff - 1) * dim);
        b.push_back(bias.data() + s * coff * dim + (coff - 1) * dim);
      }
      const auto expected = pool_double(kv, score, b, dim);
      for (int64_t c = 0; c < dim; ++c) pool.add(pooled[c], expected[c]);
    }
  }
  // V4.1 ratio 2 without bias; ratio 1 is the token's projection itself.
  const CompressorGeometry r2{.ratio = 2, .overlap = false, .gated = true, .dim = dim};
  const auto rows = random_values(4 * r2.row_width(), 15);
  const auto row2 = [&](int64_t p) { return rows.data() + p * r2.row_width(); };
  std::vector<float> pooled(dim);
  pool_compressed_entry(r2, 1, row2, nullptr, pooled.data());
  const auto expected = pool_double({row2(2), row2(3)}, {row2(2) + dim, row2(3) + dim}, {nullptr, nullptr}, dim);
  for (int64_t c = 0; c < dim; ++c) pool.add(pooled[c], expected[c]);
  const CompressorGeometry r1{.ratio = 1, .overlap = false, .gated = false, .dim = dim};
  const auto row1 = [&](int64_t p) { return rows.data() + p * dim; };
  pool_compressed_entry(r1, 3, row1, nullptr, pooled.data());
  EXPECT_EQ(pooled, std::vector<float>(row1(3), row1(3) + dim));
}

// ---------------------------------------------------------------------------------------------
// Indexer

TEST(ReferenceOps, IndexScoresSumWeightedReluOverHeads) {
  // Measured 2.5e-8 (the fp32 sum over 4 heads); bound 4x.
  ErrorMeter fp32("index scores fp32 vs double", 1e-7);
  const int64_t heads = 4, dim = 32, n = 9, visible = 6;
  const auto q = random_values(heads * dim, 16), w = random_values(heads, 17), keys = random_values(n * dim, 18);
  std::vector<float> s(n), s16(n);
  index_scores(q.data(), w.data(), heads, dim, keys.data(), n, visible, false, s.data());
  index_scores(q.data(), w.data(), heads, dim, keys.data(), n, visible, true, s16.data());
  for (int64_t j = 0; j < n; ++j) {
    if (j >= visible) {
      EXPECT_EQ(s[j], -kInf);
      EXPECT_EQ(s16[j], -kInf);
      continue;
    }
    double expected = 0, expected16 = 0;
    for (int64_t h = 0; h < heads; ++h) {
      const double d = dot_double(q.data() + h * dim, keys.data() + j * dim, dim);
      expected += w[h] * std::max(d, 0.0);
      // bf16 as the reference's tensor ops: the dot, each weighted term, then the sum.
      const float d16 = round_to_bf16(static_cast<float>(d));
      expected16 += round_to_bf16(std::max(d16, 0.0f) * w[h]);
    }
    fp32.add(s[j], expected);
    expect_bf16_close(s16[j], expected16, "bf16 score");
  }
}

// Brute force: block b is kept iff it is the newest visible position's block, or it has a finite
// max and fewer than top_blocks blocks rank before it (higher max, or equal max and lower index).
std::vector<uint8_t> candidate_mask_brute_force(const std::vector<float>& scores, int64_t visible, int64_t block,
                                                int64_t top) {
  const int64_t n = static_cast<int64_t>(scores.size()), blocks = (n + block - 1) / block;
  std::vector<double> best(blocks, -INFINITY);
  for (int64_t j = 0; j < std::min(n, visible); ++j)
    if (!std::isnan(scores[j])) best[j / block] = std::max(best[j / block], static_cast<double>(scores[j]));
  if (visible > 0) best[(std::min(n, visible) - 1) / block] = INFINITY;
  std::vector<uint8_t> mask(n, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t before = 0;
    for (int64_t a = 0; a < blocks; ++a) before += best[a] > best[b] || (best[a] == best[b] && a < b);
    if (best[b] != -INFINITY && before < top)
      for (int64_t j = b * block; j < std::min(n, (b + 1) * block); ++j) mask[j] = 1;
  }
  return mask;
}

// Brute force: j is picked iff eligible and fewer than k eligible entries rank before it.
std::vector<int32_t> topk_brute_force(const std::vector<float>& scores, int64_t visible, int64_t k) {
  const int64_t n = static_cast<int64_t>(scores.size());
  const auto eligible = [&](int64_t j) { return j < visible && scores[j] != -kInf; };
  const auto before = [&](int64_t a, int64_t b) {  // a ranks before b
    if (std::isnan(scores[a]) || std::isnan(scores[b])) return !std::isnan(scores[a]) || (std::isnan(scores[b]) && a < b);
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::vector<int32_t> picks;
  for (int64_t j = 0; j < n; ++j) {
    if (!eligible(j)) continue;
    int64_t ahead = 0;
    for (int64_t a = 0; a < n; ++a) ahead += a != j && eligible(a) && before(a, j);
    if (ahead < k) picks.push_back(static_cast<int32_t>(j));
  }
  picks.resize(k, -1);
  return picks;
}

// Scores from a small set of values so that ties are frequent, with −inf and NaN sprinkled in.
std::vector<float> tied_scores(int64_t n, std::mt19937& rng) {
  const float values[] = {-1.5f, -0.25f, 0.0f, 0.0f, 0.5f, 0.5f, 2.0f, -kInf, kNaN};
  std::uniform_int_distribution<int> pick(0, 8);
  std::vector<float> s(n);
  for (float& x : s) x = values[pick(rng)];
  return s;
}

TEST(ReferenceOps, CandidateBlocksMatchBruteForce) {
  std::mt19937 rng(19);
  int64_t cases_with_exclusions = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + trial % 37, block = 1 + trial % 4, top = 1 + trial % 5;
    const int64_t visible = std::uniform_int_distribution<int64_t>(0, n)(rng);
    std::vector<float> scores = tied_scores(n, rng);
    for (int64_t j = visible; j < n; ++j) scores[j] = -kInf;  // causally masked, as the indexer hands them over
    std::vector<uint8_t> mask(n);
    select_candidate_blocks(scores.data(), n, visible, block, top, mask.data());
    ASSERT_EQ(mask, candidate_mask_brute_force(scores, visible, block, top)) << "trial " << trial;
    const int64_t kept = std::count(mask.begin(), mask.begin() + visible, 1);
    cases_with_exclusions += kept < visible;
    if (visible > 0) {
      EXPECT_EQ(mask[visible - 1], 1) << "the newest visible position is always kept";
    }
  }
  EXPECT_GT(cases_with_exclusions, 50);
}

TEST(ReferenceOps, TopkMatchesBruteForceWithTiesNaNAndPadding) {
  std::mt19937 rng(20);
  int64_t padded = 0, full = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t n = trial % 30, k = 1 + trial % 9;
    const int64_t visible = std::uniform_int_distribution<int64_t>(0, n + 2)(rng);
    const std::vector<float> scores = tied_scores(n, rng);
    std::vector<int32_t> picks(k);
    select_topk(scores.data(), n, visible, k, picks.data());
    const std::vector<int32_t> expected = topk_brute_force(scores, visible, k);
    ASSERT_EQ(picks, expected) << "trial " << trial;
    padded += picks.back() == -1;
    full += picks.back() != -1;
  }
  EXPECT_GT(padded, 50);  // fewer eligible entries than k
  EXPECT_GT(full, 50);    // more eligible entries than k
}

// ---------------------------------------------------------------------------------------------
// Attention

TEST(ReferenceOps, SparseAttentionWithSinkMatchesTheDoubleSoftmax) {
  // Measured 6.6e-8 (fp32 exponentials and the weighted sum over 11 rows); bound 4x.
  ErrorMeter fp32("sparse attention fp32 vs double", 2.7e-7);
  const int64_t heads = 3, dim = 40, n = 11;
  const auto q = random_values(heads * dim, 21, 2.0f), values = random_values(n * dim, 22), sink = random_values(heads, 23);
  std::vector<const float*> rows;
  for (int64_t i = 0; i < n; ++i) rows.push_back(values.data() + i * dim);
  const float scale = 0.3f;
  std::vector<float> out(heads * dim), out16(heads * dim);
  sparse_attention(q.data(), heads, dim, rows.data(), n, sink.data(), scale, false, out.data());
  sparse_attention(q.data(), heads, dim, rows.data(), n, sink.data(), scale, true, out16.data());
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<double> logit(n);
    double m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, logit[i] = scale * dot_double(q.data() + h * dim, rows[i], dim));
    double denominator = std::exp(sink[h] - m);
    for (int64_t i = 0; i < n; ++i) denominator += std::exp(logit[i] - m);
    for (int64_t c = 0; c < dim; ++c) {
      double sum = 0, sum16 = 0;
      for (int64_t i = 0; i < n; ++i) {
        sum += std::exp(logit[i] - m) * rows[i][c];
        sum16 += round_to_bf16(static_cast<float>(std::exp(logit[i] - m))) * rows[i][c];
      }
      fp32.add(out[h * dim + c], sum / denominator);
      expect_bf16_close(out16[h * dim + c], sum16 / denominator, "bf16 attention");
    }
  }
  // A dominant sink takes the whole probability mass; no rows give zeros.
  const std::vector<float> big_sink(heads, 80.0f);
  sparse_attention(q.data(), heads, dim, rows.data(), n, big_sink.data(), scale, false, out.data());
  for (float v : out) EXPECT_NEAR(v, 0.0f, 1e-20);
  sparse_attention(q.data(), heads, dim, rows.data(), 0, sink.data(), scale, false, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// The bf16 paths against SPEC §8.1's rounding sequence, evaluated step by step here: every
// intermediate the reference rounds is rounded at the same point, everything else stays fp32,
// dot products are exact sums rounded once to fp32. The sequence is deterministic, so the
// comparisons are bit equality (EXPECT_EQ on floats; −0 == +0 is the only slack).

// Σ a·b rounded once to fp32: products are exact in double, the sum runs in long double (64-bit
// mantissa), so only the final rounding is visible at fp32 (a different summation than ops.cpp).
float exact_dot(const float* a, const float* b, int64_t n) {
  long double s = 0;
  for (int64_t i = n - 1; i >= 0; --i) s += static_cast<long double>(static_cast<double>(a[i]) * b[i]);
  return static_cast<float>(s);
}

float bf16(float x) { return round_to_bf16(x); }

// linear with bf16 output: y = bf16(fp32(x·w)); with fp8 activations x is first fake-quantized
// per 32-column block (SPEC §8.2 act_quant).
TEST(ReferenceOpsBf16, LinearFollowsTheRoundingSequence) {
  const int64_t n = 6, in = 96, out = 11;
  const auto x = random_values(n * in, 31, 3.0f), w = random_values(out * in, 32);
  std::vector<float> y(n * out), yq(n * out);
  linear(x.data(), n, in, w.data(), out, y.data(), {.bf16_output = true});
  linear(x.data(), n, in, w.data(), out, yq.data(), {.fp8_activation_block = 32, .bf16_output = true});
  std::vector<float> xq = x;
  for (int64_t i = 0; i < n * in; i += 32) fake_quant_fp8_ue8m0(&xq[i], &xq[i], 32);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t o = 0; o < out; ++o) {
      EXPECT_EQ(y[t * out + o], bf16(exact_dot(&x[t * in], &w[o * in], in))) << t << "," << o;
      EXPECT_EQ(yq[t * out + o], bf16(exact_dot(&xq[t * in], &w[o * in], in))) << t << "," << o;
    }
  // Ties: 1 + 2^-8 and 1 + 3·2^-8 lie halfway between bf16 neighbours (ulp 2^-7 at 1); round to
  // nearest even gives 1 and 1 + 2^-6; −(1 + 2^-8) gives −1. Truncation or ties-away fail here.
  const float tx[] = {1.0f, 0x1p-8f, 1.0f, 0x1.8p-7f, -1.0f, -0x1p-8f};
  const float tw[] = {1.0f, 1.0f};
  float ty[3];
  linear(tx, 3, 2, tw, 1, ty, {.bf16_output = true});
  EXPECT_EQ(ty[0], 1.0f);
  EXPECT_EQ(ty[1], 1.0f + 0x1p-6f);
  EXPECT_EQ(ty[2], -1.0f);
}

TEST(ReferenceOpsBf16, GroupedLinearFollowsTheRoundingSequence) {
  const int64_t n = 3, groups = 4, in = 40, rank = 6;
  const auto o = random_values(n * groups * in, 33, 2.0f), w = random_values(groups * rank * in, 34);
  std::vector<float> y(n * groups * rank);
  grouped_linear(o.data(), n, groups, in, w.data(), rank, y.data(), true);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < rank; ++r)
        EXPECT_EQ(y[(t * groups + g) * rank + r], bf16(exact_dot(&o[(t * groups + g) * in], &w[(g * rank + r) * in], in)));
}

// RMSNorm (SPEC §8.1): mean of squares in fp32, r = 1/sqrt(mean + eps) in fp32, y = bf16(weight ·
// (x · r)) with the weight multiply in fp32.
float rms_norm_step(const float* x, int64_t dim, const float* weight, float eps, int64_t c) {
  long double squares = 0;
  for (int64_t i = 0; i < dim; ++i) squares += static_cast<long double>(static_cast<double>(x[i]) * x[i]);
  const float mean = static_cast<float>(squares / dim);  // rounded once
  const float r = 1.0f / std::sqrt(mean + eps);
  const float normalized = x[c] * r;
  return bf16(weight ? weight[c] * normalized : normalized);
}

TEST(ReferenceOpsBf16, RmsNormFollowsTheRoundingSequence) {
  const int64_t n = 5, dim = 64;
  auto x = random_values(n * dim, 35, 4.0f);
  const auto weight = random_values(dim, 36, 2.0f);
  // Rows 3 and 4 sit where eps matters (SPEC §8.3: eps 1e-20): mean square 1e-20 = eps and
  // 1e-24 ≪ eps. Elsewhere mean squares ≫ eps and eps's placement would be invisible.
  for (int64_t c = 0; c < dim; ++c) x[3 * dim + c] = c % 2 ? 1e-10f : -1e-10f, x[4 * dim + c] = x[dim + c] * 1e-12f;
  const float eps = 1e-20f;
  std::vector<float> y(n * dim), plain(n * dim);
  rms_norm(x.data(), n, dim, weight.data(), eps, y.data(), true);
  rms_norm(x.data(), n, dim, nullptr, eps, plain.data(), true);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < dim; ++c) {
      EXPECT_EQ(y[r * dim + c], rms_norm_step(&x[r * dim], dim, weight.data(), eps, c)) << r << "," << c;
      EXPECT_EQ(plain[r * dim + c], rms_norm_step(&x[r * dim], dim, nullptr, eps, c)) << r << "," << c;
    }
  // Closed forms of the eps rows: x / sqrt(x² + eps) = ±1/√2 at mean square = eps (eps outside the
  // square root, or dropped, gives ±1); at mean square ≈ 5e-24 the norm is x / sqrt(eps + 5e-24) ≈
// x · 1e10: 2.5e-4 relative from the mean square plus 2^-9 from bf16, bound 4e-3 relative (a
// dropped eps gives ~45x).
  for (int64_t c = 0; c < dim; ++c) {
    EXPECT_EQ(std::abs(plain[3 * dim + c]), bf16(0.70710678f)) << c;
    EXPECT_NEAR(plain[4 * dim + c], x[4 * dim + c] * 1e10, 4e-3 * std::abs(x[4 * dim + c] * 1e10)) << c;
  }
}

// RoPE (SPEC §2.3, §8.1): angle fp32 = float(p) · f_i, cos/sin in fp32, the complex product in
// fp32, each output rounded to bf16.
TEST(ReferenceOpsBf16, RopeFollowsTheRoundingSequence) {
  const int64_t n = 4, heads = 3, head_dim = 20, rope_dim = 8;
  const auto x = random_values(n * heads * head_dim, 37, 2.0f);
  const std::vector<float> freqs = {1.0f, 0.37f, 0.0625f, 0.0011f};
  const std::vector<int64_t> positions = {0, 5, 4096, 65537};
  for (const bool inverse : {false, true}) {
    std::vector<float> y = x;
    apply_rope(y.data(), n, heads, head_dim, freqs.data(), rope_dim, positions.data(), inverse, true);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* a = &x[(t * heads + h) * head_dim];
        const float* b = &y[(t * heads + h) * head_dim];
        for (int64_t c = 0; c < head_dim - rope_dim; ++c) EXPECT_EQ(b[c], a[c]) << "NoPE channels are untouched";
        for (int64_t i = 0; i < rope_dim / 2; ++i) {
          const float angle = static_cast<float>(positions[t]) * freqs[i];
          const float cs = std::cos(angle), sn = inverse ? -std::sin(angle) : std::sin(angle);
          const float re = a[head_dim - rope_dim + 2 * i], im = a[head_dim - rope_dim + 2 * i + 1];
          EXPECT_EQ(b[head_dim - rope_dim + 2 * i], bf16(re * cs - im * sn)) << t << "," << h << "," << i;
          EXPECT_EQ(b[head_dim - rope_dim + 2 * i + 1], bf16(re * sn + im * cs)) << t << "," << h << "," << i;
        }
      }
  }
}

// Index scores (SPEC §4.3, §8.1): each head's dot rounded to bf16, ReLU, times the head weight in
// fp32 and rounded to bf16, summed over heads in fp32 (head order), the sum rounded to bf16;
// `partial` leaves the sum unrounded.
TEST(ReferenceOpsBf16, IndexScoresFollowTheRoundingSequence) {
  const int64_t heads = 8, dim = 64, n = 40, visible = 33;
  const auto q = random_values(heads * dim, 38), w = random_values(heads, 39, 0.3f), keys = random_values(n * dim, 40);
  std::vector<float> s(n), partial(n);
  index_scores(q.data(), w.data(), heads, dim, keys.data(), n, visible, true, s.data());
  index_scores(q.data(), w.data(), heads, dim, keys.data(), n, visible, true, partial.data(), true);
  for (int64_t j = 0; j < visible; ++j) {
    float sum = 0.0f;
    for (int64_t h = 0; h < heads; ++h)
      sum += bf16(std::max(bf16(exact_dot(&q[h * dim], &keys[j * dim], dim)), 0.0f) * w[h]);
    EXPECT_EQ(partial[j], sum) << j;
    EXPECT_EQ(s[j], bf16(sum)) << j;
  }
  for (int64_t j = visible; j < n; ++j) EXPECT_EQ(s[j], -kInf);
  // Ties at each rounding: the dot 1 + 2^-8 rounds to 1 (even); times weight 1 + 2^-7 gives
  // 1 + 2^-7 exactly; a second head adds 2^-8 · 1: 1 + 3·2^-8, a tie that rounds up to 1 + 2^-6.
  const float tq[] = {1.0f, 0x1p-8f, 0x1p-8f, 0.0f}, tw[] = {1.0f + 0x1p-7f, 1.0f}, tk[] = {1.0f, 1.0f};
  float ts;
  index_scores(tq, tw, 2, 2, tk, 1, 1, true, &ts);
  EXPECT_EQ(ts, 1.0f + 0x1p-6f);
}

// Sparse attention (SPEC §5.2, §8.1): logits fp32 (dot · scale), e_i = exp(logit_i − m) in fp32,
// the denominator Σ e_i + exp(sink − m) unrounded (here: in double), e_i rounded to bf16 before
// it weighs the values, the weighted sum in fp32 in row order, the output rounded to bf16.
TEST(ReferenceOpsBf16, SparseAttentionFollowsTheRoundingSequence) {
  const int64_t heads = 4, dim = 48, n = 23;
  const auto q = random_values(heads * dim, 41, 2.0f), values = random_values(n * dim, 42), sink = random_values(heads, 43);
  std::vector<const float*> rows;
  for (int64_t i = 0; i < n; ++i) rows.push_back(&values[i * dim]);
  const float scale = 0.125f;
  std::vector<float> out(heads * dim);
  sparse_attention(q.data(), heads, dim, rows.data(), n, sink.data(), scale, true, out.data());
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<float> e(n);
    float m = -kInf;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, e[i] = exact_dot(&q[h * dim], rows[i], dim) * scale);
    double denominator = std::exp(sink[h] - m);
    for (int64_t i = 0; i < n; ++i) denominator += e[i] = std::exp(e[i] - m);
    for (int64_t c = 0; c < dim; ++c) {
      float acc = 0.0f;
      for (int64_t i = 0; i < n; ++i) acc += bf16(e[i]) * rows[i][c];
      EXPECT_EQ(out[h * dim + c], bf16(acc / static_cast<float>(denominator))) << h << "," << c;
    }
  }
}

// Compressor pooling (SPEC §3.2, §8.1: fp32): logit = score + bias, m = max, e_s = exp(logit − m),
// the denominator summed in fp32 in slot order, pooled = Σ_s kv_s · (e_s / denominator) in fp32.
TEST(ReferenceOpsBf16, SoftmaxPoolFollowsTheFp32Sequence) {
  const int64_t dim = 24, slots = 8;
  const auto values = random_values(3 * slots * dim, 44, 3.0f);
  std::vector<const float*> kv, score, bias;
  for (int64_t s = 0; s < slots; ++s) {
    kv.push_back(s == 0 ? nullptr : &values[s * dim]);  // slot 0 absent (V4.0 CSA entry 0)
    score.push_back(&values[(slots + s) * dim]);
    bias.push_back(&values[(2 * slots + s) * dim]);
  }
  std::vector<float> pooled(dim);
  softmax_pool(kv.data(), score.data(), bias.data(), slots, dim, pooled.data());
  for (int64_t c = 0; c < dim; ++c) {
    float m = -kInf, denominator = 0.0f, sum = 0.0f;
    for (int64_t s = 1; s < slots; ++s) m = std::max(m, score[s][c] + bias[s][c]);
    for (int64_t s = 1; s < slots; ++s) denominator += std::exp(score[s][c] + bias[s][c] - m);
    for (int64_t s = 1; s < slots; ++s) sum += kv[s][c] * (std::exp(score[s][c] + bias[s][c] - m) / denominator);
    EXPECT_EQ(pooled[c], sum) << c;
  }
}

// ---------------------------------------------------------------------------------------------
// The V4.0 official indexer QAT (SPEC §15.2): FP4Q and the Hadamard rotation.

// FP4Q as DeepSeek's V4.0 kernel.py writes it, built here from the formula alone: amax floored at
// 6·2^-126; s = 2^(e − 127 + (m ≠ 0)) from the fp32 bits (e, m) of amax · fp32(1/6) (a product,
// where the code under test divides); x/s clamped to ±6 and rounded to the nearest e2m1 grid
// point, a tie to the point with the even code (the grid's index), the sign kept.
float official_fp4q(float x, float amax) {
  constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float floored = std::max(amax, 6.0f * std::ldexp(1.0f, -126));
  const uint32_t bits = std::bit_cast<uint32_t>(floored * (1.0f / 6.0f));
  const int e = static_cast<int>(bits >> 23), m = static_cast<int>(bits & 0x7fffff);
  const float s = std::ldexp(1.0f, e - 127 + (m != 0));
  const float a = std::min(std::abs(x / s), 6.0f);
  int best = 0;
  for (int i = 1; i < 8; ++i) {
    const float d = std::abs(a - kGrid[i]), d_best = std::abs(a - kGrid[best]);
    if (d < d_best || (d == d_best && i % 2 == 0)) best = i;
  }
  return std::copysign(kGrid[best] * s, x);
}

// Every bf16 value in [-8, 8] in a 32-channel tile whose amax comes from itself or from another
// channel (zero, tiny, exact powers of two, 6·2^k, values just off them, large): the whole table.
TEST(ReferenceOps, V40Fp4QuantizerMatchesTheOfficialFormulaOnEveryBf16Input) {
  const float others[] = {0.0f, 0x1p-130f, 0x1p-20f, 0.1f, 0.75f, 1.0f, 1.5f, 3.0f, 6.0f, 6.0625f, 5.96875f,
                          7.0f, 8.0f, 12.0f, 24.0f, 96.0f, 1000.0f};
  int64_t checked = 0;
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const float v = std::bit_cast<float>(code << 16);
    if (!(std::abs(v) <= 8.0f)) continue;
    for (float other : others) {
      std::vector<float> tile(32, 0.0f);
      tile[0] = v;
      tile[17] = -other;
      const float amax = std::max(std::abs(v), other);
      fake_quant_fp4_ue8m0_rows(tile.data(), 1, 32);
      ASSERT_EQ(std::bit_cast<uint32_t>(tile[0]), std::bit_cast<uint32_t>(official_fp4q(v, amax)))
          << std::hexfloat << "x " << v << " amax " << amax;
      ASSERT_EQ(tile[17], official_fp4q(-other, amax)) << std::hexfloat << "x " << -other << " amax " << amax;
      ASSERT_TRUE(is_bf16(tile[0]));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 0x4101 * 17);  // codes 0 … 0x4100 (8.0) and their negatives, -0 included
}

// SPEC §15.4's edge cases.
TEST(ReferenceOps, V40Fp4QuantizerEdgeCases) {
  std::vector<float> zeros(32, 0.0f);
  zeros[3] = -0.0f;
  fake_quant_fp4_ue8m0_rows(zeros.data(), 1, 32);
  for (float z : zeros) EXPECT_EQ(z, 0.0f);
  EXPECT_TRUE(std::signbit(zeros[3]));  // -0 stays -0
  std::vector<float> tile(32, 0.0f);
  tile[0] = 48.0f;  // amax exactly 6·2^3: s = 8, reaches ±6 unsaturated
  tile[1] = -48.0f;
  tile[2] = 1.99f;  // below s/4 = 2: flushes to 0
  tile[3] = 2.0f;   // exactly s/4: a tie, to the even code 0
  tile[4] = 2.01f;  // above: 0.5·s = 4
  tile[5] = 20.0f;  // 2.5·s: a tie between 2 and 3, to the even code (2·s = 16)
  fake_quant_fp4_ue8m0_rows(tile.data(), 1, 32);
  EXPECT_EQ(tile[0], 48.0f);
  EXPECT_EQ(tile[1], -48.0f);
  EXPECT_EQ(tile[2], 0.0f);
  EXPECT_EQ(tile[3], 0.0f);
  EXPECT_EQ(tile[4], 4.0f);
  EXPECT_EQ(tile[5], 16.0f);
}

// The Sylvester Hadamard matrix applied by its definition, H_ij = (−1)^popcount(i & j), in double.
std::vector<double> hadamard_by_definition(const float* x, int64_t dim) {
  std::vector<double> y(static_cast<size_t>(dim), 0.0);
  for (int64_t i = 0; i < dim; ++i)
    for (int64_t j = 0; j < dim; ++j) y[i] += (std::popcount(static_cast<uint64_t>(i & j)) % 2 ? -1.0 : 1.0) * x[j];
  for (double& v : y) v /= std::sqrt(static_cast<double>(dim));
  return y;
}

TEST(ReferenceOps, HadamardMatchesTheMatrixDefinition) {
  for (int64_t dim : {1, 2, 8, 128, 256}) {
    const int64_t rows = 5;
    std::vector<float> x = random_values(rows * dim, 40 + static_cast<uint32_t>(dim), 3.0f);
    round_bf16(x.data(), rows * dim);  // the indexer's inputs are bf16
    for (bool bf16_output : {false, true}) {
      std::vector<float> y = x;
      hadamard_rows(y.data(), rows, dim, bf16_output);
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<double> expected = hadamard_by_definition(&x[r * dim], dim);
        for (int64_t c = 0; c < dim; ++c) {
          // Sums of bf16 values are exact in double: one rounding of the exact result.
          const float exact = static_cast<float>(expected[c]);
          EXPECT_EQ(y[r * dim + c], bf16_output ? round_to_bf16(exact) : exact) << "dim " << dim << " row " << r << " col " << c;
        }
      }
    }
  }
  std::vector<float> unit(128, 0.0f), constant(128, 1.0f);
  unit[0] = 1.0f;
  hadamard_rows(unit.data(), 1, 128, false);
  hadamard_rows(constant.data(), 1, 128, false);
  for (int64_t c = 0; c < 128; ++c) {
    EXPECT_EQ(unit[c], static_cast<float>(1.0 / std::sqrt(128.0)));
    EXPECT_EQ(constant[c], c == 0 ? static_cast<float>(std::sqrt(128.0)) : 0.0f);
  }
  EXPECT_THROW(hadamard_rows(unit.data(), 1, 96, false), Error);
}

// H/√d is symmetric and orthonormal: applying it twice gives the input back, up to the roundings
// of the two passes (fp32: a few ulps of the row's scale; bf16: a bf16 ulp of it). It also keeps
// the row's norm and every dot product (what the indexer's scores rely on).
TEST(ReferenceOps, HadamardIsItsOwnInverseWithinRounding) {
  const int64_t rows = 64, dim = 128;
  std::vector<float> x = random_values(rows * dim, 41, 4.0f);
  round_bf16(x.data(), rows * dim);
  for (bool bf16_output : {false, true}) {
    std::vector<float> once = x, twice = x;
    hadamard_rows(once.data(), rows, dim, bf16_output);
    twice = once;
    hadamard_rows(twice.data(), rows, dim, bf16_output);
    for (int64_t r = 0; r < rows; ++r) {
      double largest = 0, norm_x = 0, norm_once = 0, dot_xy = 0, dot_once = 0;
      for (int64_t c = 0; c < dim; ++c) largest = std::max(largest, std::abs(static_cast<double>(x[r * dim + c])));
      const int64_t other = (r + 1) % rows;
      for (int64_t c = 0; c < dim; ++c) {
        const double bound = bf16_output ? std::ldexp(largest, -7) : std::ldexp(largest, -21);
        EXPECT_NEAR(twice[r * dim + c], x[r * dim + c], bound) << "row " << r << " col " << c << " bf16 " << bf16_output;
        norm_x += static_cast<double>(x[r * dim + c]) * x[r * dim + c];
        norm_once += static_cast<double>(once[r * dim + c]) * once[r * dim + c];
        dot_xy += static_cast<double>(x[r * dim + c]) * x[other * dim + c];
        dot_once += static_cast<double>(once[r * dim + c]) * once[other * dim + c];
      }
      const double tolerance = bf16_output ? 1e-2 : 1e-6;
      EXPECT_NEAR(norm_once, norm_x, tolerance * norm_x) << "row " << r;
      EXPECT_NEAR(dot_once, dot_xy, tolerance * norm_x) << "row " << r;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Thread counts: every parallel loop of ops.cpp at a size above kMinParallelWork (below it the
// loop runs on one thread and the comparison would be vacuous), 1 vs 4 threads, bit equality;
// and the multi-threaded result against the step-by-step sequence on a sample.
TEST(ReferenceOps, ResultsDoNotDependOnTheThreadCount) {
  const int64_t n = 96, in = 256, out = 96;  // linear: 96·96·256 = 2.4M multiply-adds
  const int64_t groups = 4, rank = 96;       // grouped: 96·4·96·64 = 2.4M
  const int64_t rows = 8192;                 // rms_norm, fake quantization, rounding: 8192·256 = 2.1M
  static_assert(n * out * in >= kMinParallelWork && n * groups * rank * (in / groups) >= kMinParallelWork);
  static_assert(rows * in >= kMinParallelWork && rows * 4 * 64 >= kMinParallelWork);
  const auto x = random_values(rows * in, 24, 3.0f), w = random_values(out * in, 25), weight = random_values(in, 26);
  std::vector<int64_t> positions(rows);
  for (int64_t t = 0; t < rows; ++t) positions[t] = t * 7;
  const std::vector<float> freqs = rope_frequencies({.theta = 10000.0}, 64);
  const auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<std::vector<float>> r(6);
    r[0].resize(n * out);
    linear(x.data(), n, in, w.data(), out, r[0].data(), {.fp8_activation_block = 32, .bf16_output = true});
    r[1].resize(n * groups * rank);
    grouped_linear(x.data(), n, groups, in / groups, w.data(), rank, r[1].data(), true);
    r[2].resize(rows * in);
    rms_norm(x.data(), rows, in, weight.data(), 1e-20f, r[2].data(), true);
    r[3] = x;  // [rows, 4 heads, 64]: the whole head is rotated
    apply_rope(r[3].data(), rows, 4, 64, freqs.data(), 64, positions.data(), false, true);
    r[4] = x;
    fake_quant_fp8_rows(r[4].data(), rows, in, in, 32);
    r[5] = x;
    round_bf16(r[5].data(), rows * in);
    omp_set_num_threads(saved);
    return r;
  };
  const auto one = run(1), four = run(4);
  const char* names[] = {"linear", "grouped_linear", "rms_norm", "apply_rope", "fake_quant_fp8_rows", "round_bf16"};
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(one[i] == four[i]) << names[i];
  std::vector<float> xq(x.begin(), x.begin() + n * in);
  for (int64_t i = 0; i < n * in; i += 32) fake_quant_fp8_ue8m0(&xq[i], &xq[i], 32);
  for (int64_t t = 0; t < n; t += 13)
    for (int64_t o = 0; o < out; ++o) EXPECT_EQ(four[0][t * out + o], bf16(exact_dot(&xq[t * in], &w[o * in], in)));
  for (int64_t r = 0; r < rows; r += 997)
    for (int64_t c = 0; c < in; ++c) EXPECT_EQ(four[2][r * in + c], rms_norm_step(&x[r * in], in, weight.data(), 1e-20f, c));
}

}  // namespace
}  // namespace dsv4::reference

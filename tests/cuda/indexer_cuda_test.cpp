// Indexer kernels against the CPU reference: run_index_scores vs reference::index_scores (keys
// decoded from MXFP4 / FP8 / bf16 caches; fp32 within a tolerance, bf16_rounding bit for bit),
// run_topk vs reference::select_topk and run_candidate_block_scores + run_topk vs
// reference::select_candidate_blocks on identical scores (exact: the selection rules are the
// same, ties included).
//
// Score tolerance (fp32): a different summation order over the channels and the heads. -inf
// entries must match exactly. Every implementation that supports a case on the device runs it: the
// tensor-core ones (wgmma, mma_f16: FP4 queries, sm_90) bit for bit in bf16_rounding, their exact
// MXFP4 dots within the same fp32 tolerance, mma_f16's index_fp8 block sums within the fp8 MMA's
// accumulation bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "cuda/cuda_test_util.h"
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/indexer_launch.h"
#include "dsv4/cuda/indexer.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;
using testing::DeviceTensor;

constexpr int64_t kIndexDim = 128;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct ScoresCase {
  KvRowFormat key_format = KvRowFormat::index_mxfp4;
  int64_t heads = 32;
  int64_t dim = kIndexDim;
  bool bf16_rounding = false;                       // and then bit equality with the reference
  bool partial = false;
  int ratio = 2;
  std::vector<std::pair<int32_t, int32_t>> tokens;  // (sequence, position)
  int64_t candidate_block_size = 0;                 // > 0: random candidate lists
  int64_t candidate_blocks = 0;
  uint32_t seed = 1;
  bool fp4_queries = false;                         // q FP4 fake-quantized (SPEC §4.2), fp4_queries set
  int block_exponent_step = 0;                      // channel block b of q and keys scaled by 2^(step·b)
  bool spoil_query = false;                         // token 0, head 0 gets a value that is not FP4
  int key_exponent_shift = 0;                       // keys scaled by 2^shift
  int key_block_exponent_step = 0;                  // channel block b of the keys (only) scaled by 2^(step·b)
  std::vector<std::pair<int64_t, float>> head_weights;  // (head, weight): every token's weight of that head
  bool other_weights_zero = false;                  // with head_weights: the other heads' weights are 0
  bool extreme_weights = false;                     // token 0 head 1's weight subnormal, token 1 head 2's 2^120
  bool cancelling_heads = false;                    // odd heads: the even one's query, about minus its weight
  int64_t rows_per_page = 64;
  DType q_dtype = DType::bf16;                      // f32: Precision::fp32's queries, not rounded
  const char* implementation = nullptr;             // the expected pick on an sm_90 device
};

// The tensor-core implementation the chooser takes on sm_90 for FP4 queries.
const char* fp4_pick(KvRowFormat keys, int64_t heads) {
  return keys == KvRowFormat::index_mxfp4 && heads <= 32 ? "wgmma" : "mma_f16";
}

// x [n, dim] with channel block b (32 channels) scaled by 2^(step·b).
void scale_blocks(std::vector<float>& x, int64_t dim, int step) {
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::ldexp(x[i], step * static_cast<int>((i % dim) / 32));
}

void check_index_scores(const ScoresCase& c) {
  std::mt19937 rng(c.seed);
  const int64_t tokens = static_cast<int64_t>(c.tokens.size());
  int64_t max_position = 0, sequences = 0;
  for (const auto& [s, p] : c.tokens) {
    max_position = std::max<int64_t>(max_position, p);
    sequences = std::max<int64_t>(sequences, s + 1);
  }
  const int64_t entries = (max_position + 1) / c.ratio + 3, dim = c.dim;
  testing::HostPagedCache keys = testing::make_host_cache(c.key_format, dim, c.rows_per_page, PagePlacement::segregated,
                                                          std::vector<int32_t>(sequences, 0), entries / c.rows_per_page + 1, 1,
                                                          c.seed);
  // keys[s] [entries, dim]: the decoded rows the reference scores against.
  std::vector<std::vector<float>> decoded(sequences);
  for (int64_t s = 0; s < sequences; ++s)
    for (int64_t j = 0; j < entries; ++j) {
      auto row = testing::random_floats(dim, c.seed * 7919 + static_cast<uint32_t>(s * entries + j), -2.0f, 2.0f);
      scale_blocks(row, dim, c.block_exponent_step + c.key_block_exponent_step);
      for (float& x : row) x = std::ldexp(x, c.key_exponent_shift);
      keys.write(s, j, row.data());
      const auto back = keys.read(s, j);
      decoded[s].insert(decoded[s].end(), back.begin(), back.end());
    }
  auto q = testing::random_floats(tokens * c.heads * dim, c.seed + 1);
  if (c.fp4_queries) {
    scale_blocks(q, dim, c.block_exponent_step);
    for (size_t i = 0; i < q.size(); i += 32) fake_quant_fp4_ue8m0(q.data() + i, q.data() + i, 32);
    if (c.spoil_query) q[1] = q[0] == 0.0f ? 0.30078125f : q[0] * 1.0078125f;  // 8 significant bits: no e2m1
  }
  if (c.q_dtype == DType::bf16) q = testing::rounded_to_bf16(q);
  // The engine's head weights are bf16 values of either sign in reference precision.
  auto weights = testing::random_floats(tokens * c.heads, c.seed + 2, c.bf16_rounding ? -0.1f : 0.0f, 0.1f);
  if (c.extreme_weights) weights[1] = 1e-40f, weights[c.heads + 2] = std::ldexp(1.0f, 120);
  if (c.other_weights_zero) std::fill(weights.begin(), weights.end(), 0.0f);
  for (int64_t t = 0; t < tokens; ++t)
    for (const auto& [h, w] : c.head_weights) weights[t * c.heads + h] = w;
  if (c.cancelling_heads)  // head pairs whose terms nearly cancel: sums far below their magnitudes
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 1; h < c.heads; h += 2) {
        std::copy_n(q.begin() + (t * c.heads + h - 1) * dim, dim, q.begin() + (t * c.heads + h) * dim);
        weights[t * c.heads + h] = -weights[t * c.heads + h - 1] * (h % 4 == 1 ? 1.0f : 1.015625f);
      }
  if (c.bf16_rounding) weights = testing::rounded_to_bf16(weights);

  std::vector<int32_t> sequence(tokens), position(tokens), candidates;
  for (int64_t t = 0; t < tokens; ++t) std::tie(sequence[t], position[t]) = c.tokens[t];
  if (c.candidate_block_size > 0) {
    // Each token keeps a random ascending subset of the blocks, -1 padded.
    const int64_t blocks = (entries + c.candidate_block_size - 1) / c.candidate_block_size;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> kept;
      for (int32_t b = 0; b < blocks; ++b)
        if (rng() % 2 == 0 && static_cast<int64_t>(kept.size()) < c.candidate_blocks) kept.push_back(b);
      kept.resize(static_cast<size_t>(c.candidate_blocks), -1);
      candidates.insert(candidates.end(), kept.begin(), kept.end());
    }
  }

  std::vector<float> expected(static_cast<size_t>(tokens * entries));
  // index_fp8 keys on the fp8 MMA: a block sum may lose bits below about 2^-13 of its running
  // magnitude; bounded by 2^-8 Σ_h |w_h| Σ_d |q_hd k_d| per score.
  const bool fp8_mma = c.fp4_queries && c.key_format == KvRowFormat::index_fp8;
  std::vector<float> extra(fp8_mma ? expected.size() : 0);
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = expected.data() + t * entries;
    reference::index_scores(q.data() + t * c.heads * dim, weights.data() + t * c.heads, c.heads, dim,
                            decoded[sequence[t]].data(), entries, (position[t] + 1) / c.ratio, c.bf16_rounding, row,
                            c.partial);
    if (c.spoil_query)  // the head's dots are NaN, and so is every score
      for (int64_t j = 0; j < entries && t == 0; ++j)
        if (row[j] != -kInf) row[j] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < entries && fp8_mma; ++j) {
      double mass = 0.0;
      for (int64_t h = 0; h < c.heads; ++h) {
        double products = 0.0;
        for (int64_t d = 0; d < dim; ++d)
          products += std::fabs(static_cast<double>(q[(t * c.heads + h) * dim + d]) * decoded[sequence[t]][j * dim + d]);
        mass += std::fabs(weights[t * c.heads + h]) * products;
      }
      extra[t * entries + j] = static_cast<float>(std::ldexp(mass, -8));
    }
    if (c.candidate_block_size > 0)
      for (int64_t j = 0; j < entries; ++j) {
        const int32_t* list = candidates.data() + t * c.candidate_blocks;
        if (std::find(list, list + c.candidate_blocks, j / c.candidate_block_size) == list + c.candidate_blocks)
          row[j] = -kInf;
      }
  }

  DeviceTensor dq = testing::device_tensor(q, c.q_dtype, {tokens, c.heads, dim});
  DeviceTensor dw = testing::device_tensor(weights, DType::f32, {tokens, c.heads});
  DeviceTensor dseq = testing::device_array(sequence, DType::i32, {tokens});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
  testing::DevicePagedCache dkeys = testing::to_device_cache(keys);
  IndexScoresParams p{.q = dq.view, .weights = dw.view, .keys = dkeys.view, .token_sequence = dseq.view,
                      .token_position = dpos.view, .compress_ratio = c.ratio,
                      .scores = testing::fake_device_view(DType::f32, {tokens, entries}),
                      .bf16_rounding = c.bf16_rounding, .partial = c.partial, .fp4_queries = c.fp4_queries};
  DeviceTensor dcandidates;
  if (c.candidate_block_size > 0) {
    dcandidates = testing::device_array(candidates, DType::i32, {tokens, c.candidate_blocks});
    p.candidates = dcandidates.view;
    p.candidate_block_size = c.candidate_block_size;
  }
  if (c.implementation && device_info().compute_capability == 90)
    EXPECT_STREQ(index_scores_implementation(p), c.implementation);
  validate_index_scores(p);
  // Every implementation that takes the call on this device, each into freshly poisoned scores.
  Stream stream;
  for (const IndexScoresImplementation* implementation : index_scores_implementations()) {
    if (!implementation->supports(p, device_info()).empty()) continue;
    // A query that is not FP4 breaks fp4_queries' promise: only the implementations that read the
    // codes (the tensor-core ones) turn it into NaN; SIMT computes with the values it was given.
    if (c.spoil_query && implementation == &kIndexScoresSimt) continue;
    DeviceTensor out = testing::poisoned_tensor(DType::f32, {tokens, entries});
    p.scores = out.view;
    implementation->run(p, stream.get());
    stream.synchronize("index scores test");
    const std::vector<float> got = testing::download_floats(out.view);
    SCOPED_TRACE(implementation->name);
    if (c.bf16_rounding) {
      // The reference's rounding sequence, bit for bit (the inputs are NaN-free).
      int64_t differ = 0, first = -1;
      for (size_t i = 0; i < got.size(); ++i)
        if (float_bits(got[i]) != float_bits(expected[i]) && !(std::isnan(got[i]) && std::isnan(expected[i])) &&
            differ++ == 0)
          first = static_cast<int64_t>(i);
      EXPECT_EQ(differ, 0) << differ << " of " << got.size() << " bf16 scores differ (dim " << dim << ", heads "
                           << c.heads << ", partial " << c.partial << ", fp4 queries " << c.fp4_queries
                           << "); first: token " << first / entries << " entry " << first % entries << ": got "
                           << (first < 0 ? 0.0f : got[first]) << ", expected " << (first < 0 ? 0.0f : expected[first]);
      continue;
    }
    // fp32 on both sides, other summation orders: measured on an H200 |Δ| <= 1.9e-6, |Δ| / |score|
    // <= 2.2e-7 (0.2 of this bound).
    testing::expect_close(got, expected, 1e-5f, 1e-6f, "index scores", extra);
  }
}

TEST_F(CudaTest, IndexScoresMxfp4Ratio2) {
  check_index_scores({.key_format = KvRowFormat::index_mxfp4, .heads = 32, .ratio = 2,
                      .tokens = {{0, 0}, {0, 1}, {1, 40}, {2, 299}, {1, 41}, {2, 300}}, .seed = 3});
}

TEST_F(CudaTest, IndexScoresFp8Ratio1PrefillWithCandidates) {
  ScoresCase c{.key_format = KvRowFormat::index_fp8, .heads = 5, .ratio = 1, .candidate_block_size = 8,
               .candidate_blocks = 7, .seed = 4};
  for (int32_t p = 130; p < 161; ++p) c.tokens.push_back({0, p});
  check_index_scores(c);
}

TEST_F(CudaTest, IndexScoresBf16KeysManyEntryBlocks) {
  check_index_scores({.key_format = KvRowFormat::bf16, .heads = 64, .ratio = 1, .tokens = {{0, 700}, {0, 3}}, .seed = 5});
}

// Precision::fp32: f32 queries against f32 keys (the SIMT kernel), with candidates, at the
// register-row dims and through the any-dim kernel.
TEST_F(CudaTest, IndexScoresFp32QueriesAndKeys) {
  check_index_scores({.key_format = KvRowFormat::f32, .heads = 32, .ratio = 4,
                      .tokens = {{0, 0}, {0, 3}, {1, 250}, {1, 251}}, .seed = 25, .q_dtype = DType::f32});
  check_index_scores({.key_format = KvRowFormat::f32, .heads = 7, .dim = 64, .ratio = 1, .tokens = {{0, 90}, {0, 91}},
                      .candidate_block_size = 8, .candidate_blocks = 5, .seed = 26, .q_dtype = DType::f32});
  check_index_scores({.key_format = KvRowFormat::f32, .heads = 3, .dim = 96, .ratio = 2, .tokens = {{0, 77}},
                      .seed = 27, .q_dtype = DType::f32});
}

// Other index_dims (64 and 128 keep the key row in registers, 96 and 512 take the any-dim kernel)
// and more heads than shared memory holds at once (200 heads of 128, 40 of 512: staged).
TEST_F(CudaTest, IndexScoresOtherDimsAndManyHeads) {
  check_index_scores({.heads = 7, .dim = 64, .ratio = 4, .tokens = {{0, 517}, {1, 2}, {0, 300}}, .seed = 21});
  check_index_scores({.key_format = KvRowFormat::index_fp8, .heads = 32, .dim = 96, .ratio = 1,
                      .tokens = {{0, 140}, {0, 141}}, .candidate_block_size = 8, .candidate_blocks = 9, .seed = 22});
  check_index_scores({.key_format = KvRowFormat::bf16, .heads = 200, .ratio = 2, .tokens = {{0, 333}}, .seed = 23});
  check_index_scores({.heads = 40, .dim = 512, .ratio = 1, .tokens = {{0, 200}, {1, 77}}, .seed = 24});
}

// bf16_rounding: the reference's bf16 scores bit for bit, over the dims, head counts, key formats,
// candidates and partial (tensor-parallel split) sums; odd entry counts (visible + 3).
TEST_F(CudaTest, IndexScoresBf16RoundingEqualsReferenceBitForBit) {
  for (const int64_t dim : {64, 96, 128})
    for (const int64_t heads : {1, 7, 32}) {
      const uint32_t seed = static_cast<uint32_t>(100 + dim + heads);
      check_index_scores({.key_format = KvRowFormat::index_mxfp4, .heads = heads, .dim = dim, .bf16_rounding = true,
                          .ratio = 4, .tokens = {{0, 0}, {0, 3}, {1, 418}, {0, 259}, {1, 419}}, .seed = seed});
      check_index_scores({.key_format = KvRowFormat::index_fp8, .heads = heads, .dim = dim, .bf16_rounding = true,
                          .ratio = 1, .tokens = {{0, 150}, {0, 151}, {0, 152}}, .candidate_block_size = 8,
                          .candidate_blocks = 11, .seed = seed + 1});
      check_index_scores({.key_format = KvRowFormat::bf16, .heads = heads, .dim = dim, .bf16_rounding = true,
                          .partial = true, .ratio = 2, .tokens = {{0, 301}, {1, 20}}, .seed = seed + 2});
    }
  check_index_scores({.key_format = KvRowFormat::bf16, .heads = 200, .bf16_rounding = true, .ratio = 1,
                      .tokens = {{0, 260}, {0, 1}}, .seed = 301});
  check_index_scores({.heads = 40, .dim = 512, .bf16_rounding = true, .ratio = 1, .tokens = {{0, 129}}, .seed = 302});
}

// The tensor-core implementations (FP4 queries; wgmma up to 32 heads, mma_f16 every count): the
// reference's bf16 scores bit for bit over index dims, head counts (5: a padded n tile; 64: two
// head-sum passes of mma_f16), tokens that see nothing (positions 0-2 at ratio 4), entries past one
// 1024-entry chunk and not a multiple of 16, candidates, partial sums, and block exponents up to 6,
// 18 and 30 octaves apart (up to 9: fp32 block sums; beyond: the dot's double path).
TEST_F(CudaTest, IndexScoresTensorCoresBf16RoundingEqualsReferenceBitForBit) {
  const std::vector<std::pair<int32_t, int32_t>> decode = {{0, 0}, {0, 3}, {1, 4400}, {0, 1259}, {1, 4401}, {2, 2}};
  for (const int64_t dim : {64, 128})
    for (const int64_t heads : {5, 32, 64}) {
      const uint32_t seed = static_cast<uint32_t>(500 + dim + heads);
      check_index_scores({.heads = heads, .dim = dim, .bf16_rounding = true, .ratio = 4, .tokens = decode, .seed = seed,
                          .fp4_queries = true, .implementation = fp4_pick(KvRowFormat::index_mxfp4, heads)});
      check_index_scores({.heads = heads, .dim = dim, .bf16_rounding = true, .ratio = 4, .tokens = decode,
                          .candidate_block_size = 8, .candidate_blocks = 40, .seed = seed + 1, .fp4_queries = true,
                          .implementation = fp4_pick(KvRowFormat::index_mxfp4, heads)});
      check_index_scores({.heads = heads, .dim = dim, .bf16_rounding = true, .partial = true, .ratio = 2,
                          .tokens = {{0, 1301}, {1, 20}}, .seed = seed + 2, .fp4_queries = true,
                          .implementation = fp4_pick(KvRowFormat::index_mxfp4, heads)});
    }
  for (const int step : {1, 3, 5})  // fp32 block sums (rows with several scales), double, double
    check_index_scores({.heads = 32, .dim = 128, .bf16_rounding = true, .ratio = 1, .tokens = {{0, 700}, {1, 1500}},
                        .seed = static_cast<uint32_t>(600 + step), .fp4_queries = true, .block_exponent_step = step,
                        .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)});
}

// The tensor-core implementations in fp32 precision: exact MXFP4 dots (the reference's tolerance), index_fp8 keys within
// the fp8 accumulation bound; index_fp8 with bf16_rounding goes to the SIMT kernel.
TEST_F(CudaTest, IndexScoresTensorCoresFp32) {
  for (const int64_t dim : {64, 128}) {
    const uint32_t seed = static_cast<uint32_t>(700 + dim);
    check_index_scores({.heads = 32, .dim = dim, .ratio = 2, .tokens = {{0, 0}, {0, 1}, {1, 1040}, {2, 299}, {1, 41}},
                        .seed = seed, .fp4_queries = true, .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)});
    check_index_scores({.key_format = KvRowFormat::index_fp8, .heads = 5, .dim = dim, .ratio = 1,
                        .tokens = {{0, 530}, {0, 531}, {1, 7}}, .candidate_block_size = 8, .candidate_blocks = 30,
                        .seed = seed + 1, .fp4_queries = true, .implementation = fp4_pick(KvRowFormat::index_fp8, 5)});
    check_index_scores({.key_format = KvRowFormat::index_fp8, .heads = 32, .dim = dim, .bf16_rounding = true,
                        .ratio = 1, .tokens = {{0, 150}, {1, 151}}, .seed = seed + 2, .fp4_queries = true,
                        .implementation = "simt"});
  }
}

// Prefill chunks (both tensor-core implementations): a CTA takes one token per 64 of the step (up
// to 8 as shared memory allows; 151 tokens: 2, 200: 3, 520: 8 or fewer), and consecutive tokens of
// one sequence share its key loads (wgmma: its A operands too): runs of one sequence that do not
// align with the CTAs' tokens, odd run lengths, and alternating sequences.
TEST_F(CudaTest, IndexScoresTensorCoresPrefillChunks) {
  ScoresCase runs{.heads = 32, .ratio = 1, .seed = 801, .fp4_queries = true, .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
  for (int32_t p = 600; p < 675; ++p) runs.tokens.push_back({0, p});
  for (int32_t p = 1000; p < 1076; ++p) runs.tokens.push_back({1, p});
  check_index_scores(runs);
  runs.bf16_rounding = true;
  check_index_scores(runs);
  runs.candidate_block_size = 8;
  runs.candidate_blocks = 60;
  runs.seed = 802;
  check_index_scores(runs);
  ScoresCase eight{.heads = 8, .dim = 64, .bf16_rounding = true, .ratio = 1, .seed = 803, .fp4_queries = true,
                   .implementation = fp4_pick(KvRowFormat::index_mxfp4, 8)};
  for (int32_t p = 300; p < 473; ++p) eight.tokens.push_back({0, p});
  for (int32_t p = 900; p < 1100; ++p) eight.tokens.push_back({1, p});
  for (int32_t p = 50; p < 197; ++p) eight.tokens.push_back({2, p});
  check_index_scores(eight);
  ScoresCase alternating{.heads = 16, .dim = 64, .bf16_rounding = true, .ratio = 2, .seed = 804, .fp4_queries = true,
                         .implementation = fp4_pick(KvRowFormat::index_mxfp4, 16)};
  for (int32_t t = 0; t < 200; ++t) alternating.tokens.push_back({t % 3, 900 + 17 * t});
  check_index_scores(alternating);
}

// The wgmma kernels weight the fast rows' dots with hs·w, the head's power of two folded into its
// weight, only where that is exact (fp4_dots.cuh, "Folded weights"): a token with a subnormal
// weight or one whose folded weight overflows takes the plain path, and so do (bf16_rounding) key
// rows whose scales are too small for the bf16 rounding to commute with hs. Decode tokens (one per
// CTA) and a prefill run, both precisions.
TEST_F(CudaTest, IndexScoresTensorCoresWeightsThatDoNotFoldAndTinyKeys) {
  for (const bool bf16_rounding : {true, false}) {
    ScoresCase c{.heads = 32, .bf16_rounding = bf16_rounding, .ratio = 1, .tokens = {{0, 700}, {1, 900}, {2, 300}},
                 .seed = 1001, .fp4_queries = true, .extreme_weights = true,
                 .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
    check_index_scores(c);
    c.tokens.clear();
    for (int32_t p = 400; p < 470; ++p) c.tokens.push_back({0, p});
    check_index_scores(c);
    c.extreme_weights = false;
    c.key_exponent_shift = -116;  // ue8m0 scales of about 2^-117: P = dot / hs is subnormal
    c.seed = 1002;
    check_index_scores(c);
    c.tokens = {{0, 500}, {1, 333}};
    check_index_scores(c);
  }
}

// The wgmma kernels form a fast row's terms from P' = P·2^-ek0 and scale the score by 2^ek0 only
// where no product leaves the normal range and nothing overflows in either scaling (fp4_dots.cuh,
// "Row factor"); each case breaks one condition, and the kernels must see it:
//   - tiny keys four blocks 2^3 apart and a weight of 2^117 (hs·w about 2^126): P'·hs·w overflows
//     where P·hs·w is about 2^27;
//   - huge keys and one head of weight 2^-126 (the others 0): on rows with small dots P'·hs·w is a
//     bf16 subnormal (fewer significant bits) where P·hs·w is about 2^-25;
//   - huge keys and two heads of weights ±2^28: the reference's terms overflow to +inf and -inf
//     (NaN scores), P''s stay finite.
// Decode tokens and a prefill run.
TEST_F(CudaTest, IndexScoresTensorCoresRowFactorAtItsLimits) {
  ScoresCase overflow{.heads = 32, .bf16_rounding = true, .ratio = 1, .seed = 1301, .fp4_queries = true,
                      .key_exponent_shift = -100, .key_block_exponent_step = 3, .head_weights = {{2, std::ldexp(1.0f, 117)}},
                      .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
  ScoresCase subnormal{.heads = 32, .bf16_rounding = true, .ratio = 1, .seed = 1302, .fp4_queries = true,
                       .key_exponent_shift = 100, .head_weights = {{0, std::ldexp(1.0f, -126)}}, .other_weights_zero = true,
                       .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
  ScoresCase cancelled{.heads = 32, .bf16_rounding = true, .ratio = 1, .seed = 1303, .fp4_queries = true,
                       .key_exponent_shift = 100, .head_weights = {{0, std::ldexp(1.0f, 28)}, {1, -std::ldexp(1.0f, 28)}},
                       .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
  for (ScoresCase* c : {&overflow, &subnormal, &cancelled}) {
    c->tokens = {{0, 700}, {1, 900}, {2, 300}};
    check_index_scores(*c);
    c->tokens.clear();
    for (int32_t p = 400; p < 470; ++p) c->tokens.push_back({0, p});
    check_index_scores(*c);
  }
  overflow.bf16_rounding = false;
  check_index_scores(overflow);
}

// Head pairs whose terms cancel exactly or to within 2^-6: the scores are far below the terms'
// magnitudes, where any other order of the head sum than the reference's shows in the bf16 scores
// (and exact cancellations must give +0). Decode tokens, a prefill run and a padded head tile.
TEST_F(CudaTest, IndexScoresTensorCoresTermsThatCancel) {
  ScoresCase c{.heads = 32, .bf16_rounding = true, .ratio = 1, .tokens = {{0, 900}, {1, 1300}}, .seed = 1101,
               .fp4_queries = true, .cancelling_heads = true, .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
  check_index_scores(c);
  c.tokens.clear();
  for (int32_t p = 500; p < 580; ++p) c.tokens.push_back({0, p});
  check_index_scores(c);
  c.heads = 6, c.dim = 64, c.seed = 1102, c.implementation = fp4_pick(KvRowFormat::index_mxfp4, 6);
  check_index_scores(c);
}

// The wgmma kernel copies pages of whole 64-row segments with tensor copies (one thread, a tensor
// map) and other pages row by row with cp.async: pages of 128 and 192 rows (a stage then spans two
// pages), and of 32 rows (cp.async), at both index dims, for tokens of three sequences and for 80
// tokens of one (both one token a CTA: token runs always take cp.async).
TEST_F(CudaTest, IndexScoresTensorCoresPageShapes) {
  for (const int64_t dim : {64, 128})
    for (const int64_t rows : {128, 192, 32}) {
      ScoresCase c{.heads = 32, .dim = dim, .bf16_rounding = true, .ratio = 1, .tokens = {{0, 700}, {1, 1100}, {2, 0}},
                   .seed = static_cast<uint32_t>(1200 + rows + dim), .fp4_queries = true, .rows_per_page = rows,
                   .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)};
      check_index_scores(c);
      c.tokens.clear();
      for (int32_t p = 300; p < 380; ++p) c.tokens.push_back({0, p});
      c.bf16_rounding = false;
      check_index_scores(c);
    }
}

// fp4_queries promises FP4 values: a head with a block that is not FP4 gets NaN dots (every score
// of its token is NaN) rather than silently wrong ones.
TEST_F(CudaTest, IndexScoresTensorCoresQueryThatIsNotFp4GivesNaN) {
  check_index_scores({.heads = 32, .bf16_rounding = true, .ratio = 1, .tokens = {{0, 300}, {1, 40}}, .seed = 901,
                      .fp4_queries = true, .spoil_query = true, .implementation = fp4_pick(KvRowFormat::index_mxfp4, 32)});
}

// Rows of scores with many ties (few distinct values), NaN and -inf, as in bf16 reference scores.
std::vector<float> tie_heavy_scores(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> s(static_cast<size_t>(n));
  for (float& x : s) {
    const uint32_t r = rng() % 100;
    x = r < 3 ? std::numeric_limits<float>::quiet_NaN() : r < 10 ? -kInf : r < 12 ? kInf
      : r < 14 ? -0.0f : static_cast<float>(static_cast<int>(rng() % 41) - 20) * 0.25f;
  }
  return s;
}

// Rows of mixed scores: bf16 values of a small set (ties) next to fp32 values over many binades
// (keys that differ only in their low bits), NaN, -inf, +inf and -0; every fifth row is all -inf,
// every tenth all one value and every tenth all NaN, and in every fifth the numbers lie in
// [1, 1 + 2^-10) (8192 values: keys alike in their top 19 bits, so that a radix select needs its
// last bits and the threshold has ties).
std::vector<float> mixed_scores(int64_t tokens, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::vector<float> s(static_cast<size_t>(tokens * n));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < n; ++j) {
      float& x = s[t * n + j];
      const uint32_t r = rng() % 100;
      if (t % 5 == 3) x = t % 10 == 3 ? 1.5f : std::numeric_limits<float>::quiet_NaN();
      else if (t % 5 == 4 || r < 6) x = -kInf;
      else if (r < 8) x = std::numeric_limits<float>::quiet_NaN();
      else if (r < 9) x = kInf;
      else if (r < 10) x = -0.0f;
      else if (t % 5 == 2) x = 1.0f + std::ldexp(static_cast<float>(rng() % 8192), -23);
      else if (r < 55) x = round_to_bf16(static_cast<float>(static_cast<int>(rng() % 64) - 32) * 0.0625f);
      else x = (rng() % 2 ? -1.0f : 1.0f) * std::ldexp(mantissa(rng), static_cast<int>(rng() % 41) - 20);
    }
  return s;
}

struct TopkCase {
  int64_t tokens, n, k;
  int ratio;  // 0: whole rows
  int64_t group_size = 1;
  uint32_t seed = 1;
  bool mixed = false;  // mixed_scores, else tie_heavy_scores
  int64_t leading_infinities = 0;  // the first scores of each row set to +inf
};

// run_topk (implementation null: through the chooser) vs reference::select_topk, bit for bit; the
// picks start out as 0x5a5a5a5a, so an element left unwritten shows.
void check_topk(const TopkCase& c, const TopkImplementation* implementation = nullptr) {
  auto scores = c.mixed ? mixed_scores(c.tokens, c.n, c.seed) : tie_heavy_scores(c.tokens * c.n, c.seed);
  for (int64_t t = 0; t < c.tokens; ++t)
    std::fill_n(scores.begin() + t * c.n, std::min(c.leading_infinities, c.n), kInf);
  std::vector<int32_t> position(c.tokens);
  std::mt19937 rng(c.seed + 1);
  for (auto& p : position) p = static_cast<int32_t>(rng() % (c.n * std::max(c.ratio, 1) * c.group_size + 5));
  std::vector<int32_t> expected(static_cast<size_t>(c.tokens * c.k));
  for (int64_t t = 0; t < c.tokens; ++t) {
    int64_t eligible = c.n;
    if (c.ratio > 0) eligible = ((position[t] + 1) / c.ratio + c.group_size - 1) / c.group_size;
    reference::select_topk(scores.data() + t * c.n, c.n, eligible, c.k, expected.data() + t * c.k);
  }
  DeviceTensor ds = testing::device_tensor(scores, DType::f32, {c.tokens, c.n});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {c.tokens});
  DeviceTensor dpicks = testing::poisoned_tensor(DType::i32, {c.tokens, c.k});
  dpicks.buffer.fill_bytes(0x5a);  // not -1, the padding
  TopkParams p{.scores = ds.view, .group_size = c.group_size, .picks = dpicks.view};
  if (c.ratio > 0) {
    p.token_position = dpos.view;
    p.compress_ratio = c.ratio;
  }
  Stream stream;
  if (implementation) {
    validate_topk(p);
    ASSERT_EQ(implementation->supports(p, device_info()), "") << implementation->name << ", n " << c.n;
    implementation->run(p, stream.get());
  } else {
    run_topk(p, stream.get());
  }
  stream.synchronize("topk test");
  const std::vector<int32_t> got = testing::download_as<int32_t>(dpicks.view);
  for (int64_t t = 0; t < c.tokens; ++t) {
    const auto row = [&](const std::vector<int32_t>& v) {
      return std::vector<int32_t>(v.begin() + t * c.k, v.begin() + (t + 1) * c.k);
    };
    ASSERT_EQ(row(got), row(expected)) << (implementation ? implementation->name : "chosen") << ": token " << t
                                       << " of " << c.tokens << ", n " << c.n << ", k " << c.k << ", ratio " << c.ratio
                                       << ", group " << c.group_size << ", mixed " << c.mixed;
  }
}

TEST_F(CudaTest, TopkMatchesReferenceWithTiesNanAndInfinities) {
  check_topk({.tokens = 7, .n = 1000, .k = 64, .ratio = 0, .seed = 1});
  check_topk({.tokens = 9, .n = 301, .k = 37, .ratio = 2, .seed = 2});      // causal lengths, some below k
  check_topk({.tokens = 3, .n = 20, .k = 50, .ratio = 0, .seed = 3});       // k > n: -1 padding
  check_topk({.tokens = 2, .n = 70001, .k = 512, .ratio = 1, .seed = 4});   // long rows
  check_topk({.tokens = 5, .n = 40, .k = 6, .ratio = 2, .group_size = 8, .seed = 5});  // block rows
}

// The shapes both kinds of radix rows run: row lengths of one CTA of 256 threads (up to 4096
// scores) or of more, and on sm_90 clusters of several CTAs (as the splits choose them from the
// occupancy); rows whose chunks are not 16-byte aligned (odd lengths); causal lengths (some rows
// see none, many fewer than k); candidate blocks of 8 entries; 150 single-CTA rows of odd length.
void check_topk_shapes(const TopkImplementation& implementation, uint32_t seed) {
  for (const int64_t n : {1, 7, 513, 4096, 65536 + 3, 131072})
    for (const int64_t k : {1, 64, 512, 2048})
      for (const bool mixed : {false, true}) {
        check_topk({.tokens = n >= 65536 ? 5 : 11, .n = n, .k = k, .ratio = 0, .seed = ++seed, .mixed = mixed},
                   &implementation);
        if (::testing::Test::HasFatalFailure()) return;
      }
  check_topk({.tokens = 13, .n = 131072, .k = 2048, .ratio = 1, .seed = ++seed, .mixed = true}, &implementation);
  check_topk({.tokens = 13, .n = 4099, .k = 512, .ratio = 4, .seed = ++seed, .mixed = true}, &implementation);
  check_topk({.tokens = 13, .n = 16384, .k = 2048, .ratio = 1, .group_size = 8, .seed = ++seed, .mixed = true},
             &implementation);
  check_topk({.tokens = 9, .n = 301, .k = 37, .ratio = 2, .group_size = 8, .seed = ++seed}, &implementation);
  check_topk({.tokens = 150, .n = 8197, .k = 2048, .ratio = 1, .seed = ++seed, .mixed = true}, &implementation);
}

// The radix top-k as the chooser runs it: the shapes above (resident rows), rows longer than a
// cluster's shared memory and 64 rows of 128K (more keys than the GPU's shared memory holds at
// once: streamed rows). The chooser picks it for them.
TEST_F(CudaTest, TopkRadixMatchesReference) {
  check_topk_shapes(kTopkRadix, 40);
  check_topk({.tokens = 3, .n = 300001, .k = 512, .ratio = 0, .seed = 80, .mixed = true}, &kTopkRadix);
  check_topk({.tokens = 2, .n = 600001, .k = 2048, .ratio = 0, .seed = 81, .mixed = true}, &kTopkRadix);
  check_topk({.tokens = 64, .n = 131072, .k = 512, .ratio = 0, .seed = 82, .mixed = true}, &kTopkRadix);

  using testing::fake_device_view;
  for (const int64_t n : {1, 4096, 131072, 600001})
    EXPECT_STREQ(topk_implementation({.scores = fake_device_view(DType::f32, {4, n}),
                                      .picks = fake_device_view(DType::i32, {4, 512})}),
                 "radix")
        << n;
}

// Every row streamed, on the shapes above and on what only streamed rows meet: ties filling the
// first pass's threshold bin beyond what a CTA gathers (each later pass then reads the scores
// again), long rows, many rows of 128K.
TEST_F(CudaTest, TopkRadixStreamedMatchesReference) {
  check_topk_shapes(kTopkRadixStreamed, 140);
  check_topk({.tokens = 3, .n = 500001, .k = 512, .ratio = 0, .seed = 180, .mixed = true}, &kTopkRadixStreamed);
  check_topk({.tokens = 64, .n = 131072, .k = 512, .ratio = 0, .seed = 181, .mixed = true}, &kTopkRadixStreamed);
  check_topk({.tokens = 64, .n = 131072, .k = 512, .ratio = 0, .seed = 182}, &kTopkRadixStreamed);  // tie-heavy
  // 2 % of +inf: 6000 keys tie in the threshold bin, about 750 in each CTA's chunk, which gathers
  // them. (Rows that fall back in every CTA: the mixed rows of one value or all NaN.)
  check_topk({.tokens = 3, .n = 300001, .k = 512, .ratio = 0, .seed = 183}, &kTopkRadixStreamed);
  // The same with 6000 more at the row's start: the first CTA holds more than it gathers and reads
  // its scores again for each pass, while the row's other CTAs gather theirs.
  check_topk({.tokens = 3, .n = 300001, .k = 512, .ratio = 0, .seed = 184, .leading_infinities = 6000},
             &kTopkRadixStreamed);
}

// The fallback, called directly (the chooser takes radix for these rows).
TEST_F(CudaTest, TopkSimtMatchesReference) {
  check_topk({.tokens = 7, .n = 1000, .k = 64, .ratio = 0, .seed = 71}, &kTopkSimt);
  check_topk({.tokens = 9, .n = 301, .k = 37, .ratio = 2, .seed = 72, .mixed = true}, &kTopkSimt);
  check_topk({.tokens = 3, .n = 20, .k = 50, .ratio = 0, .seed = 73}, &kTopkSimt);
  check_topk({.tokens = 5, .n = 70001, .k = 512, .ratio = 1, .seed = 74, .mixed = true}, &kTopkSimt);
  check_topk({.tokens = 5, .n = 40, .k = 6, .ratio = 2, .group_size = 8, .seed = 75}, &kTopkSimt);
}

TEST_F(CudaTest, CandidateBlocksMatchReference) {
  const int64_t tokens = 6, entries = 203, block = 8, top_blocks = 5, ratio = 1;
  const int64_t blocks = (entries + block - 1) / block;
  auto scores = tie_heavy_scores(tokens * entries, 9);
  const std::vector<int32_t> position = {0, 7, 8, 100, 202, 250};
  for (int64_t t = 0; t < tokens; ++t)  // the index scores are causally masked
    for (int64_t j = (position[t] + 1) / ratio; j < entries; ++j) scores[t * entries + j] = -kInf;

  DeviceTensor ds = testing::device_tensor(scores, DType::f32, {tokens, entries});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
  DeviceTensor dblock_scores = testing::poisoned_tensor(DType::f32, {tokens, blocks});
  DeviceTensor dkept = testing::poisoned_tensor(DType::i32, {tokens, top_blocks});
  Stream stream;
  run_candidate_block_scores({.scores = ds.view, .token_position = dpos.view, .compress_ratio = ratio,
                              .block_size = block, .block_scores = dblock_scores.view},
                             stream.get());
  run_topk({.scores = dblock_scores.view, .token_position = dpos.view, .compress_ratio = ratio, .group_size = block,
            .picks = dkept.view},
           stream.get());
  stream.synchronize("candidate blocks test");
  const auto kept = testing::download_as<int32_t>(dkept.view);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<uint8_t> expected(entries), got(entries, 0);
    reference::select_candidate_blocks(scores.data() + t * entries, entries, (position[t] + 1) / ratio, block,
                                       top_blocks, expected.data());
    for (int64_t i = 0; i < top_blocks; ++i) {
      const int32_t b = kept[t * top_blocks + i];
      if (b < 0) continue;
      ASSERT_LT(b, blocks);
      for (int64_t j = b * block; j < std::min(entries, (b + 1) * block); ++j) got[j] = 1;
    }
    EXPECT_EQ(got, expected) << "token " << t << " at position " << position[t];
  }
}

// Valid arguments on fake device views: 3 tokens x 32 index heads over an MXFP4 key cache, and
// the top 8 of 3 rows of 100 scores.
IndexScoresParams fake_index_scores_params() {
  using testing::fake_device_view;
  const PageGeometry g = page_geometry(KvRowFormat::index_mxfp4, kIndexDim, 64);
  return {.q = fake_device_view(DType::bf16, {3, 32, kIndexDim}),
          .weights = fake_device_view(DType::f32, {3, 32}),
          .keys = {.pages = fake_device_view(DType::u8, {2, g.page_stride}),
                   .block_table = fake_device_view(DType::i32, {1, 2}), .geometry = g},
          .token_sequence = fake_device_view(DType::i32, {3}),
          .token_position = fake_device_view(DType::i32, {3}),
          .compress_ratio = 2,
          .scores = fake_device_view(DType::f32, {3, 100})};
}

TopkParams fake_topk_params() {
  using testing::fake_device_view;
  return {.scores = fake_device_view(DType::f32, {3, 100}), .picks = fake_device_view(DType::i32, {3, 8})};
}

TEST(IndexerCudaValidation, ReportsTheFirstBadArgument) {
  using testing::error_of;
  using testing::fake_device_view;
  const IndexScoresParams p = fake_index_scores_params();
  EXPECT_NO_THROW(validate_index_scores(p));
  auto message = [](IndexScoresParams bad) { return error_of([&] { validate_index_scores(bad); }); };
  IndexScoresParams bad = p;
  bad.weights = fake_device_view(DType::f32, {3, 31});
  EXPECT_EQ(message(bad), "dsv4: index_scores: argument 'weights' has shape [3, 31], expected [3, 32]");
  bad = p;
  bad.keys.block_table = fake_device_view(DType::i64, {1, 2});
  EXPECT_EQ(message(bad), "dsv4: index_scores: argument 'keys.block_table' has dtype I64, expected I32");
  bad = p;
  bad.candidates = fake_device_view(DType::i32, {3, 4});
  EXPECT_EQ(message(bad), "dsv4: index_scores: candidate_block_size is 0, expected >= 1 with candidates");
  bad = p;
  bad.compress_ratio = 0;
  EXPECT_EQ(message(bad), "dsv4: index_scores: compress_ratio is 0, expected >= 1");

  const TopkParams topk = fake_topk_params();
  EXPECT_NO_THROW(validate_topk(topk));
  TopkParams bad_topk = topk;
  bad_topk.picks = fake_device_view(DType::i32, {2, 8});
  EXPECT_EQ(error_of([&] { validate_topk(bad_topk); }),
            "dsv4: topk: argument 'picks' has shape [2, 8], expected [3, 8]");
  bad_topk = topk;
  bad_topk.group_size = 0;
  EXPECT_EQ(error_of([&] { validate_topk(bad_topk); }), "dsv4: topk: group_size is 0, expected >= 1");

  const CandidateBlockScoresParams blocks{.scores = fake_device_view(DType::f32, {3, 100}),
                                          .token_position = fake_device_view(DType::i32, {3}),
                                          .block_size = 8,
                                          .block_scores = fake_device_view(DType::f32, {3, 12})};
  EXPECT_EQ(error_of([&] { validate_candidate_block_scores(blocks); }),
            "dsv4: candidate_block_scores: argument 'block_scores' has shape [3, 12], expected [3, 13]");
}

// The dispatch seam (indexer_implementations.h): without fp4_queries the SIMT index scores run every
// call on every device the library supports; the choice needs no device.
TEST(IndexerCudaDispatch, ChoosesSimtOnEveryDevice) {
  for (const int compute_capability : {80, 86, 89, 90, 100, 120}) {
    const DeviceInfo device{compute_capability};
    EXPECT_STREQ(choose_index_scores(fake_index_scores_params(), device).name, "simt") << compute_capability;
  }
}

// The radix top-k takes every row up to 2^30 scores (rows its CTAs' shared memory does not hold at
// once are streamed); longer rows take the SIMT kernel.
TEST(IndexerCudaDispatch, ChoosesTopkByDevice) {
  using testing::fake_device_view;
  const auto rows_of = [](int64_t n) {
    return TopkParams{.scores = fake_device_view(DType::f32, {3, n}), .picks = fake_device_view(DType::i32, {3, 2048})};
  };
  const DeviceInfo h200{90, 232448}, a100{80, 166912}, ada{89, 101376}, blackwell{100, 232448};
  for (const DeviceInfo& device : {h200, a100, ada, blackwell})
    for (const int64_t n : {int64_t{8}, int64_t{20000}, int64_t{131072}, int64_t{500000}, int64_t{1} << 30}) {
      EXPECT_STREQ(choose_topk(rows_of(n), device).name, "radix") << device.compute_capability << ", n " << n;
      EXPECT_EQ(kTopkRadixStreamed.supports(rows_of(n), device), "") << device.compute_capability << ", n " << n;
    }
  EXPECT_STREQ(choose_topk(rows_of((int64_t{1} << 30) + 1), h200).name, "simt");
  EXPECT_EQ(kTopkRadix.supports(rows_of(INT32_MAX), h200), "rows of 2147483647 scores, supports at most 1073741824");
}

// Any number of index heads and any index_dim that is a multiple of 32 run; other dims name the
// limit.
TEST(IndexerCudaDispatch, IndexDimsNameTheLimit) {
  using testing::fake_device_view;
  IndexScoresParams p = fake_index_scores_params();
  p.q = fake_device_view(DType::bf16, {3, 1000, kIndexDim});
  p.weights = fake_device_view(DType::f32, {3, 1000});
  validate_index_scores(p);
  EXPECT_STREQ(choose_index_scores(p, DeviceInfo{90}).name, "simt");
  const PageGeometry g = page_geometry(KvRowFormat::bf16, 48, 64);
  p.keys = {.pages = fake_device_view(DType::u8, {2, g.page_stride}),
            .block_table = fake_device_view(DType::i32, {1, 2}), .geometry = g};
  p.q = fake_device_view(DType::bf16, {3, 1000, 48});
  validate_index_scores(p);
  EXPECT_EQ(testing::error_of([&] { choose_index_scores(p, DeviceInfo{90}); }),
            "dsv4: index_scores: no implementation supports this call: wgmma: needs fp4_queries (q read as e2m1 "
            "codes); mma_f16: needs fp4_queries (q read as e2m1 codes); simt: index_dim 48, supports multiples of 32 "
            "up to 16384");
}

// wgmma takes FP4 queries of at most 32 heads against index_mxfp4 keys of index_dim 64 or 128;
// mma_f16 those of up to 128 heads and index_fp8 keys in fp32 precision, both on sm_90 (their only
// machine code); else the SIMT kernel.
TEST(IndexerCudaDispatch, ChoosesTensorCoresForFp4QueriesOnSm90) {
  using testing::fake_device_view;
  const DeviceInfo h200{90, 232448};
  IndexScoresParams p = fake_index_scores_params();
  p.fp4_queries = true;
  EXPECT_STREQ(choose_index_scores(p, h200).name, "wgmma");
  p.bf16_rounding = true;
  EXPECT_STREQ(choose_index_scores(p, h200).name, "wgmma");
  for (const int compute_capability : {80, 86, 89, 100, 120})
    EXPECT_STREQ(choose_index_scores(p, DeviceInfo{compute_capability, 232448}).name, "simt") << compute_capability;
  for (const IndexScoresImplementation* tensor_cores : {&kIndexScoresWgmma, &kIndexScoresMmaF16})
    EXPECT_EQ(tensor_cores->supports(p, DeviceInfo{89, 101376}), "needs compute capability 9.0, the device has 8.9");

  auto with_keys = [&](KvRowFormat format, int64_t dim, int64_t heads = 32) {
    IndexScoresParams q = p;
    const PageGeometry g = page_geometry(format, dim, 64);
    q.keys = {.pages = fake_device_view(DType::u8, {2, g.page_stride}),
              .block_table = fake_device_view(DType::i32, {1, 2}), .geometry = g};
    q.q = fake_device_view(DType::bf16, {3, heads, dim});
    q.weights = fake_device_view(DType::f32, {3, heads});
    validate_index_scores(q);
    return q;
  };
  EXPECT_STREQ(choose_index_scores(with_keys(KvRowFormat::index_mxfp4, 64), h200).name, "wgmma");
  EXPECT_STREQ(choose_index_scores(with_keys(KvRowFormat::index_mxfp4, 128, 5), h200).name, "wgmma");
  const IndexScoresParams heads_33 = with_keys(KvRowFormat::index_mxfp4, 128, 33);
  EXPECT_EQ(kIndexScoresWgmma.supports(heads_33, h200), "33 index heads, supports at most 32");
  EXPECT_STREQ(choose_index_scores(heads_33, h200).name, "mma_f16");
  // wgmma counts a CTA's rows in 32 bits.
  IndexScoresParams wide = with_keys(KvRowFormat::index_mxfp4, 128);
  wide.scores = fake_device_view(DType::f32, {3, (int64_t{1} << 30) + 1});
  validate_index_scores(wide);
  EXPECT_EQ(kIndexScoresWgmma.supports(wide, h200), "1073741825 entries, supports at most 1073741824");
  EXPECT_STREQ(choose_index_scores(wide, h200).name, "mma_f16");
  IndexScoresParams fp8 = with_keys(KvRowFormat::index_fp8, 64);
  EXPECT_EQ(kIndexScoresWgmma.supports(fp8, h200), "keys have format index_fp8, supports index_mxfp4");
  EXPECT_EQ(kIndexScoresMmaF16.supports(fp8, h200),
            "index_fp8 keys with bf16_rounding (e4m3 x e2m1 block sums are not exact in the fp8 MMA)");
  EXPECT_STREQ(choose_index_scores(fp8, h200).name, "simt");
  fp8.bf16_rounding = false;
  EXPECT_STREQ(choose_index_scores(fp8, h200).name, "mma_f16");
  EXPECT_EQ(kIndexScoresMmaF16.supports(with_keys(KvRowFormat::bf16, 128), h200),
            "keys have format bf16, supports index_mxfp4 and index_fp8");
  EXPECT_EQ(kIndexScoresMmaF16.supports(with_keys(KvRowFormat::f32, 128), h200),
            "keys have format f32, supports index_mxfp4 and index_fp8");
  IndexScoresParams f32_q = p;
  f32_q.q = fake_device_view(DType::f32, {3, 32, kIndexDim});
  validate_index_scores(f32_q);
  for (const IndexScoresImplementation* tensor_cores : {&kIndexScoresWgmma, &kIndexScoresMmaF16})
    EXPECT_EQ(tensor_cores->supports(f32_q, h200), "needs bf16 q (the FP4 values are read from bf16 bits)");
  EXPECT_STREQ(choose_index_scores(f32_q, h200).name, "simt");
  for (const IndexScoresImplementation* tensor_cores : {&kIndexScoresWgmma, &kIndexScoresMmaF16})
    EXPECT_EQ(tensor_cores->supports(with_keys(KvRowFormat::index_mxfp4, 96), h200), "index_dim 96, supports 64 and 128");
  EXPECT_EQ(kIndexScoresMmaF16.supports(with_keys(KvRowFormat::index_mxfp4, 128, 129), h200),
            "129 index heads, supports at most 128");
  // The 16-byte copies: q and the key pages must be 16-byte aligned (8 bytes off: simt).
  auto shifted = [](TensorView v) {
    v.data = static_cast<char*>(v.data) + 8;
    return v;
  };
  IndexScoresParams q_off = p, keys_off = p;
  q_off.q = shifted(p.q);
  keys_off.keys.pages = shifted(p.keys.pages);
  for (const IndexScoresImplementation* tensor_cores : {&kIndexScoresWgmma, &kIndexScoresMmaF16}) {
    EXPECT_EQ(tensor_cores->supports(q_off, h200), "q that is not 16-byte aligned");
    EXPECT_EQ(tensor_cores->supports(keys_off, h200), "key rows that are not 16-byte aligned");
  }
  EXPECT_STREQ(choose_index_scores(q_off, h200).name, "simt");
  EXPECT_STREQ(choose_index_scores(keys_off, h200).name, "simt");
  p.fp4_queries = false;
  EXPECT_STREQ(choose_index_scores(p, h200).name, "simt");
}

// The tensor-core implementations' key ranges: the fewest splits whose CTAs fill the last of at most
// `waves` waves to 95 % (else the fullest), each at least min_keys long, a multiple of the granule,
// covering every entry.
TEST(IndexerCudaDispatch, KeyRangesFillTheirLastWave) {
  const DeviceInfo h200{90, 232448, 233472, 132};
  const size_t shared = 50 * 1024;  // four CTAs per SM: 528 places a wave
  auto last_wave_fill = [](int64_t ctas, int64_t places) {
    return static_cast<double>(ctas) / static_cast<double>((ctas + places - 1) / places * places);
  };
  for (const int waves : {1, 2, 8})
    for (const int64_t entries : {int64_t{32768}, int64_t{131072}, int64_t{100003}}) {
      const int64_t keys = index_keys_per_cta(entries, 64, shared, 4, 128, 1024, waves, h200);
      const int64_t ctas = 64 * ((entries + keys - 1) / keys);
      EXPECT_EQ(keys % 128, 0) << entries;
      // A decode batch of 64 tokens: eight splits, 512 CTAs (97 %), whatever the waves allowed.
      EXPECT_EQ(ctas, 512) << entries << " entries, " << waves << " waves";
      EXPECT_GE(last_wave_fill(ctas, 528), 0.95);
    }
  // A prefill chunk of 2048 tokens in 342 CTAs of six, three an SM (396 places): one wave leaves
  // 54 places empty; eight splits fill 2736 of 2772.
  EXPECT_EQ(index_keys_per_cta(65536, 342, 70 * 1024, 3, 128, 1024, 1, h200), 65536);
  EXPECT_EQ(index_keys_per_cta(65536, 342, 70 * 1024, 3, 128, 1024, 8, h200), 8192);
  // Few entries: ranges of at least min_keys, whatever the waves (3000 entries: two of 1536).
  EXPECT_EQ(index_keys_per_cta(3000, 64, shared, 4, 128, 1024, 1, h200), 1536);
  // More token groups than a wave holds: one range per token group.
  EXPECT_EQ(index_keys_per_cta(131072, 4096, shared, 4, 128, 1024, 1, h200), 131072);
  // Shared memory limits the CTAs per SM: three of 70 KB.
  const int64_t keys = index_keys_per_cta(131072, 64, 70 * 1024, 4, 128, 1024, 1, h200);
  EXPECT_LE(64 * ((131072 + keys - 1) / keys), 132 * 3);
}

TEST_F(CudaTest, IndexerChoosesSimtOnThisDevice) {
  EXPECT_STREQ(index_scores_implementation(fake_index_scores_params()), "simt");
}

TEST_F(CudaTest, TopkChoosesRadixOnThisDevice) { EXPECT_STREQ(topk_implementation(fake_topk_params()), "radix"); }

}  // namespace
}  // namespace dsv4::cuda

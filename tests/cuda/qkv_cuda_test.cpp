// q / kv path and output projection kernels against the CPU reference ops.
//
// rms_norm, rope_heads and cache_insert are exact: the kernels round where the reference rounds,
// sum squares in double and use IEEE fp32 products without fused multiply-adds, so outputs and
// cache bytes must equal reference::rms_norm / apply_rope / fake_quant_*_rows followed by
// kv_format's encode_rows bit for bit. The output projection adds a GEMM: its tolerance is that
// of the projection tests (bf16 output: rtol 2^-7, one bf16 ulp).
#include <gtest/gtest.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "cuda/cuda_test_util.h"
#include "dsv4/cuda/output.h"
#include "dsv4/cuda/qkv.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;
using testing::DeviceTensor;

constexpr int64_t kRopeDim = 64;
constexpr int64_t kTablePositions = 4096;

const RopeParams kCompressRope{.theta = 160000.0, .yarn = true, .factor = 16.0, .original_max_position = 65536};

// The layer's RoPE table on the device and its frequencies for the reference.
struct Rope {
  std::vector<float> frequencies = rope_frequencies(kCompressRope, kRopeDim);
  DeviceTensor table = testing::device_tensor(rope_table(frequencies, kTablePositions));
};

std::vector<int32_t> random_positions(int64_t n, uint32_t seed, int32_t limit = kTablePositions) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& x : p) x = static_cast<int32_t>(rng() % limit);
  return p;
}

std::vector<int64_t> widened(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

TEST_F(CudaTest, RmsNormIsExact) {
  const int64_t rows = 37, dim = 1280;
  auto x = testing::rounded_to_bf16(testing::random_floats(rows * dim, 1, -4.0f, 4.0f));
  // The last two rows have mean squares ~3e-21, below both eps values (1e-20, 1e-6), so that
  // where eps is added (inside the square root, to the mean) shows; elsewhere mean squares ≫ eps.
  for (int64_t i = (rows - 2) * dim; i < rows * dim; ++i) x[i] = round_to_bf16(x[i] * 2.5e-11f);
  const auto w = testing::rounded_to_bf16(testing::random_floats(dim, 2, 0.5f, 1.5f));
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {rows, dim});
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {dim});
  Stream stream;
  for (const bool weighted : {true, false}) {
    const DType out_dtype = weighted ? DType::bf16 : DType::f32;
    DeviceTensor out = testing::poisoned_tensor(out_dtype, {rows, dim});
    const float eps = weighted ? 1e-20f : 1e-6f;
    run_rms_norm({.x = dx.view, .weight = weighted ? dw.view : TensorView{}, .eps = eps, .out = out.view}, stream.get());
    stream.synchronize("rms_norm test");
    std::vector<float> expected(x.size());
    reference::rms_norm(x.data(), rows, dim, weighted ? w.data() : nullptr, eps, expected.data(), weighted);
    testing::expect_close(testing::download_floats(out.view), expected, 0.0f, 0.0f,
                          weighted ? "weighted bf16 norm" : "weightless f32 norm");
  }
}

TEST_F(CudaTest, RopeHeadsIsExact) {
  Rope rope;
  Stream stream;
  struct Case {
    int64_t tokens, heads, dim;
    bool inverse, head_norm;
    RowQuantizer quant;
    DType out_dtype;
  };
  const Case cases[] = {
      {11, 7, 512, false, false, RowQuantizer::none, DType::bf16},          // V4.1 q
      {5, 4, 512, false, true, RowQuantizer::none, DType::bf16},            // V4.0 q (per-head norm)
      {9, 32, 128, false, false, RowQuantizer::fp4_ue8m0_32, DType::bf16},  // indexer q
      {6, 3, 512, true, false, RowQuantizer::none, DType::f32},             // output un-rotation, fp32
  };
  uint32_t seed = 10;
  for (const Case& c : cases) {
    const int64_t n = c.tokens * c.heads * c.dim;
    const auto x = testing::rounded_to_bf16(testing::random_floats(n, ++seed, -3.0f, 3.0f));
    const auto position = random_positions(c.tokens, ++seed);
    DeviceTensor dx = testing::device_tensor(x, DType::bf16, {c.tokens, c.heads, c.dim});
    DeviceTensor dpos = testing::device_array(position, DType::i32, {c.tokens});
    DeviceTensor out = testing::poisoned_tensor(c.out_dtype, {c.tokens, c.heads, c.dim});
    run_rope_heads({.x = dx.view, .token_position = dpos.view, .rope_table = rope.table.view, .inverse = c.inverse,
                    .head_norm = c.head_norm, .eps = 1e-6f, .quant = c.quant, .out = out.view},
                   stream.get());
    stream.synchronize("rope_heads test");
    const bool bf16 = c.out_dtype == DType::bf16;
    std::vector<float> expected = x;
    if (c.head_norm) reference::rms_norm(expected.data(), c.tokens * c.heads, c.dim, nullptr, 1e-6f, expected.data(), bf16);
    const auto positions = widened(position);
    reference::apply_rope(expected.data(), c.tokens, c.heads, c.dim, rope.frequencies.data(), kRopeDim, positions.data(),
                          c.inverse, bf16);
    if (c.quant == RowQuantizer::fp4_ue8m0_32) reference::fake_quant_fp4_ue8m0_rows(expected.data(), c.tokens * c.heads, c.dim);
    testing::expect_close(testing::download_floats(out.view), expected, 0.0f, 0.0f,
                          "rope_heads case with " + std::to_string(c.heads) + " heads of " + std::to_string(c.dim));
  }
}

// The V4.0 indexer QAT (SPEC §15): RoPE, the Hadamard rotation, FP4, on index queries (rope_heads)
// and index keys (cache_insert into bf16 rows, V4.0's index-key format), against the reference's
// apply_rope + hadamard_rows + fake_quant_fp4_ue8m0_rows. The kernel sums the butterflies in fp32
// where the reference sums in double: both are exact unless a row's values span more than fp32's
// 24 bits, so a bf16 output may differ by one ulp on rare channels, and an FP4 code that sat on a
// rounding boundary may follow it. Bounds: before FP4, one bf16 ulp everywhere and at most 1 in
// 1000 channels off; after it, at most 1 in 1000 channels off (measured: to be filled in on a GPU).
std::vector<float> v40_indexer_qat_reference(std::vector<float> x, int64_t rows, int64_t dim,
                                             const std::vector<int64_t>& row_position, const Rope& rope, bool quantize) {
  reference::apply_rope(x.data(), rows, 1, dim, rope.frequencies.data(), kRopeDim, row_position.data(), false, true);
  reference::hadamard_rows(x.data(), rows, dim, true);
  if (quantize) reference::fake_quant_fp4_ue8m0_rows(x.data(), rows, dim);
  return x;
}

size_t count_differing(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]);
  return n;
}

TEST_F(CudaTest, V40IndexerQatQueriesMatchTheReference) {
  Rope rope;
  Stream stream;
  const int64_t tokens = 29, heads = 64, dim = 128;
  const auto x = testing::rounded_to_bf16(testing::random_floats(tokens * heads * dim, 70, -3.0f, 3.0f));
  const auto position = random_positions(tokens, 71);
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {tokens, heads, dim});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
  std::vector<int64_t> row_position;
  for (int64_t t = 0; t < tokens; ++t) row_position.insert(row_position.end(), heads, position[t]);
  for (const bool quantize : {false, true}) {
    DeviceTensor out = testing::poisoned_tensor(DType::bf16, {tokens, heads, dim});
    run_rope_heads({.x = dx.view, .token_position = dpos.view, .rope_table = rope.table.view, .hadamard = true,
                    .quant = quantize ? RowQuantizer::fp4_ue8m0_32 : RowQuantizer::none, .out = out.view},
                   stream.get());
    stream.synchronize("rope_heads hadamard test");
    const auto got = testing::download_floats(out.view);
    const auto expected = v40_indexer_qat_reference(x, tokens * heads, dim, row_position, rope, quantize);
    const size_t differing = count_differing(got, expected);
    std::printf("V4.0 index q, %s: %zu of %zu channels differ from the reference\n", quantize ? "Hadamard + FP4" : "Hadamard",
                differing, got.size());
    EXPECT_LE(differing * 1000, got.size());
    if (!quantize) testing::expect_close(got, expected, 0.0f, 0x1p-8f, "Hadamard-rotated index q");
  }
}

TEST_F(CudaTest, V40IndexerQatKeysMatchTheReference) {
  Rope rope;
  Stream stream;
  const int64_t tokens = 301, dim = 128, ratio = 4;
  const auto x = testing::rounded_to_bf16(testing::random_floats(tokens * dim, 72, -3.0f, 3.0f));
  const auto w = testing::rounded_to_bf16(testing::random_floats(dim, 73, 0.5f, 1.5f));
  std::vector<int32_t> position(static_cast<size_t>(tokens));
  std::iota(position.begin(), position.end(), 3);
  std::vector<int64_t> slots(static_cast<size_t>(tokens)), row_position(static_cast<size_t>(tokens));
  std::iota(slots.begin(), slots.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) row_position[t] = position[t] + 1 - ratio;  // an entry rotates at 4w
  std::vector<float> expected = x;
  reference::rms_norm(expected.data(), tokens, dim, w.data(), 1e-6f, expected.data(), true);
  expected = v40_indexer_qat_reference(expected, tokens, dim, row_position, rope, true);
  const PageGeometry g = page_geometry(KvRowFormat::bf16, dim, 64, PagePlacement::segregated);
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {tokens, dim});
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {dim});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
  DeviceTensor dslots = testing::device_array(slots, DType::i64, {tokens});
  DeviceTensor dpages = testing::device_array(std::vector<uint8_t>(static_cast<size_t>(5 * g.page_stride)), DType::u8,
                                              {5, g.page_stride});
  DeviceTensor out = testing::poisoned_tensor(DType::f32, {tokens, dim});
  run_cache_insert({.rows = dx.view, .norm_weight = dw.view, .eps = 1e-6f, .token_position = dpos.view,
                    .position_offset = 1 - ratio, .rope_table = rope.table.view, .hadamard = true,
                    .quant = RowQuantizer::fp4_ue8m0_32, .slots = dslots.view,
                    .cache = {.pages = dpages.view, .geometry = g}, .out = out.view},
                   stream.get());
  stream.synchronize("cache_insert hadamard test");
  const auto got = testing::download_floats(out.view);
  const size_t differing = count_differing(got, expected);
  std::printf("V4.0 index keys, Hadamard + FP4: %zu of %zu channels differ from the reference\n", differing, got.size());
  EXPECT_LE(differing * 1000, got.size());
  // The cache holds the same rows, exactly (bf16 rows of FP4 values).
  std::vector<float> decoded(got.size());
  const std::vector<std::byte> pages = testing::download_as<std::byte>(dpages.view);
  decode_rows(g, std::span<const std::byte>(pages), slots.data(), tokens, decoded.data());
  EXPECT_EQ(count_differing(decoded, got), 0u);
}

TEST_F(CudaTest, RopeHeadsPositionOutsideTheTableGivesNan) {
  Rope rope;
  const auto x = testing::random_floats(2 * 512, 3);
  DeviceTensor dx = testing::device_tensor(x, DType::f32, {2, 1, 512});
  DeviceTensor dpos = testing::device_array(std::vector<int32_t>{5, static_cast<int32_t>(kTablePositions)}, DType::i32, {2});
  DeviceTensor out = testing::poisoned_tensor(DType::f32, {2, 1, 512});
  Stream stream;
  run_rope_heads({.x = dx.view, .token_position = dpos.view, .rope_table = rope.table.view, .out = out.view}, stream.get());
  stream.synchronize("rope_heads test");
  const auto got = testing::download_floats(out.view);
  for (int c = 0; c < 512; ++c) {
    EXPECT_TRUE(std::isfinite(got[c])) << c;
    EXPECT_EQ(std::isnan(got[512 + c]), c >= 512 - kRopeDim) << c;
  }
}

// A cache insert and the reference pipeline that must produce the same bytes.
struct InsertCase {
  KvRowFormat format;
  int64_t dim;
  bool norm;
  RowQuantizer quant;
  int64_t position_offset = 0;
  PagePlacement placement = PagePlacement::segregated;
  const char* what = "";
};

void check_cache_insert(const InsertCase& c, uint32_t seed) {
  Rope rope;
  const int64_t tokens = 23, rows_per_page = 16, num_pages = 4;
  const auto x = testing::rounded_to_bf16(testing::random_floats(tokens * c.dim, seed, -3.0f, 3.0f));
  const auto w = testing::rounded_to_bf16(testing::random_floats(c.dim, seed + 1, 0.5f, 1.5f));
  auto position = random_positions(tokens, seed + 2, 2000);
  position[0] = 0;  // with a negative offset its RoPE position is outside the table: skipped
  // Distinct random slots, some tokens not stored.
  std::vector<int64_t> slots(static_cast<size_t>(rows_per_page * num_pages));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(seed + 3));
  slots.resize(tokens);
  for (int64_t t = 0; t < tokens; t += 5) slots[t] = -1;

  // Reference: norm -> RoPE -> QAT, then kv_format's encoder, onto pages holding random bytes.
  std::vector<float> expected = x;
  if (c.norm) reference::rms_norm(expected.data(), tokens, c.dim, w.data(), 1e-20f, expected.data(), true);
  std::vector<int64_t> rope_position(tokens);
  for (int64_t t = 0; t < tokens; ++t) rope_position[t] = position[t] + c.position_offset;
  reference::apply_rope(expected.data(), tokens, 1, c.dim, rope.frequencies.data(), kRopeDim, rope_position.data(),
                        false, true);
  if (c.quant == RowQuantizer::fp8_e4m3_32) reference::fake_quant_fp8_rows(expected.data(), tokens, c.dim, c.dim, 32);
  if (c.quant == RowQuantizer::fp8_e4m3_nope_64) reference::fake_quant_fp8_rows(expected.data(), tokens, c.dim, c.dim - kRopeDim, 64);
  if (c.quant == RowQuantizer::fp4_ue8m0_32) reference::fake_quant_fp4_ue8m0_rows(expected.data(), tokens, c.dim);
  if (c.quant == RowQuantizer::fp4_e4m3_16) reference::fake_quant_fp4_e4m3_rows(expected.data(), tokens, c.dim);
  const PageGeometry g = page_geometry(c.format, c.dim, rows_per_page, c.placement);
  std::vector<std::byte> pages(static_cast<size_t>(num_pages * g.page_stride));
  std::mt19937 rng(seed + 4);
  for (auto& b : pages) b = static_cast<std::byte>(rng() & 0xff);
  std::vector<int64_t> stored_slots = slots;
  for (int64_t t = 0; t < tokens; ++t)
    if (rope_position[t] < 0) stored_slots[t] = -1;
  const float tensor_scale = 0.015625f;
  std::vector<std::byte> expected_pages = pages;
  encode_rows(g, expected.data(), tokens, stored_slots.data(), std::span<std::byte>(expected_pages), tensor_scale);

  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {tokens, c.dim});
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {c.dim});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
  DeviceTensor dslots = testing::device_array(slots, DType::i64, {tokens});
  DeviceTensor dpages = testing::device_array(pages, DType::u8, {num_pages, g.page_stride});
  DeviceTensor out = testing::poisoned_tensor(DType::f32, {tokens, c.dim});
  Stream stream;
  run_cache_insert({.rows = dx.view, .norm_weight = c.norm ? dw.view : TensorView{}, .eps = 1e-20f,
                    .token_position = dpos.view, .position_offset = c.position_offset, .rope_table = rope.table.view,
                    .quant = c.quant, .slots = dslots.view,
                    .cache = {.pages = dpages.view, .geometry = g, .tensor_scale = tensor_scale}, .out = out.view},
                   stream.get());
  stream.synchronize("cache_insert test");
  const auto got_pages = testing::download_as<std::byte>(dpages.view);
  size_t differing = 0, first = 0;
  for (size_t i = 0; i < got_pages.size(); ++i)
    if (got_pages[i] != expected_pages[i] && differing++ == 0) first = i;
  EXPECT_EQ(differing, 0u) << c.what << ": " << differing << " page bytes differ, first at byte " << first;
  // The plain output holds every token's row (NaN RoPE channels where the position is invalid).
  const auto got = testing::download_floats(out.view);
  for (int64_t t = 0; t < tokens; ++t) {
    if (rope_position[t] < 0) continue;
    std::vector<float> got_row(got.begin() + t * c.dim, got.begin() + (t + 1) * c.dim);
    std::vector<float> want_row(expected.begin() + t * c.dim, expected.begin() + (t + 1) * c.dim);
    testing::expect_close(got_row, want_row, 0.0f, 0.0f, std::string(c.what) + " output row");
  }
}

TEST_F(CudaTest, CacheInsertWritesTheReferenceBytes) {
  uint32_t seed = 100;
  const InsertCase cases[] = {
      {KvRowFormat::v41_fp8, 512, true, RowQuantizer::fp8_e4m3_32, 0, PagePlacement::segregated, "V4.1 window row"},
      {KvRowFormat::v41_fp8, 512, true, RowQuantizer::fp8_e4m3_32, 0, PagePlacement::interleaved, "interleaved window"},
      {KvRowFormat::bf16, 512, true, RowQuantizer::fp8_e4m3_32, 0, PagePlacement::segregated, "bf16 window after QAT"},
      {KvRowFormat::fp8_ds_mla, 512, true, RowQuantizer::fp8_e4m3_nope_64, 0, PagePlacement::segregated, "V4.0 window"},
      {KvRowFormat::fp8_per_tensor, 512, true, RowQuantizer::none, 0, PagePlacement::segregated, "per-tensor fp8"},
      {KvRowFormat::v41_fp4, 512, false, RowQuantizer::fp4_e4m3_16, -1, PagePlacement::segregated, "compressed entry"},
      {KvRowFormat::index_mxfp4, 128, true, RowQuantizer::fp4_ue8m0_32, -1, PagePlacement::segregated, "MXFP4 index key"},
      {KvRowFormat::index_fp8, 128, true, RowQuantizer::none, -3, PagePlacement::segregated, "FP8 index key"},
      {KvRowFormat::f32, 512, true, RowQuantizer::none, 0, PagePlacement::segregated, "f32 window row"},
      {KvRowFormat::f32, 96, true, RowQuantizer::none, -1, PagePlacement::interleaved, "f32 index key"},
  };
  for (const InsertCase& c : cases) check_cache_insert(c, seed += 10);
}

using OutputProjectionCudaTest = testing::BlasCudaTest;

TEST_F(OutputProjectionCudaTest, InverseRopeThenGroupedWoA) {
  Rope rope;
  const int64_t tokens = 9, heads = 8, dim = 512, groups = 2, rank = 64, in = heads / groups * dim;
  const auto o = testing::rounded_to_bf16(testing::random_floats(tokens * heads * dim, 1));
  const auto w = testing::rounded_to_bf16(testing::random_floats(groups * rank * in, 2, -0.05f, 0.05f));
  const auto position = random_positions(tokens, 3);
  DeviceTensor d_o = testing::device_tensor(o, DType::bf16, {tokens, heads, dim});
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {groups, rank, in});
  DeviceTensor dpos = testing::device_array(position, DType::i32, {tokens});
  DeviceTensor dy = testing::poisoned_tensor(DType::bf16, {tokens, groups, rank});
  const OutputProjectionParams p{.o = d_o.view, .token_position = dpos.view, .rope_table = rope.table.view,
                                 .wo_a = dw.view, .y = dy.view, .blas = &*blas_};
  DeviceBuffer workspace(output_projection_workspace_bytes(p));
  Stream stream;
  run_output_projection(p, workspace.data(), stream.get());
  stream.synchronize("output projection test");

  std::vector<float> rotated = o, expected(static_cast<size_t>(tokens * groups * rank));
  const auto positions = widened(position);
  reference::apply_rope(rotated.data(), tokens, heads, dim, rope.frequencies.data(), kRopeDim, positions.data(), true, true);
  reference::grouped_linear(rotated.data(), tokens, groups, in, w.data(), rank, expected.data(), true);
  testing::expect_close(testing::download_floats(dy.view), expected, 1e-4f, 0x1p-7f, "wo_a output");
}

TEST(QkvCudaValidation, ReportsTheFirstBadArgument) {
  using testing::error_of;
  using testing::fake_device_view;
  const RopeHeadsParams p{.x = fake_device_view(DType::bf16, {4, 8, 512}),
                          .token_position = fake_device_view(DType::i32, {4}),
                          .rope_table = fake_device_view(DType::f32, {100, 64}),
                          .out = fake_device_view(DType::bf16, {4, 8, 512})};
  EXPECT_NO_THROW(validate_rope_heads(p));
  RopeHeadsParams bad = p;
  bad.rope_table = fake_device_view(DType::f32, {100, 63});
  EXPECT_EQ(error_of([&] { validate_rope_heads(bad); }),
            "dsv4: rope_heads: argument 'rope_table' has 63 columns, expected an even rope_dim <= 512");
  bad = p;
  bad.out = fake_device_view(DType::bf16, {4, 8, 511});
  EXPECT_EQ(error_of([&] { validate_rope_heads(bad); }),
            "dsv4: rope_heads: argument 'out' has shape [4, 8, 511], expected [4, 8, 512]");

  const PageGeometry g = page_geometry(KvRowFormat::v41_fp4, 512, 64);
  const CacheInsertParams insert{.rows = fake_device_view(DType::bf16, {4, 512}),
                                 .token_position = fake_device_view(DType::i32, {4}),
                                 .rope_table = fake_device_view(DType::f32, {100, 64}),
                                 .quant = RowQuantizer::fp4_e4m3_16,
                                 .slots = fake_device_view(DType::i64, {4}),
                                 .cache = {.pages = fake_device_view(DType::u8, {2, g.page_stride}), .geometry = g}};
  EXPECT_NO_THROW(validate_cache_insert(insert));
  CacheInsertParams bad_insert = insert;
  bad_insert.slots = fake_device_view(DType::i32, {4});
  EXPECT_EQ(error_of([&] { validate_cache_insert(bad_insert); }),
            "dsv4: cache_insert: argument 'slots' has dtype I32, expected I64");
  bad_insert = insert;
  bad_insert.rows = fake_device_view(DType::bf16, {4, 128});
  EXPECT_EQ(error_of([&] { validate_cache_insert(bad_insert); }),
            "dsv4: cache_insert: cache 'cache' holds rows of 512 channels, expected 128");

  const RmsNormParams norm{.x = fake_device_view(DType::f32, {3, 10}), .eps = 0.0f,
                           .out = fake_device_view(DType::f32, {3, 10})};
  EXPECT_EQ(error_of([&] { validate_rms_norm(norm); }), "dsv4: rms_norm: eps is 0, expected finite and > 0");

  static int dummy_handle;
  const OutputProjectionParams out{.o = fake_device_view(DType::bf16, {3, 8, 512}),
                                   .token_position = fake_device_view(DType::i32, {3}),
                                   .rope_table = fake_device_view(DType::f32, {100, 64}),
                                   .wo_a = fake_device_view(DType::bf16, {2, 64, 1000}),
                                   .y = fake_device_view(DType::bf16, {3, 2, 64}),
                                   .blas = reinterpret_cast<const BlasLt*>(&dummy_handle)};
  EXPECT_EQ(error_of([&] { validate_output_projection(out); }),
            "dsv4: output_projection: argument 'wo_a' has shape [2, 64, 1000], expected [2, 64, 2048]");
}

}  // namespace
}  // namespace dsv4::cuda

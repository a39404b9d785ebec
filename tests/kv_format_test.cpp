// KV-cache row formats (include/dsv4/kv_format.h): geometry, hand-derived known-answer bytes, the
// upstream encoders' bytes in tests/data/golden/kvfmt, round-trip error bounds, agreement with the
// reference fake quantizers of numeric.h, and argument errors.
#include "dsv4/kv_format.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/error.h"
#include "dsv4/numeric.h"
#include "dsv4/safetensors.h"
#include "test_seed.h"

namespace dsv4 {
namespace {

using Bytes = std::vector<uint8_t>;

using test::test_seed;

uint32_t bits_of(float f) { return float_bits(f); }

std::span<std::byte> as_span(Bytes& b) { return {reinterpret_cast<std::byte*>(b.data()), b.size()}; }
std::span<const std::byte> as_span(const Bytes& b) { return {reinterpret_cast<const std::byte*>(b.data()), b.size()}; }

Bytes concat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const Bytes& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}
Bytes repeat(uint8_t value, size_t count) { return Bytes(count, value); }

void expect_error_containing(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error, expected one containing: " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// ---- Geometry and names -------------------------------------------------------------------------------

TEST(KvFormat, RowSizesAndPageStrides) {
  struct Case { KvRowFormat f; int64_t dims, rows; PagePlacement placement; int64_t row_bytes, stride; };
  const Case cases[] = {
      {KvRowFormat::v41_fp8, 512, 32, PagePlacement::segregated, 528, 16896},
      {KvRowFormat::v41_fp4, 512, 64, PagePlacement::segregated, 288, 18432},
      {KvRowFormat::fp8_ds_mla, 512, 64, PagePlacement::segregated, 584, 37440},  // 37376 up to 576s
      {KvRowFormat::fp8_ds_mla, 512, 64, PagePlacement::interleaved, 584, 37376},
      {KvRowFormat::index_mxfp4, 128, 64, PagePlacement::segregated, 68, 4608},    // 4352 up to 512s
      {KvRowFormat::index_fp8, 128, 64, PagePlacement::segregated, 132, 8640},     // 8448 up to 576s
      {KvRowFormat::v41_fp4, 512, 3, PagePlacement::segregated, 288, 1024},        // 864 up to 256s
      {KvRowFormat::v41_fp4, 512, 3, PagePlacement::interleaved, 288, 864},
      {KvRowFormat::bf16, 512, 64, PagePlacement::segregated, 1024, 65536},
      {KvRowFormat::fp8_per_tensor, 128, 5, PagePlacement::segregated, 128, 640},
      {KvRowFormat::f32, 512, 64, PagePlacement::segregated, 2048, 131072},
      {KvRowFormat::f32, 77, 3, PagePlacement::interleaved, 308, 924},
  };
  for (const Case& c : cases) {
    const PageGeometry g = page_geometry(c.f, c.dims, c.rows, c.placement);
    EXPECT_EQ(g.row.row_bytes(), c.row_bytes) << kv_row_format_name(c.f);
    EXPECT_EQ(g.page_stride, c.stride) << kv_row_format_name(c.f) << " x " << c.rows;
  }
}

TEST(KvFormat, RowPlacementOffsets) {
  const PageGeometry seg = page_geometry(KvRowFormat::fp8_ds_mla, 512, 64);
  EXPECT_EQ(seg.data_offset(3), 3 * 576);
  EXPECT_EQ(seg.scale_offset(3), 64 * 576 + 3 * 8);
  const PageGeometry inter = page_geometry(KvRowFormat::v41_fp4, 512, 64, PagePlacement::interleaved);
  EXPECT_EQ(inter.data_offset(3), 3 * 288);
  EXPECT_EQ(inter.scale_offset(3), 3 * 288 + 256);
}

TEST(KvFormat, NamesSetsAndDefaults) {
  EXPECT_EQ(kEveryKvRowFormat.size(), 8u);
  for (KvRowFormat f : kEveryKvRowFormat) EXPECT_EQ(parse_kv_row_format(kv_row_format_name(f)), f);
  EXPECT_STREQ(kv_row_format_name(KvRowFormat::v41_fp4), "v41_fp4");
  EXPECT_STREQ(kv_row_format_name(KvRowFormat::f32), "f32");
  EXPECT_EQ(kv_format_set_names(), (std::vector<std::string>{"v4.1-native", "fp8_ds_mla", "bf16", "fp8", "f32"}));
  const KvFormatSet native = kv_format_set("v4.1-native");
  EXPECT_EQ(native.window, KvRowFormat::v41_fp8);
  EXPECT_EQ(native.compressed, KvRowFormat::v41_fp4);
  EXPECT_EQ(native.index_keys, KvRowFormat::index_mxfp4);
  const KvFormatSet ds_mla = kv_format_set("fp8_ds_mla");
  EXPECT_EQ(ds_mla.window, KvRowFormat::fp8_ds_mla);
  EXPECT_EQ(ds_mla.compressed, KvRowFormat::fp8_ds_mla);
  EXPECT_EQ(ds_mla.index_keys, KvRowFormat::index_fp8);
  EXPECT_EQ(kv_format_set("bf16").index_keys, KvRowFormat::bf16);
  const KvFormatSet fp8 = kv_format_set("fp8");
  EXPECT_EQ(fp8.window, KvRowFormat::fp8_per_tensor);
  EXPECT_EQ(fp8.index_keys, KvRowFormat::index_fp8);
  const KvFormatSet f32 = kv_format_set("f32");
  EXPECT_EQ(f32.window, KvRowFormat::f32);
  EXPECT_EQ(f32.compressed, KvRowFormat::f32);
  EXPECT_EQ(f32.index_keys, KvRowFormat::f32);
  EXPECT_EQ(default_rows_per_page(KvRowFormat::f32), 64);
  EXPECT_EQ(default_rows_per_page(KvRowFormat::v41_fp8), 32);
  EXPECT_EQ(default_rows_per_page(KvRowFormat::v41_fp4), 64);
  EXPECT_EQ(default_rows_per_page(KvRowFormat::fp8_ds_mla), 64);
}

// ---- Known answers ----------------------------------------------------------------------------------------

// One row encoded into a zeroed buffer of `pages` pages at `slot`. Inputs are zero except `inputs`;
// the buffer must equal zeros except `data` at byte `data_at` and `scales` at byte `scales_at`
// (offsets from the start of the buffer, computed by hand). Decoding must give `decoded` (zero
// elsewhere), compared bit for bit.
struct KnownAnswer {
  std::string what;
  KvRowFormat format;
  int64_t dims, rows_per_page, pages, slot;
  PagePlacement placement;
  std::map<int, float> inputs;
  Bytes data;
  int64_t data_at;
  Bytes scales;
  int64_t scales_at;
  std::map<int, float> decoded;
  EncodeOptions options{};
  float tensor_scale = 1.0f;
};

void check_known_answer(const KnownAnswer& k) {
  SCOPED_TRACE(k.what);
  const PageGeometry g = page_geometry(k.format, k.dims, k.rows_per_page, k.placement);
  std::vector<float> x(static_cast<size_t>(k.dims), 0.0f);
  for (auto [i, v] : k.inputs) x[i] = v;
  Bytes pages(static_cast<size_t>(k.pages * g.page_stride), 0);
  encode_rows(g, x.data(), 1, &k.slot, as_span(pages), k.tensor_scale, k.options);
  Bytes want(pages.size(), 0);
  std::copy(k.data.begin(), k.data.end(), want.begin() + k.data_at);
  std::copy(k.scales.begin(), k.scales.end(), want.begin() + k.scales_at);
  for (size_t b = 0; b < want.size(); ++b) ASSERT_EQ(int{pages[b]}, int{want[b]}) << "byte " << b;
  std::vector<float> out(x.size(), 1.0f);
  decode_rows(g, as_span(pages), &k.slot, 1, out.data(), k.tensor_scale);
  for (int c = 0; c < k.dims; ++c) {
    const float expected = k.decoded.count(c) ? k.decoded.at(c) : 0.0f;
    ASSERT_EQ(bits_of(out[c]), bits_of(expected)) << "channel " << c << ": " << out[c] << " vs " << expected;
  }
}

// An fp8 tile with the rounding cases: saturation value, exact tie 1.0625 -> 1.0, signed zero,
// smallest subnormal, subnormal tie 1.5 * 2^-9 -> 2^-8, tie 17 -> 16. amax 448 -> scale 1 (byte 127).
const std::map<int, float> kFp8TileInputs = {{0, 448.0f}, {1, -448.0f}, {2, 1.0625f}, {4, -0.0f}, {5, 0x1p-9f}, {6, 0x1.8p-9f}, {7, 17.0f}};
const Bytes kFp8TileCodes = {0x7e, 0xfe, 0x38, 0x00, 0x80, 0x01, 0x02, 0x58};
const std::map<int, float> kFp8TileDecoded = {{0, 448.0f}, {1, -448.0f}, {2, 1.0f}, {4, -0.0f}, {5, 0x1p-9f}, {6, 0x1p-8f}, {7, 16.0f}};

// An e2m1 tile with every tie and the sign of zero; amax 6 -> scale 1.
const float kFp4TileInputs[16] = {6, -6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -0.1f, 0, -0.0f, 0.5f, 3, 1.5f, 4};
const Bytes kFp4TilePacked = {0xf7, 0x20, 0x42, 0x64, 0x86, 0x80, 0x51, 0x63};
const float kFp4TileDecoded[16] = {6, -6, 0, 1, 1, 2, 2, 4, 4, -0.0f, 0, -0.0f, 0.5f, 3, 1.5f, 4};

std::map<int, float> merged(std::initializer_list<std::map<int, float>> parts) {
  std::map<int, float> out;
  for (const auto& p : parts) out.insert(p.begin(), p.end());
  return out;
}
std::map<int, float> fill(int from, int count, float v) {
  std::map<int, float> out;
  for (int i = 0; i < count; ++i) out[from + i] = v;
  return out;
}
std::map<int, float> fp4_tile_at(int at, const float (&values)[16]) {
  std::map<int, float> out;
  for (int i = 0; i < 16; ++i) out[at + i] = values[i];
  return out;
}

// v41_fp8: tile 0 the rounding cases; tile 1 all 1e-6 (below both floors); tile 2 +-1e6
// (1e6 / 448 -> scale 2^12, byte 139; 1e6 / 4096 = 244.1 -> 240 = 0x77); other tiles zero.
// Amax floor: tile 1 scale 2^-22 (byte 105), 1e-6 / 2^-22 = 4.19 -> 4 (0x48).
// Ratio floor: scale 2^-13 (byte 114), 1e-6 / 2^-13 = 0.0082 = 4.19 * 2^-9 -> subnormal 4 (0x04).
const std::map<int, float> kV41Fp8Inputs = merged({kFp8TileInputs, fill(32, 32, 1e-6f), {{64, 1e6f}, {65, -1e6f}}});
const std::map<int, float> kV41Fp8Decoded = merged({kFp8TileDecoded, fill(32, 32, 0x1p-20f), {{64, 983040.0f}, {65, -983040.0f}}});

TEST(KvFormatKnownAnswer, V41Fp8) {
  // Slot 33 = page 1, row 1: data at 16896 + 512, scales at 16896 + 32 * 512 + 16.
  const Bytes data = concat({kFp8TileCodes, repeat(0, 24), repeat(0x48, 32), {0x77, 0xf7}});
  check_known_answer({"v41_fp8 amax floor", KvRowFormat::v41_fp8, 512, 32, 2, 33, PagePlacement::segregated,
                      kV41Fp8Inputs, data, 16896 + 512, concat({{127, 105, 139}, repeat(105, 13)}), 16896 + 16384 + 16,
                      kV41Fp8Decoded});
  const Bytes data_ratio = concat({kFp8TileCodes, repeat(0, 24), repeat(0x04, 32), {0x77, 0xf7}});
  check_known_answer({"v41_fp8 ratio floor", KvRowFormat::v41_fp8, 512, 32, 2, 33, PagePlacement::segregated,
                      kV41Fp8Inputs, data_ratio, 16896 + 512, concat({{127, 114, 139}, repeat(114, 13)}),
                      16896 + 16384 + 16, kV41Fp8Decoded, {Fp8ScaleFloor::ratio}});
  // Interleaved: slot 1 = record 1 at 528, its scales right after its 512 data bytes.
  check_known_answer({"v41_fp8 interleaved", KvRowFormat::v41_fp8, 512, 32, 1, 1, PagePlacement::interleaved,
                      kV41Fp8Inputs, data, 528, concat({{127, 105, 139}, repeat(105, 13)}), 528 + 512, kV41Fp8Decoded});
}

TEST(KvFormatKnownAnswer, V41Fp4) {
  // Tile 0: every e2m1 tie, scale 1 (0x38). Tile 1: zeros, scale 2^-9 (0x01, the floor).
  // Tile 2: amax 1e4 -> scale saturates at 448 (0x7e): 1e4 -> 6, -1000/448 = -2.23 -> -2, 100/448 -> 0.
  // Tile 3: amax 6.375 -> scale tie 1.0625 -> 1.0 (0x38): 6.375 -> 6, -2.75 -> -3.
  // Tile 4: amax 0.001 below the floor -> scale 2^-9: 0.512 -> 0.5, -0.256 -> -0.5.
  const std::map<int, float> inputs = merged({fp4_tile_at(0, kFp4TileInputs), {{32, 1e4f}, {33, -1000.0f}, {34, 100.0f}},
                                              {{48, 6.375f}, {49, -2.75f}}, {{64, 0.001f}, {65, -0.0005f}}});
  const std::map<int, float> decoded = merged({fp4_tile_at(0, kFp4TileDecoded), {{32, 2688.0f}, {33, -896.0f}},
                                               {{48, 6.0f}, {49, -3.0f}}, {{64, 0x1p-10f}, {65, -0x1p-10f}}});
  const Bytes data = concat({kFp4TilePacked, repeat(0, 8), {0xc7}, repeat(0, 7), {0xd7}, repeat(0, 7), {0x91}});
  const Bytes scales = concat({{0x38, 0x01, 0x7e, 0x38}, repeat(0x01, 28)});
  // Slot 65 = page 1, row 1: data at 18432 + 256, scales at 18432 + 64 * 256 + 32.
  check_known_answer({"v41_fp4", KvRowFormat::v41_fp4, 512, 64, 2, 65, PagePlacement::segregated, inputs, data,
                      18432 + 256, scales, 18432 + 16384 + 32, decoded});
  check_known_answer({"v41_fp4 interleaved", KvRowFormat::v41_fp4, 512, 64, 1, 2, PagePlacement::interleaved, inputs,
                      data, 2 * 288, scales, 2 * 288 + 256, decoded});
}

TEST(KvFormatKnownAnswer, Fp8DsMla) {
  // NoPE tiles of 64: tile 0 the rounding cases, tile 1 all 1e-6, tile 2 +-1e6, tiles 3-6 zero.
  // RoPE channels 448.. as raw bf16: 1.0, -2.5, 1 + 2^-8 (tie -> 1.0), 1 + 3 * 2^-8 (tie -> 1 + 2^-6).
  const std::map<int, float> inputs = merged({kFp8TileInputs, fill(64, 64, 1e-6f), {{128, 1e6f}, {129, -1e6f}},
                                              {{448, 1.0f}, {449, -2.5f}, {450, 1.00390625f}, {451, 1.01171875f}}});
  const std::map<int, float> decoded = merged({kFp8TileDecoded, fill(64, 64, 0x1p-20f), {{128, 983040.0f}, {129, -983040.0f}},
                                               {{448, 1.0f}, {449, -2.5f}, {450, 1.0f}, {451, 1.015625f}}});
  const Bytes rope = {0x80, 0x3f, 0x20, 0xc0, 0x80, 0x3f, 0x82, 0x3f};
  const Bytes data = concat({kFp8TileCodes, repeat(0, 56), repeat(0x48, 64), {0x77, 0xf7}, repeat(0, 318), rope});
  // Slot 65 = page 1, row 1: data at 37440 + 576, scales at 37440 + 64 * 576 + 8; byte 7 is 0.
  check_known_answer({"fp8_ds_mla amax floor", KvRowFormat::fp8_ds_mla, 512, 64, 2, 65, PagePlacement::segregated,
                      inputs, data, 37440 + 576, {127, 105, 139, 105, 105, 105, 105, 0}, 37440 + 36864 + 8, decoded});
  const Bytes data_ratio = concat({kFp8TileCodes, repeat(0, 56), repeat(0x04, 64), {0x77, 0xf7}, repeat(0, 318), rope});
  check_known_answer({"fp8_ds_mla ratio floor", KvRowFormat::fp8_ds_mla, 512, 64, 2, 65, PagePlacement::segregated,
                      inputs, data_ratio, 37440 + 576, {127, 114, 139, 114, 114, 114, 114, 0}, 37440 + 36864 + 8, decoded,
                      {Fp8ScaleFloor::ratio}});
}

TEST(KvFormatKnownAnswer, IndexMxfp4) {
  // Tile 0: the e2m1 ties, amax 6 -> 2^0 (byte 127). Tile 1: amax 3 -> 2^-1 (126): 3 -> 6,
  // 0.375 -> 0.75 ties up to 1, -0.625 -> -1.25 ties down to -1. Tile 2: zeros -> the floor
  // 6 * 2^-126 / 6 = 2^-126 (byte 1). Tile 3: amax 7 -> 2^1 (128): 3.5 -> 4, -2.5 -> -2.
  const std::map<int, float> inputs = merged({fp4_tile_at(0, kFp4TileInputs), {{32, 3.0f}, {33, 0.375f}, {34, -0.625f}},
                                              {{96, 7.0f}, {97, -5.0f}}});
  const std::map<int, float> decoded = merged({fp4_tile_at(0, kFp4TileDecoded), {{32, 3.0f}, {33, 0.5f}, {34, -0.5f}},
                                               {{96, 8.0f}, {97, -4.0f}}});
  const Bytes data = concat({kFp4TilePacked, repeat(0, 8), {0x27, 0x0a}, repeat(0, 30), {0xc6}});
  // Slot 1: data at 64, scales at 64 * 64 + 4.
  check_known_answer({"index_mxfp4", KvRowFormat::index_mxfp4, 128, 64, 1, 1, PagePlacement::segregated, inputs, data,
                      64, {127, 126, 1, 128}, 4096 + 4, decoded});
}

TEST(KvFormatKnownAnswer, IndexFp8) {
  // amax 7 = 448 * 2^-6 -> scale 2^-6 stored as fp32 0x3c800000: 7 -> 448, 1 -> 64, 17 * 2^-6 -> 17
  // ties to 16, -0 keeps its sign.
  const std::map<int, float> inputs = {{0, 7.0f}, {1, 1.0f}, {2, 17.0f / 64}, {3, -0.0f}, {4, -7.0f}};
  const std::map<int, float> decoded = {{0, 7.0f}, {1, 1.0f}, {2, 0.25f}, {3, -0.0f}, {4, -7.0f}};
  // Slot 2: values at 2 * 128, scale at 64 * 128 + 2 * 4.
  check_known_answer({"index_fp8", KvRowFormat::index_fp8, 128, 64, 1, 2, PagePlacement::segregated, inputs,
                      {0x7e, 0x68, 0x58, 0x80, 0xfe}, 256, {0x00, 0x00, 0x80, 0x3c}, 8192 + 8, decoded});
  // An all-zero row: scale 2^-22 (0x34800000) with the amax floor, 2^-13 (0x39000000) with the ratio floor.
  check_known_answer({"index_fp8 zero row", KvRowFormat::index_fp8, 128, 64, 1, 3, PagePlacement::segregated, {}, {},
                      384, {0x00, 0x00, 0x80, 0x34}, 8192 + 12, {}});
  check_known_answer({"index_fp8 zero row, ratio floor", KvRowFormat::index_fp8, 128, 64, 1, 3,
                      PagePlacement::segregated, {}, {}, 384, {0x00, 0x00, 0x00, 0x39}, 8192 + 12, {},
                      {Fp8ScaleFloor::ratio}});
}

TEST(KvFormatKnownAnswer, PlainRows) {
  // bf16: 1.0, -2.5, 1 + 2^-8 ties to 1.0, NaN stays the quiet NaN 0x7fc0. Slot 1 of 2-row pages.
  const float nan = float_from_bits(0x7fc00000u);
  check_known_answer({"bf16", KvRowFormat::bf16, 4, 2, 1, 1, PagePlacement::segregated,
                      {{0, 1.0f}, {1, -2.5f}, {2, 1.00390625f}, {3, nan}}, {0x80, 0x3f, 0x20, 0xc0, 0x80, 0x3f, 0xc0, 0x7f},
                      8, {}, 0, {{0, 1.0f}, {1, -2.5f}, {2, 1.0f}, {3, nan}}});
  // fp8_per_tensor, tensor scale 0.5: 224 -> 448, 1000 saturates, -0.25 -> -0.5, 0.265625 -> 0.53125
  // ties to 0.5.
  KnownAnswer per_tensor{"fp8_per_tensor", KvRowFormat::fp8_per_tensor, 4, 2, 1, 0, PagePlacement::segregated,
                         {{0, 224.0f}, {1, 1000.0f}, {2, -0.25f}, {3, 0.265625f}}, {0x7e, 0x7e, 0xb0, 0x30}, 0, {}, 0,
                         {{0, 224.0f}, {1, 224.0f}, {2, -0.25f}, {3, 0.25f}}};
  per_tensor.tensor_scale = 0.5f;
  check_known_answer(per_tensor);
  // f32: the bits themselves, little-endian, whatever the value: 1 + 2^-8 (which bf16 rounds), the
  // smallest subnormal, -0, -inf and a quiet NaN with a payload. Slot 4 of 3-row pages: page 1, row 1.
  const float payload_nan = float_from_bits(0x7fc00123u);
  const std::map<int, float> f32_values = {{0, 1.00390625f}, {1, 0x1p-149f}, {2, -0.0f},
                                           {3, -std::numeric_limits<float>::infinity()}, {4, payload_nan}};
  check_known_answer({"f32", KvRowFormat::f32, 5, 3, 2, 4, PagePlacement::segregated, f32_values,
                      {0x00, 0x80, 0x80, 0x3f, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x00, 0x00, 0x80, 0xff,
                       0x23, 0x01, 0xc0, 0x7f},
                      60 + 20, {}, 0, f32_values});
}

TEST(KvFormat, EncodeTouchesOnlyTheRowsBytes) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  std::normal_distribution<float> normal;
  for (KvRowFormat f : {KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::fp8_ds_mla, KvRowFormat::index_fp8}) {
    for (PagePlacement placement : {PagePlacement::segregated, PagePlacement::interleaved}) {
      const int64_t dims = f == KvRowFormat::index_fp8 ? 128 : 512;
      const PageGeometry g = page_geometry(f, dims, 8, placement);
      Bytes pages(static_cast<size_t>(2 * g.page_stride), 0xab);
      std::vector<float> x(static_cast<size_t>(dims));
      for (float& v : x) v = normal(rng);
      const int64_t slot = 13;  // page 1, row 5
      encode_rows(g, x.data(), 1, &slot, as_span(pages), 1.0f);
      const int64_t page = g.page_stride;
      for (int64_t b = 0; b < static_cast<int64_t>(pages.size()); ++b) {
        const bool in_data = b >= page + g.data_offset(5) && b < page + g.data_offset(5) + g.row.data_bytes;
        const bool in_scales = b >= page + g.scale_offset(5) && b < page + g.scale_offset(5) + g.row.scale_bytes;
        if (!in_data && !in_scales) {
          ASSERT_EQ(pages[b], 0xab) << kv_row_format_name(f) << " byte " << b;
        }
      }
    }
  }
}

// ---- Upstream bytes (tests/data/golden/kvfmt) -------------------------------------------------------------

struct Golden {
  std::shared_ptr<SafetensorsFile> file;
  std::vector<float> input;  // [rows, dims]
  int64_t rows = 0, dims = 0, rows_per_page = 0, page_stride = 0;

  explicit Golden(const std::string& name) {
    file = SafetensorsFile::open(std::string(DSV4_TEST_DATA_DIR) + "/golden/kvfmt/" + name);
    const HostTensor in = file->read_as("input", DType::f32);
    rows = in.size(0);
    dims = in.size(1);
    input.assign(in.as<float>(), in.as<float>() + in.numel());
    rows_per_page = std::stoll(file->metadata().at("rows_per_page"));
    page_stride = std::stoll(file->metadata().at("page_stride_bytes"));
  }
  Bytes bytes(const std::string& tensor) const {
    const HostTensor t = file->read(tensor);
    const auto* p = static_cast<const uint8_t*>(t.data());
    return Bytes(p, p + t.nbytes());
  }
  std::vector<int64_t> slots() const {
    std::vector<int64_t> s(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) s[i] = i;
    return s;
  }
  // Encodes every input row i, then `zero_rows` rows of zeros, at slots 0, 1, ... of `num_bytes`
  // of pages of `rows_per_page` rows.
  Bytes encode(KvRowFormat f, PagePlacement placement, int64_t pages_rows, EncodeOptions options, int64_t num_bytes,
               int64_t zero_rows = 0) const {
    const PageGeometry g = page_geometry(f, dims, pages_rows, placement);
    std::vector<float> x = input;
    x.resize(static_cast<size_t>((rows + zero_rows) * dims), 0.0f);
    std::vector<int64_t> all_slots(static_cast<size_t>(rows + zero_rows));
    for (size_t i = 0; i < all_slots.size(); ++i) all_slots[i] = static_cast<int64_t>(i);
    Bytes pages(static_cast<size_t>(num_bytes), 0);
    encode_rows(g, x.data(), rows + zero_rows, all_slots.data(), as_span(pages), 1.0f, options);
    return pages;
  }
  std::vector<float> decode(KvRowFormat f, const Bytes& pages) const {
    std::vector<float> out(input.size());
    decode_rows(page_geometry(f, dims, rows_per_page), as_span(pages), slots().data(), rows, out.data());
    return out;
  }
};

// Byte equality; `zero_codes_by_value`: e4m3 zero codes 0x00 and 0x80 count as equal (vLLM's
// V4.1 FP8 inserter writes +0 for -0). Returns the number of such sign-of-zero differences.
int expect_same_bytes(const Bytes& got, const Bytes& want, bool zero_codes_by_value = false) {
  EXPECT_EQ(got.size(), want.size());
  int signed_zero_differences = 0;
  for (size_t b = 0; b < std::min(got.size(), want.size()); ++b) {
    if (got[b] == want[b]) continue;
    if (zero_codes_by_value && (got[b] | 0x80) == 0x80 && (want[b] | 0x80) == 0x80) {
      ++signed_zero_differences;
      continue;
    }
    ADD_FAILURE() << "byte " << b << ": got 0x" << std::hex << int{got[b]} << ", upstream 0x" << int{want[b]};
    break;
  }
  return signed_zero_differences;
}

// Bitwise equality, except that zeros compare by value: vLLM's FP4 gather turns code 8 (-0) into +0.
void expect_same_floats(const std::vector<float>& got, const HostTensor& want) {
  ASSERT_EQ(static_cast<int64_t>(got.size()), want.numel());
  for (size_t i = 0; i < got.size(); ++i) {
    const float w = want.as<float>()[i];
    ASSERT_TRUE(bits_of(got[i]) == bits_of(w) || (got[i] == 0.0f && w == 0.0f)) << "element " << i << ": " << got[i] << " vs " << w;
  }
}

TEST(KvFormatUpstream, V41SwaFp8) {
  const Golden golden("v41_swa_fp8.safetensors");
  const Bytes vllm = golden.bytes("page_bytes");
  EXPECT_EQ(page_geometry(KvRowFormat::v41_fp8, golden.dims, golden.rows_per_page).page_stride, golden.page_stride);
  // vLLM's insert floors the ratio; only row 1 (all -0.0) differs, in the sign of its zeros.
  const Bytes ours = golden.encode(KvRowFormat::v41_fp8, PagePlacement::segregated, golden.rows_per_page,
                                   {Fp8ScaleFloor::ratio}, static_cast<int64_t>(vllm.size()));
  EXPECT_EQ(expect_same_bytes(ours, vllm, true), 256);  // the even channels of row 1
  // deepseek-ai FlashMLA's interleaved records (one unpadded page holding every row) keep -0.
  const Bytes records = golden.bytes("token_bytes_deepseek_interleaved");
  expect_same_bytes(golden.encode(KvRowFormat::v41_fp8, PagePlacement::interleaved, golden.rows,
                                  {Fp8ScaleFloor::ratio}, static_cast<int64_t>(records.size())),
                    records);
  // vLLM's decoder on vLLM's bytes.
  expect_same_floats(golden.decode(KvRowFormat::v41_fp8, vllm), golden.file->read("decoded"));
}

TEST(KvFormatUpstream, V41CompressedFp4) {
  const Golden golden("v41_compressed_fp4.safetensors");
  const Bytes flashmla = golden.bytes("page_bytes");
  EXPECT_EQ(page_geometry(KvRowFormat::v41_fp4, golden.dims, golden.rows_per_page).page_stride, golden.page_stride);
  expect_same_bytes(golden.encode(KvRowFormat::v41_fp4, PagePlacement::segregated, golden.rows_per_page, {},
                                  static_cast<int64_t>(flashmla.size())),
                    flashmla);
  const Bytes records = golden.bytes("token_bytes_deepseek_interleaved");
  expect_same_bytes(golden.encode(KvRowFormat::v41_fp4, PagePlacement::interleaved, golden.rows, {},
                                  static_cast<int64_t>(records.size())),
                    records);
  expect_same_floats(golden.decode(KvRowFormat::v41_fp4, flashmla), golden.file->read("decoded"));
}

TEST(KvFormatUpstream, Fp8DsMla) {
  const Golden golden("fp8_ds_mla.safetensors");
  const Bytes vllm = golden.bytes("page_bytes");
  EXPECT_EQ(page_geometry(KvRowFormat::fp8_ds_mla, golden.dims, golden.rows_per_page).page_stride, golden.page_stride);
  expect_same_bytes(golden.encode(KvRowFormat::fp8_ds_mla, PagePlacement::segregated, golden.rows_per_page, {},
                                  static_cast<int64_t>(vllm.size())),
                    vllm);
  // FlashMLA's test quantizer floors the ratio, and quantizes whole pages: the 8 slots after the
  // last row hold encoded zero rows.
  const Bytes flashmla = golden.bytes("page_bytes_flashmla_testquant");
  expect_same_bytes(golden.encode(KvRowFormat::fp8_ds_mla, PagePlacement::segregated, golden.rows_per_page,
                                  {Fp8ScaleFloor::ratio}, static_cast<int64_t>(flashmla.size()), 8),
                    flashmla);
  expect_same_floats(golden.decode(KvRowFormat::fp8_ds_mla, vllm), golden.file->read("decoded"));
}

TEST(KvFormatUpstream, IndexKeyFp8) {
  const Golden golden("index_k_fp8.safetensors");
  const Bytes vllm = golden.bytes("page_bytes");
  EXPECT_EQ(page_geometry(KvRowFormat::index_fp8, golden.dims, golden.rows_per_page).page_stride, golden.page_stride);
  expect_same_bytes(golden.encode(KvRowFormat::index_fp8, PagePlacement::segregated, golden.rows_per_page, {},
                                  static_cast<int64_t>(vllm.size())),
                    vllm);
}

// ---- Agreement with the reference fake quantizers ---------------------------------------------------------------

// Rows of normal values with a random magnitude 2^-30 ... 2^max_exponent per row (some rows far
// below the scale floors).
std::vector<float> random_rows(std::mt19937_64& rng, int64_t rows, int64_t dims, int max_exponent = 12) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-30, max_exponent);
  std::vector<float> x(static_cast<size_t>(rows * dims));
  for (int64_t r = 0; r < rows; ++r) {
    const float magnitude = std::ldexp(1.0f, exponent(rng));
    for (int64_t c = 0; c < dims; ++c) x[r * dims + c] = normal(rng) * magnitude;
  }
  return x;
}

// decode(encode(x)) for rows at shuffled slots of a pool with spare pages.
std::vector<float> round_trip(KvRowFormat f, const std::vector<float>& x, int64_t dims, std::mt19937_64& rng,
                              EncodeOptions options = {}, float tensor_scale = 1.0f,
                              PagePlacement placement = PagePlacement::segregated) {
  const int64_t rows = static_cast<int64_t>(x.size()) / dims;
  const PageGeometry g = page_geometry(f, dims, default_rows_per_page(f), placement);
  const int64_t pages = rows / g.rows_per_page + 2;
  std::vector<int64_t> slots(static_cast<size_t>(pages * g.rows_per_page));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int64_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(static_cast<size_t>(rows));
  Bytes buffer(static_cast<size_t>(pages * g.page_stride), 0);
  encode_rows(g, x.data(), rows, slots.data(), as_span(buffer), tensor_scale, options);
  std::vector<float> y(x.size());
  decode_rows(g, as_span(buffer), slots.data(), rows, y.data(), tensor_scale);
  return y;
}

using TileQuantizer = std::function<void(const float*, float*, int)>;

void expect_equals_fake_quant(const std::vector<float>& x, const std::vector<float>& y, int tile, const TileQuantizer& fake) {
  std::vector<float> want(x.size());
  for (size_t t = 0; t < x.size(); t += tile) fake(x.data() + t, want.data() + t, tile);
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(bits_of(y[i]), bits_of(want[i])) << "element " << i << ": x " << x[i] << ", decoded " << y[i] << ", fake quant " << want[i];
}

TEST(KvFormatFakeQuant, DecodeOfEncodeIsTheReferenceFakeQuantization) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const std::vector<float> heads = random_rows(rng, 150, 512), keys = random_rows(rng, 150, 128);
  for (PagePlacement placement : {PagePlacement::segregated, PagePlacement::interleaved}) {
    for (Fp8ScaleFloor floor : {Fp8ScaleFloor::amax, Fp8ScaleFloor::ratio})
      expect_equals_fake_quant(heads, round_trip(KvRowFormat::v41_fp8, heads, 512, rng, {floor}, 1.0f, placement), 32,
                               [floor](const float* x, float* y, int n) { fake_quant_fp8_ue8m0(x, y, n, floor); });
    expect_equals_fake_quant(heads, round_trip(KvRowFormat::v41_fp4, heads, 512, rng, {}, 1.0f, placement), 16,
                             fake_quant_fp4_e4m3);
    expect_equals_fake_quant(keys, round_trip(KvRowFormat::index_mxfp4, keys, 128, rng, {}, 1.0f, placement), 32,
                             fake_quant_fp4_ue8m0);
    // index_fp8: one act_quant tile over the whole key.
    expect_equals_fake_quant(keys, round_trip(KvRowFormat::index_fp8, keys, 128, rng, {}, 1.0f, placement), 128,
                             [](const float* x, float* y, int n) { fake_quant_fp8_ue8m0(x, y, n); });
  }
}

TEST(KvFormatFakeQuant, GoldenInputsToo) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (const char* name : {"v41_swa_fp8.safetensors", "v41_compressed_fp4.safetensors"}) {
    const Golden golden(name);
    expect_equals_fake_quant(golden.input, round_trip(KvRowFormat::v41_fp8, golden.input, 512, rng), 32,
                             [](const float* x, float* y, int n) { fake_quant_fp8_ue8m0(x, y, n); });
    expect_equals_fake_quant(golden.input, round_trip(KvRowFormat::v41_fp4, golden.input, 512, rng), 16,
                             fake_quant_fp4_e4m3);
  }
}

TEST(KvFormatFakeQuant, Fp8DsMlaIsActQuantOnNopeAndBf16OnRope) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const std::vector<float> x = random_rows(rng, 100, 512);
  const std::vector<float> y = round_trip(KvRowFormat::fp8_ds_mla, x, 512, rng);
  for (size_t r = 0; r < 100; ++r) {
    float want[512];
    for (int t = 0; t < 7; ++t) fake_quant_fp8_ue8m0(&x[r * 512 + t * 64], want + t * 64, 64);
    for (int c = 448; c < 512; ++c) want[c] = round_to_bf16(x[r * 512 + c]);
    for (int c = 0; c < 512; ++c) ASSERT_EQ(bits_of(y[r * 512 + c]), bits_of(want[c])) << "row " << r << " channel " << c;
  }
}

// ---- Round-trip error bounds --------------------------------------------------------------------------------

// |decoded - x| against bounds derived from each format's grid and the tile amax alone.
double error_bound(KvRowFormat f, double x, double amax, double tensor_scale) {
  const double a = std::fabs(x);
  switch (f) {
    case KvRowFormat::f32:
      return 0.0;  // the value itself
    case KvRowFormat::bf16:
      return a * 0x1p-8;  // half an ulp with 7 mantissa bits
    case KvRowFormat::fp8_per_tensor:
      // e4m3: half an ulp (3 mantissa bits) is <= 2^-4 relative; below 2^-6 the grid step is 2^-9 (x / tensor_scale units).
      return std::max(a * 0x1p-4, 0x1p-10 * tensor_scale);
    case KvRowFormat::v41_fp8: case KvRowFormat::fp8_ds_mla: case KvRowFormat::index_fp8:
      // As above, with the scale 2^ceil(log2(max(amax, 1e-4) / 448)) < 2 * max(amax, 1e-4) / 448.
      return std::max(a * 0x1p-4, 0x1p-10 * 2.0 * std::max(amax, 1e-4) / 448.0);
    case KvRowFormat::index_mxfp4: {
      // e2m1 gaps are 0.5 up to 2, 1 up to 4, 2 up to 6: the error is <= max(|x| / 4, scale / 4),
      // with the scale 2^ceil(log2(r)) < 2r, r = max(amax, 6 * 2^-126) / 6.
      const double r = std::max(amax, 6.0 * 0x1p-126) / 6.0;
      return std::max(a / 4, 2.0 * r / 4);
    }
    case KvRowFormat::v41_fp4: {
      // The scale is e4m3(r), r = max(amax, 6 * 2^-9) / 6, within d = max(r / 16, 2^-10) of r; a
      // scale rounded down can push |x| / scale past 6, where the codes saturate.
      const double r = std::max(amax, 6.0 * 0x1p-9) / 6.0, d = std::max(r / 16, 0x1p-10);
      return std::max(a / 4, (r + d) / 4) + std::max(0.0, a - 6.0 * (r - d));
    }
  }
  return 0.0;
}

TEST(KvFormatRoundTrip, ErrorBounds) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  const float tensor_scale = 0.37f;
  struct Case { KvRowFormat f; int64_t dims; int tile; };
  for (const Case& c : {Case{KvRowFormat::v41_fp8, 512, 32}, Case{KvRowFormat::fp8_ds_mla, 512, 64},
                        Case{KvRowFormat::v41_fp4, 512, 16}, Case{KvRowFormat::index_mxfp4, 128, 32},
                        Case{KvRowFormat::index_fp8, 128, 128}, Case{KvRowFormat::bf16, 96, 96},
                        Case{KvRowFormat::fp8_per_tensor, 96, 96}, Case{KvRowFormat::f32, 96, 96}}) {
    SCOPED_TRACE(kv_row_format_name(c.f));
    // Magnitudes up to ~2^8 keep the e4m3 scales of v41_fp4 (<= 448) and x / tensor_scale (<= 448)
    // unsaturated.
    std::vector<float> x = random_rows(rng, 80, c.dims, 8);
    if (c.f == KvRowFormat::fp8_per_tensor)
      for (float& v : x) v = std::clamp(v, -150.0f, 150.0f);
    const std::vector<float> y = round_trip(c.f, x, c.dims, rng, {}, tensor_scale);
    for (size_t t = 0; t < x.size(); t += c.tile) {
      double amax = 0.0;
      for (int i = 0; i < c.tile; ++i) amax = std::max(amax, std::fabs(double{x[t + i]}));
      for (int i = 0; i < c.tile; ++i) {
        const double xi = x[t + i];
        // fp8_ds_mla keeps its RoPE channels in bf16.
        const bool rope = c.f == KvRowFormat::fp8_ds_mla && (t + i) % 512 >= 448;
        const double bound = error_bound(rope ? KvRowFormat::bf16 : c.f, xi, amax, tensor_scale);
        ASSERT_LE(std::fabs(double{y[t + i]} - xi), bound) << "element " << t + i << ": x " << xi << ", decoded " << y[t + i];
      }
    }
  }
}

// ---- Errors --------------------------------------------------------------------------------------------------

TEST(KvFormatErrors, BadDimsRowsAndNames) {
  expect_error_containing([] { row_layout(KvRowFormat::v41_fp8, 128); }, "dsv4: kv_format: v41_fp8 rows have 512 channels, got dims 128");
  expect_error_containing([] { row_layout(KvRowFormat::fp8_ds_mla, 576); }, "fp8_ds_mla rows have 512 channels, got dims 576");
  expect_error_containing([] { row_layout(KvRowFormat::index_mxfp4, 100); }, "index_mxfp4 rows: dims is 100, expected a multiple of 32");
  expect_error_containing([] { row_layout(KvRowFormat::bf16, 0); }, "bf16 rows: dims is 0, expected 1 ... 1048576");
  expect_error_containing([] { row_layout(static_cast<KvRowFormat>(99), 512); }, "unknown row format value 99");
  expect_error_containing([] { page_geometry(KvRowFormat::v41_fp4, 512, 0); }, "page_geometry: rows_per_page is 0, expected 1 ... 1048576");
  expect_error_containing([] { parse_kv_row_format("fp9"); }, "unknown row format 'fp9', expected one of bf16, fp8_per_tensor, v41_fp8");
  expect_error_containing([] { kv_format_set("v4.2"); }, "unknown KV format set 'v4.2', expected one of v4.1-native, fp8_ds_mla, bf16, fp8, f32");
}

TEST(KvFormatErrors, BadEncodeAndDecodeCalls) {
  const PageGeometry g = page_geometry(KvRowFormat::v41_fp4, 512, 64);
  Bytes pages(static_cast<size_t>(2 * g.page_stride), 0);
  std::vector<float> x(512, 1.0f), out(512);
  const int64_t outside = 128, inside = 127, skipped = -1;
  expect_error_containing([&] { encode_rows(g, x.data(), 1, &outside, as_span(pages)); },
                          "dsv4: kv_format: encode_rows: slot 128 of row 0 is outside the buffer of 2 pages x 64 rows");
  expect_error_containing([&] { decode_rows(g, as_span(std::as_const(pages)), &outside, 1, out.data()); },
                          "decode_rows: slot 128 of row 0 is outside the buffer of 2 pages");
  expect_error_containing([&] { encode_rows(g, x.data(), -1, &inside, as_span(pages)); }, "encode_rows: row count -1, expected >= 0");
  expect_error_containing([&] { encode_rows(g, nullptr, 1, &inside, as_span(pages)); }, "encode_rows: null rows or slots pointer");
  expect_error_containing([&] { encode_rows(g, x.data(), 1, &inside, static_cast<std::byte*>(nullptr)); },
                          "encode_rows: null pages pointer for slot 127");
  PageGeometry tampered = g;
  tampered.page_stride += 1;
  expect_error_containing([&] { encode_rows(tampered, x.data(), 1, &inside, as_span(pages)); },
                          "encode_rows: the geometry of v41_fp4 with dims 512 and 64 rows per page has page stride 18433, expected 18432");
  const PageGeometry per_tensor = page_geometry(KvRowFormat::fp8_per_tensor, 512, 64);
  Bytes per_tensor_pages(static_cast<size_t>(per_tensor.page_stride), 0);
  expect_error_containing([&] { encode_rows(per_tensor, x.data(), 1, &inside, as_span(per_tensor_pages), 0.0f); },
                          "fp8_per_tensor tensor_scale is 0, expected finite and > 0");
  // Nothing was written by the failed calls; a skipped slot needs no buffer; decoding it gives zeros.
  for (uint8_t b : pages) ASSERT_EQ(b, 0);
  encode_rows(g, x.data(), 1, &skipped, std::span<std::byte>{});
  decode_rows(g, std::span<const std::byte>{}, &skipped, 1, out.data());
  for (float v : out) ASSERT_EQ(bits_of(v), 0u);
}

}  // namespace
}  // namespace dsv4

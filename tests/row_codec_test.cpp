// The row codec (src/cache/row_codec.h) on random rows of every format, fixed seed: decode of encode
// is the value kv_format.h documents for the format (the reference fake quantization, bf16 or
// e4m3 rounding), the per-channel decode agrees with the row decode and with decode_rows, tiles
// encoded in any order give encode_rows' bytes (as device threads write them), and the codec's
// byte counts are row_layout's.
#include "cache/row_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "dsv4/kv_format.h"
#include "dsv4/numeric.h"

namespace dsv4 {
namespace {

constexpr uint64_t kSeed = 0x5eed'c0dec;
constexpr float kTensorScale = 0.37f;

struct Case {
  KvRowFormat format;
  int dims;
};
// Every format at the widths the caches use (and an odd width for the unscaled ones).
const Case kCases[] = {{KvRowFormat::bf16, 512},        {KvRowFormat::bf16, 77},
                       {KvRowFormat::fp8_per_tensor, 512}, {KvRowFormat::fp8_per_tensor, 77},
                       {KvRowFormat::v41_fp8, 512},     {KvRowFormat::v41_fp4, 512},
                       {KvRowFormat::fp8_ds_mla, 512},  {KvRowFormat::index_mxfp4, 128},
                       {KvRowFormat::index_fp8, 128},   {KvRowFormat::f32, 512},
                       {KvRowFormat::f32, 77}};

// Rows whose values span many binades (subnormal scales, saturation, exact zeros, all-zero tiles).
std::vector<float> random_row(std::mt19937_64& rng, int dims) {
  std::uniform_int_distribution<int> exponent(-40, 12), kind(0, 15);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  const int row_exponent = exponent(rng);
  std::vector<float> x(static_cast<size_t>(dims));
  for (float& v : x) {
    const int k = kind(rng);
    v = k == 0 ? 0.0f : std::ldexp(mantissa(rng), row_exponent + (k % 5) - 2) * (k % 2 ? -1.0f : 1.0f);
  }
  if (kind(rng) == 0) std::fill(x.begin(), x.begin() + std::min(dims, 64), 0.0f);
  return x;
}

// What kv_format.h documents decode(encode(x)) to be.
std::vector<float> documented_value(KvRowFormat f, const std::vector<float>& x, Fp8ScaleFloor floor) {
  const int dims = static_cast<int>(x.size());
  std::vector<float> y(x.size());
  const auto tiles = [&](int first, int end, int tile, const std::function<void(const float*, float*, int)>& fake) {
    for (int t = first; t < end; t += tile) fake(x.data() + t, y.data() + t, std::min(tile, end - t));
  };
  const auto fp8 = [floor](const float* in, float* out, int n) { fake_quant_fp8_ue8m0(in, out, n, floor); };
  switch (f) {
    case KvRowFormat::bf16:
      for (int c = 0; c < dims; ++c) y[c] = round_to_bf16(x[c]);
      break;
    case KvRowFormat::fp8_per_tensor:
      for (int c = 0; c < dims; ++c) y[c] = e4m3_to_float(float_to_e4m3(x[c] / kTensorScale)) * kTensorScale;
      break;
    case KvRowFormat::v41_fp8: tiles(0, dims, 32, fp8); break;
    case KvRowFormat::v41_fp4: tiles(0, dims, 16, fake_quant_fp4_e4m3); break;
    case KvRowFormat::fp8_ds_mla:
      tiles(0, 448, 64, fp8);
      for (int c = 448; c < dims; ++c) y[c] = round_to_bf16(x[c]);
      break;
    case KvRowFormat::index_mxfp4: tiles(0, dims, 32, fake_quant_fp4_ue8m0); break;
    case KvRowFormat::index_fp8: tiles(0, dims, dims, fp8); break;
    case KvRowFormat::f32: y = x; break;
  }
  return y;
}

uint32_t bits_of(float f) { return float_bits(f); }

TEST(RowCodec, ByteCountsAreRowLayouts) {
  for (const Case& c : kCases) {
    const RowLayout layout = row_layout(c.format, c.dims);
    EXPECT_EQ(row_codec::data_bytes(c.format, c.dims), layout.data_bytes) << kv_row_format_name(c.format);
    EXPECT_EQ(row_codec::scale_bytes(c.format, c.dims), layout.scale_bytes) << kv_row_format_name(c.format);
  }
}

TEST(RowCodec, RoundTripIsTheDocumentedValue) {
  std::mt19937_64 rng(kSeed);
  for (const Case& c : kCases) {
    for (Fp8ScaleFloor floor : {Fp8ScaleFloor::amax, Fp8ScaleFloor::ratio}) {
      SCOPED_TRACE(std::string(kv_row_format_name(c.format)) + " dims " + std::to_string(c.dims) +
                   (floor == Fp8ScaleFloor::amax ? " amax floor" : " ratio floor"));
      const RowLayout layout = row_layout(c.format, c.dims);
      for (int r = 0; r < 200; ++r) {
        const std::vector<float> x = random_row(rng, c.dims);
        std::vector<uint8_t> data(static_cast<size_t>(layout.data_bytes)), scales(static_cast<size_t>(layout.scale_bytes) + 1);
        row_codec::encode_row(c.format, c.dims, x.data(), data.data(), scales.data(), kTensorScale, floor);
        std::vector<float> y(x.size());
        row_codec::decode_row(c.format, c.dims, data.data(), scales.data(), kTensorScale, y.data());
        const std::vector<float> want = documented_value(c.format, x, floor);
        for (int ch = 0; ch < c.dims; ++ch)
          ASSERT_EQ(bits_of(y[ch]), bits_of(want[ch])) << "row " << r << " channel " << ch << ": x " << x[ch]
                                                       << ", decoded " << y[ch] << ", documented " << want[ch];
        // Channel by channel, as the kernels decode.
        row_codec::visit_format(c.format, [&](auto f) {
          for (int ch = 0; ch < c.dims; ++ch)
            ASSERT_EQ(bits_of(row_codec::decode_channel<decltype(f)::value>(data.data(), scales.data(), ch, kTensorScale)),
                      bits_of(y[ch]))
                << "row " << r << " channel " << ch;
        });
      }
    }
  }
}

TEST(RowCodec, TilesInAnyOrderGiveEncodeRowsBytesInPages) {
  std::mt19937_64 rng(kSeed + 1);
  for (const Case& c : kCases) {
    for (PagePlacement placement : {PagePlacement::segregated, PagePlacement::interleaved}) {
      SCOPED_TRACE(std::string(kv_row_format_name(c.format)) + " dims " + std::to_string(c.dims));
      const PageGeometry g = page_geometry(c.format, c.dims, 8, placement);
      const int64_t rows = 24;
      std::vector<float> x;
      std::vector<int64_t> slots(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<float> row = random_row(rng, c.dims);
        x.insert(x.end(), row.begin(), row.end());
        slots[static_cast<size_t>(r)] = (r * 7) % rows;  // rows land out of order on 3 pages
      }
      std::vector<std::byte> want(static_cast<size_t>(3 * g.page_stride), std::byte{0});
      const EncodeOptions options{Fp8ScaleFloor::ratio};
      encode_rows(g, x.data(), rows, slots.data(), std::span<std::byte>(want), kTensorScale, options);

      std::vector<std::byte> got(want.size(), std::byte{0});
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[static_cast<size_t>(r)];
        auto* page = reinterpret_cast<uint8_t*>(got.data()) + slot / g.rows_per_page * g.page_stride;
        std::vector<int> order(static_cast<size_t>(row_codec::encode_tile_count(c.format, c.dims)));
        for (size_t t = 0; t < order.size(); ++t) order[t] = static_cast<int>(t);
        std::shuffle(order.begin(), order.end(), rng);
        for (int t : order)
          row_codec::encode_tile(c.format, c.dims, x.data() + r * c.dims, t, page + g.data_offset(slot % g.rows_per_page),
                                 page + g.scale_offset(slot % g.rows_per_page), kTensorScale, options.fp8_scale_floor);
      }
      ASSERT_TRUE(got == want);

      std::vector<float> decoded(x.size()), row(static_cast<size_t>(c.dims));
      decode_rows(g, std::span<const std::byte>(want), slots.data(), rows, decoded.data(), kTensorScale);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[static_cast<size_t>(r)];
        const auto* page = reinterpret_cast<const uint8_t*>(want.data()) + slot / g.rows_per_page * g.page_stride;
        row_codec::decode_row(c.format, c.dims, page + g.data_offset(slot % g.rows_per_page),
                              page + g.scale_offset(slot % g.rows_per_page), kTensorScale, row.data());
        ASSERT_EQ(std::memcmp(row.data(), decoded.data() + r * c.dims, row.size() * sizeof(float)), 0) << "row " << r;
      }
    }
  }
}

}  // namespace
}  // namespace dsv4

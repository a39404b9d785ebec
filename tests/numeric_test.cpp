// dsv4/numeric.h against slow, independent oracles (nearest-value search over each format's value
// grid, with the tie rule written out) and, where the CUDA headers exist, against CUDA's own host
// conversions. Random inputs come from a fixed seed, printed on failure (DSV4_TEST_SEED=<n> or random overrides).
#include "dsv4/numeric.h"
#include "test_seed.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(DSV4_HAVE_CUDA_FP_HEADERS)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#if __has_include(<cuda_fp4.h>)
#include <cuda_fp4.h>
#define DSV4_HAVE_CUDA_FP4_HEADER 1
#endif
#endif

namespace dsv4 {
namespace {

// The header's conversions are constexpr on the host.
static_assert(float_to_e4m3(448.0f) == 0x7e && float_to_e4m3(-0.0f) == 0x80);
static_assert(e2m1_to_float(0xf) == -6.0f && float_to_e2m1(2.5f) == 0x4);
static_assert(float_to_bf16_bits(1.0f) == 0x3f80 && ceil_log2_exponent(3.0f) == 2);

using test::test_seed;

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// A finite float with random sign, mantissa and an exponent in [lo, hi].
float random_float(std::mt19937_64& rng, int lo, int hi) {
  std::uniform_int_distribution<int> exponent(lo, hi);
  const uint32_t sign = static_cast<uint32_t>(rng() & 1u) << 31;
  const uint32_t field = static_cast<uint32_t>(exponent(rng) + 127);
  return from_bits(sign | (field << 23) | static_cast<uint32_t>(rng() & 0x7fffffu));
}

// ---- Oracles --------------------------------------------------------------------------------------

// e4m3fn value of a code from the format definition.
double e4m3_value(int code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const double magnitude = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}
// e2m1 magnitudes of codes 0..7.
constexpr double kE2m1Grid[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
double e2m1_value(int code) { return kE2m1Grid[code]; }

// Nearest of codes 0..max_code on a grid, ties to the even code; saturates at the largest value.
template <class Value>
int nearest_code(double magnitude, int max_code, Value value) {
  int best = 0;
  for (int c = 1; c <= max_code; ++c) {
    const double d = std::fabs(magnitude - value(c)), best_d = std::fabs(magnitude - value(best));
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c;
  }
  return best;
}

uint8_t oracle_e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | nearest_code(std::fabs(double{x}), 0x7e, e4m3_value));
}

uint8_t oracle_e2m1(float x) {
  if (std::isnan(x)) return 0x7;
  const int sign = std::signbit(x) ? 0x8 : 0;
  if (std::isinf(x)) return static_cast<uint8_t>(sign | 7);
  return static_cast<uint8_t>(sign | nearest_code(std::fabs(double{x}), 7, e2m1_value));
}

// bf16 by comparing the two bf16 neighbours of x in double precision.
uint16_t oracle_bf16(float x) {
  const uint32_t bits = to_bits(x);
  const uint32_t down = bits >> 16;
  const double magnitude = std::fabs(double{x});
  const double low = std::fabs(double{from_bits(down << 16)});
  // The neighbour above the largest finite bf16 is 2^128 (then the result is inf).
  const double high = (down & 0x7fff) == 0x7f7f ? std::ldexp(1.0, 128) : std::fabs(double{from_bits((down + 1) << 16)});
  const double d_low = magnitude - low, d_high = high - magnitude;
  const bool up = d_high < d_low || (d_high == d_low && (down & 1));
  return static_cast<uint16_t>(down + (up ? 1 : 0));
}

// ceil(log2(x)) for x > 0 via frexp: x = f * 2^e with f in [0.5, 1).
int oracle_ceil_log2(float x) {
  int e = 0;
  const double f = std::frexp(double{x}, &e);
  return f == 0.5 ? e - 1 : e;
}

// ---- bf16 -----------------------------------------------------------------------------------------

TEST(Bf16, EveryBitPatternRoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = bf16_bits_to_float(static_cast<uint16_t>(b));
    ASSERT_EQ(to_bits(f), b << 16);
    const uint16_t back = float_to_bf16_bits(f);
    if (std::isnan(f)) {
      // NaN stays NaN with its sign and the quiet bit set.
      ASSERT_TRUE(std::isnan(bf16_bits_to_float(back))) << b;
      ASSERT_EQ(back & 0x8000u, b & 0x8000u);
      ASSERT_EQ(back & 0x0040u, 0x0040u);
    } else {
      ASSERT_EQ(back, b);
    }
  }
}

TEST(Bf16, MatchesNearestEvenOracle) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    // Half the samples sit exactly on or next to a tie (low half 0x8000 +- 1).
    if (i & 1) bits = (bits & 0xffff0000u) | (0x7fffu + static_cast<uint32_t>(rng() % 3));
    const float x = from_bits(bits);
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16_bits(x), oracle_bf16(x)) << std::hexfloat << x;
  }
}

TEST(Bf16, TiesOverflowAndSpecials) {
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x3f808000u)), 0x3f80);  // tie, even below
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x3f818000u)), 0x3f82);  // tie, even above
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x00018000u)), 0x0002);  // subnormal tie
  const uint16_t nan = float_to_bf16_bits(from_bits(0xff800001u));  // signalling NaN, payload low
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(nan)));
  EXPECT_EQ(nan, 0xffc0);
  EXPECT_EQ(round_to_bf16(1.00390625f), 1.0f);
  EXPECT_EQ(round_to_bf16(1.01171875f), 1.015625f);
}

// ---- e4m3 -----------------------------------------------------------------------------------------

TEST(E4m3, EveryCodeDecodesAndRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float f = e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << code;
      continue;
    }
    EXPECT_EQ(double{f}, e4m3_value(code)) << code;
    EXPECT_EQ(std::signbit(f), (code & 0x80) != 0) << code;
    EXPECT_EQ(float_to_e4m3(f), code) << code;
  }
}

TEST(E4m3, EveryMidpointRoundsToTheEvenCode) {
  for (int code = 0; code < 0x7e; ++code) {
    const float mid = static_cast<float>((e4m3_value(code) + e4m3_value(code + 1)) / 2);  // exact in fp32
    const int even = (code & 1) ? code + 1 : code;
    EXPECT_EQ(float_to_e4m3(mid), even) << "midpoint after code " << code;
    EXPECT_EQ(float_to_e4m3(-mid), 0x80 | even);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 0.0f)), code);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 1000.0f)), code + 1);
  }
}

TEST(E4m3, SaturationSpecialsAndSubnormals) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(463.99f), 0x7e);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);  // would round to 480 without saturation
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(0x1p-9f), 0x01);     // smallest subnormal
  EXPECT_EQ(float_to_e4m3(0x1p-10f), 0x00);    // half of it: tie to zero
  EXPECT_EQ(float_to_e4m3(-0x1p-10f), 0x80);   // ... keeping the sign
  EXPECT_EQ(float_to_e4m3(0x1.000002p-10f), 0x01);
  EXPECT_EQ(float_to_e4m3(0x1.cp-7f), 0x07);   // 7 * 2^-9, largest subnormal
  EXPECT_EQ(float_to_e4m3(0x1.ep-7f), 0x08);   // 7.5 * 2^-9 ties up to the smallest normal
  EXPECT_EQ(float_to_e4m3(1e-40f), 0x00);      // fp32 subnormal input
  EXPECT_EQ(float_to_e4m3(-1e-40f), 0x80);
}

TEST(E4m3, MatchesNearestEvenOracleOnRandomFloats) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int i = 0; i < 300000; ++i) {
    const float x = (i & 1) ? random_float(rng, -14, 10) : from_bits(static_cast<uint32_t>(rng()));
    ASSERT_EQ(float_to_e4m3(x), oracle_e4m3(x)) << std::hexfloat << x;
  }
}

// ---- ue8m0 ----------------------------------------------------------------------------------------

TEST(Ue8m0, CeilLog2IsExactAcrossTheRange) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  // Every fp32 exponent (subnormals included): the power of two, its neighbours and random mantissas.
  for (uint32_t field = 0; field < 255; ++field) {
    const uint32_t base = field << 23;
    for (uint32_t m : {0u, 1u, 2u, 0x400000u, 0x7fffffu, static_cast<uint32_t>(rng() & 0x7fffffu)}) {
      const float x = from_bits(base | m);
      if (x == 0.0f) continue;
      ASSERT_EQ(ceil_log2_exponent(x), oracle_ceil_log2(x)) << std::hexfloat << x;
    }
  }
  // Every fp32 subnormal.
  for (uint32_t m = 1; m < 0x800000u; ++m) ASSERT_EQ(ceil_log2_exponent(from_bits(m)), oracle_ceil_log2(from_bits(m))) << m;
  EXPECT_EQ(ceil_log2_exponent(448.0f), 9);
  EXPECT_EQ(ceil_log2_exponent(256.0f), 8);
  EXPECT_EQ(ceil_log2_exponent(std::nextafter(256.0f, 0.0f)), 8);
  EXPECT_EQ(ceil_log2_exponent(std::nextafter(256.0f, 1e9f)), 9);
  EXPECT_EQ(ceil_log2_exponent(0.0f), -150);
  EXPECT_EQ(ceil_log2_exponent(std::numeric_limits<float>::infinity()), 128);
}

TEST(Ue8m0, BytesAndValues) {
  for (int b = 0; b < 255; ++b) EXPECT_EQ(double{ue8m0_to_float(static_cast<uint8_t>(b))}, std::ldexp(1.0, b - 127)) << b;
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
  EXPECT_EQ(ue8m0_from_exponent(0), 127);
  EXPECT_EQ(ue8m0_from_exponent(-22), 105);
  EXPECT_EQ(ue8m0_from_exponent(-127), 0);
  EXPECT_EQ(ue8m0_from_exponent(-200), 0);
  EXPECT_EQ(ue8m0_from_exponent(127), 254);
  EXPECT_EQ(ue8m0_from_exponent(129), 254);
}

// ---- e2m1 -----------------------------------------------------------------------------------------

TEST(E2m1, EveryCodeDecodesAndRoundTrips) {
  for (int code = 0; code < 16; ++code) {
    const float f = e2m1_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(std::fabs(double{f}), kE2m1Grid[code & 7]) << code;
    EXPECT_EQ(std::signbit(f), (code & 8) != 0) << code;
    EXPECT_EQ(float_to_e2m1(f), code) << code;
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(code | 0xf0)), f) << "high bits are ignored";
  }
}

TEST(E2m1, TiesGoToTheEvenCode) {
  const struct { float x; float rounded; } ties[] = {
      {0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f}, {1.75f, 2.0f}, {2.5f, 2.0f}, {3.5f, 4.0f}, {5.0f, 4.0f}};
  for (const auto& t : ties) {
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(t.x)), t.rounded) << t.x;
    EXPECT_EQ(e2m1_to_float(float_to_e2m1(-t.x)), -t.rounded) << -t.x;
    EXPECT_EQ(float_to_e2m1(t.x), oracle_e2m1(t.x));
  }
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);  // negative rounding to zero keeps the sign
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(float_to_e2m1(0.0f), 0x0);
  EXPECT_EQ(float_to_e2m1(7.0f), 0x7);
  EXPECT_EQ(float_to_e2m1(-1e30f), 0xf);
  EXPECT_EQ(float_to_e2m1(std::numeric_limits<float>::infinity()), 0x7);
  EXPECT_EQ(float_to_e2m1(-std::numeric_limits<float>::quiet_NaN()), 0x7);
}

TEST(E2m1, MatchesNearestEvenOracleOnRandomFloats) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int i = 0; i < 300000; ++i) {
    float x = random_float(rng, -4, 3);
    // Every eighth sample is a midpoint or its neighbour.
    if (i % 8 == 0) {
      const int c = static_cast<int>(rng() % 7);
      x = static_cast<float>((kE2m1Grid[c] + kE2m1Grid[c + 1]) / 2);
      if (rng() & 1) x = std::nextafter(x, (rng() & 1) ? 0.0f : 10.0f);
      if (rng() & 1) x = -x;
    }
    ASSERT_EQ(float_to_e2m1(x), oracle_e2m1(x)) << std::hexfloat << x;
  }
}

TEST(E2m1, PackingPutsTheEvenElementInTheLowNibble) {
  const uint8_t packed[2] = {pack_e2m1x2(0x3, 0xc), pack_e2m1x2(0x17, 0x8)};
  EXPECT_EQ(packed[0], 0xc3);
  EXPECT_EQ(packed[1], 0x87);  // high bits of the inputs are dropped
  EXPECT_EQ(unpack_e2m1(packed, 0), 0x3);
  EXPECT_EQ(unpack_e2m1(packed, 1), 0xc);
  EXPECT_EQ(unpack_e2m1(packed, 2), 0x7);
  EXPECT_EQ(unpack_e2m1(packed, 3), 0x8);
}

// ---- Fake quantizers --------------------------------------------------------------------------------

float oracle_abs_max(const std::vector<float>& x) {
  double amax = 0.0;
  for (float v : x) amax = std::max(amax, std::fabs(double{v}));
  return static_cast<float>(amax);
}

// SPEC §8.2 written out with the oracles above; every float operation the reference does in fp32
// is done in fp32 here too.
std::vector<float> oracle_fake_fp8(const std::vector<float>& x, Fp8ScaleFloor floor) {
  const float amax = oracle_abs_max(x);
  const float ratio = floor == Fp8ScaleFloor::amax ? std::max(amax, 1e-4f) / 448.0f : std::max(amax / 448.0f, 1e-4f);
  const float scale = std::ldexp(1.0f, std::clamp(oracle_ceil_log2(ratio), -127, 127));
  std::vector<float> y;
  for (float v : x) y.push_back(static_cast<float>(e4m3_value(oracle_e4m3(v / scale)) * scale));
  return y;
}

std::vector<float> oracle_fake_fp4_ue8m0(const std::vector<float>& x) {
  const float amax = std::max(oracle_abs_max(x), std::ldexp(6.0f, -126));
  const float scale = std::ldexp(1.0f, oracle_ceil_log2(amax / 6.0f));
  std::vector<float> y;
  for (float v : x) {
    const uint8_t c = oracle_e2m1(v / scale);
    y.push_back(static_cast<float>((c & 8 ? -1 : 1) * kE2m1Grid[c & 7] * scale));
  }
  return y;
}

std::vector<float> oracle_fake_fp4_e4m3(const std::vector<float>& x) {
  const float amax = std::max(oracle_abs_max(x), std::ldexp(6.0f, -9));
  const float scale = static_cast<float>(e4m3_value(oracle_e4m3(std::clamp(amax / 6.0f, 0x1p-9f, 448.0f))));
  std::vector<float> y;
  for (float v : x) {
    const uint8_t c = oracle_e2m1(v / scale);
    y.push_back(static_cast<float>((c & 8 ? -1 : 1) * kE2m1Grid[c & 7] * scale));
  }
  return y;
}

// Tiles whose magnitudes span from below the scale floors to large values.
std::vector<float> random_tile(std::mt19937_64& rng, int n) {
  std::uniform_int_distribution<int> center(-40, 40);
  const int c = center(rng);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = random_float(rng, c - 6, c + 2);
  if (rng() % 4 == 0) x[rng() % n] = 0.0f;
  return x;
}

// A tile whose scale is `scale`: one element is +-anchor * scale (the amax), the others are
// +-(midpoint of two neighbouring codes) * scale, so that x / scale lands exactly on rounding ties.
template <class Value>
std::vector<float> tie_tile(std::mt19937_64& rng, int n, float anchor, float scale, int max_code, Value value) {
  std::vector<float> x(static_cast<size_t>(n));
  x[0] = anchor * scale;
  for (int i = 1; i < n; ++i) {
    const int c = static_cast<int>(rng() % static_cast<uint64_t>(max_code));
    x[i] = static_cast<float>((value(c) + value(c + 1)) / 2) * scale;
  }
  for (auto& v : x)
    if (rng() & 1) v = -v;
  std::shuffle(x.begin(), x.end(), rng);
  return x;
}

float random_power_of_two(std::mt19937_64& rng) { return std::ldexp(1.0f, static_cast<int>(rng() % 60) - 30); }

void expect_bitwise_equal(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& x) {
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(to_bits(got[i]), to_bits(want[i])) << "element " << i << " of a tile, x = " << std::hexfloat << x[i]
                                                 << ", got " << got[i] << ", want " << want[i];
}

TEST(FakeQuant, ScaleBytesMatchOracle) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int i = 0; i < 100000; ++i) {
    // Random amaxes, and amaxes on and next to the power-of-two boundaries of each scale.
    float amax = std::fabs(random_float(rng, -40, 40));
    if (i % 4 == 1) amax = 448.0f * random_power_of_two(rng);
    if (i % 4 == 2) amax = 6.0f * random_power_of_two(rng);
    if (i % 8 == 3) amax = std::nextafter(amax, (rng() & 1) ? 0.0f : 1e30f);
    for (Fp8ScaleFloor floor : {Fp8ScaleFloor::amax, Fp8ScaleFloor::ratio}) {
      const float ratio = floor == Fp8ScaleFloor::amax ? std::max(amax, 1e-4f) / 448.0f : std::max(amax / 448.0f, 1e-4f);
      ASSERT_EQ(fp8_ue8m0_scale_byte(amax, floor), oracle_ceil_log2(ratio) + 127) << std::hexfloat << amax;
    }
    ASSERT_EQ(fp4_ue8m0_scale_byte(amax), oracle_ceil_log2(std::max(amax, 0x1.8p-124f) / 6.0f) + 127) << std::hexfloat << amax;
    ASSERT_EQ(fp4_e4m3_scale_code(amax), oracle_e4m3(std::clamp(amax / 6.0f, 0x1p-9f, 448.0f))) << std::hexfloat << amax;
  }
}

// vLLM multiplies amax by fl(1/448) (and fl(1/6)) where the reference divides; both must give the
// same power-of-two scale. Every mantissa of one binade covers all normal amaxes, since scaling by
// a power of two is exact there.
TEST(FakeQuant, ReciprocalMultiplicationGivesTheSameScaleExponent) {
  const float inverse_448 = 1.0f / 448.0f, inverse_6 = 1.0f / 6.0f;
  for (uint32_t mantissa = 0; mantissa < 0x800000u; ++mantissa) {
    const float amax = from_bits((127u << 23) | mantissa);
    ASSERT_EQ(ceil_log2_exponent(amax / 448.0f), ceil_log2_exponent(amax * inverse_448)) << std::hexfloat << amax;
    ASSERT_EQ(ceil_log2_exponent(amax / 6.0f), ceil_log2_exponent(amax * inverse_6)) << std::hexfloat << amax;
  }
}

TEST(FakeQuant, Fp8Ue8m0MatchesOracle) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int t = 0; t < 3000; ++t) {
    const std::vector<float> x = (t & 1) ? random_tile(rng, 32) : tie_tile(rng, 32, 448.0f, random_power_of_two(rng), 0x7d, e4m3_value);
    for (Fp8ScaleFloor floor : {Fp8ScaleFloor::amax, Fp8ScaleFloor::ratio}) {
      std::vector<float> y(x.size());
      fake_quant_fp8_ue8m0(x.data(), y.data(), 32, floor);
      expect_bitwise_equal(y, oracle_fake_fp8(x, floor), x);
    }
  }
}

TEST(FakeQuant, Fp4Ue8m0MatchesOracle) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int t = 0; t < 3000; ++t) {
    const std::vector<float> x = (t & 1) ? random_tile(rng, 32) : tie_tile(rng, 32, 6.0f, random_power_of_two(rng), 6, e2m1_value);
    std::vector<float> y(x.size());
    fake_quant_fp4_ue8m0(x.data(), y.data(), 32);
    expect_bitwise_equal(y, oracle_fake_fp4_ue8m0(x), x);
  }
}

TEST(FakeQuant, Fp4E4m3MatchesOracle) {
  SEED_TRACE();
  std::mt19937_64 rng(test_seed());
  for (int t = 0; t < 3000; ++t) {
    const float scale = static_cast<float>(e4m3_value(1 + static_cast<int>(rng() % 0x7e)));
    const std::vector<float> x = (t & 1) ? random_tile(rng, 16) : tie_tile(rng, 16, 6.0f, scale, 6, e2m1_value);
    std::vector<float> y(x.size());
    fake_quant_fp4_e4m3(x.data(), y.data(), 16);
    expect_bitwise_equal(y, oracle_fake_fp4_e4m3(x), x);
  }
}

TEST(FakeQuant, FloorsAndHandComputedTiles) {
  // amax 0.01: amax floor -> ratio 0.01/448, scale 2^-15; ratio floor -> scale 2^-13.
  // 0.01 / 2^-15 = 327.68 -> e4m3 320 (grid step 32 in [256, 448)), 0.01 / 2^-13 = 81.92 -> 80.
  float x[2] = {0.01f, -0.0f}, y[2];
  fake_quant_fp8_ue8m0(x, y, 2, Fp8ScaleFloor::amax);
  EXPECT_EQ(y[0], 320.0f * 0x1p-15f);
  EXPECT_EQ(to_bits(y[1]), 0x80000000u);  // -0 stays -0
  fake_quant_fp8_ue8m0(x, y, 2, Fp8ScaleFloor::ratio);
  EXPECT_EQ(y[0], 80.0f * 0x1p-13f);
  EXPECT_EQ(fp8_ue8m0_scale_byte(0.0f, Fp8ScaleFloor::amax), 105);   // 2^-22
  EXPECT_EQ(fp8_ue8m0_scale_byte(0.0f, Fp8ScaleFloor::ratio), 114);  // 2^-13
  EXPECT_EQ(fp8_ue8m0_scale_byte(448.0f), 127);                      // exact power: scale 1
  EXPECT_EQ(fp8_ue8m0_scale_byte(450.0f), 128);
  EXPECT_EQ(fp4_ue8m0_scale_byte(0.0f), 1);                          // 6 * 2^-126 / 6 = 2^-126
  EXPECT_EQ(fp4_ue8m0_scale_byte(6.0f), 127);
  EXPECT_EQ(fp4_e4m3_scale_code(0.0f), 0x01);                        // 2^-9
  EXPECT_EQ(fp4_e4m3_scale_code(1e9f), 0x7e);                        // clamps to 448
  EXPECT_EQ(fp4_e4m3_scale_code(6.0f * 1.0625f), 0x38);              // scale tie 1.0625 -> 1.0
  // fp4 e4m3: amax 3 -> scale e4m3(0.5) = 0.5; 0.375 / 0.5 = 0.75 ties up to 1 -> 0.5.
  float z[3] = {3.0f, 0.375f, -0.1f}, w[3];
  fake_quant_fp4_e4m3(z, w, 3);
  EXPECT_EQ(w[0], 3.0f);
  EXPECT_EQ(w[1], 0.5f);
  EXPECT_EQ(to_bits(w[2]), 0x80000000u);
  // In place (y == x) gives the same result.
  fake_quant_fp4_e4m3(z, z, 3);
  EXPECT_EQ(z[1], 0.5f);
}

TEST(FakeQuant, NaNElementsDoNotChangeTheScale) {
  float x[3] = {std::numeric_limits<float>::quiet_NaN(), 1.0f, -2.0f}, y[3];
  EXPECT_EQ(abs_max(x, 3), 2.0f);
  fake_quant_fp8_ue8m0(x, y, 3);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[2], -2.0f);
}

// ---- CUDA's host conversions -------------------------------------------------------------------------

// Inputs: every bf16 pattern with several low halves (ties included), plus uniform random bits.
std::vector<float> cross_check_inputs() {
  std::mt19937_64 rng(test_seed());
  std::vector<float> xs;
  for (uint32_t high = 0; high <= 0xffff; ++high)
    for (uint32_t low : {0u, 0x8000u, 0x7fffu, static_cast<uint32_t>(rng() & 0xffffu)}) xs.push_back(from_bits(high << 16 | low));
  for (int i = 0; i < 200000; ++i) xs.push_back(from_bits(static_cast<uint32_t>(rng())));
  return xs;
}

TEST(CudaHeaders, E4m3AndBf16AgreeWithCuda) {
#if defined(DSV4_HAVE_CUDA_FP_HEADERS)
  SEED_TRACE();
  for (float x : cross_check_inputs()) {
    ASSERT_EQ(float_to_e4m3(x), __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)) << std::hexfloat << x;
    const __nv_bfloat16 cuda_bf16 = __float2bfloat16_rn(x);
    uint16_t cuda_bits;
    std::memcpy(&cuda_bits, &cuda_bf16, sizeof cuda_bits);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(x))));
    } else {
      ASSERT_EQ(float_to_bf16_bits(x), cuda_bits) << std::hexfloat << x;
    }
  }
  for (int code = 0; code < 256; ++code) {
    __nv_fp8_e4m3 cuda_code;
    cuda_code.__x = static_cast<__nv_fp8_storage_t>(code);
    const float cuda_value = static_cast<float>(cuda_code), ours = e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(ours)) EXPECT_TRUE(std::isnan(cuda_value)) << code;
    else EXPECT_EQ(to_bits(ours), to_bits(cuda_value)) << code;
  }
#else
  GTEST_SKIP() << "built without /usr/local/cuda/include/cuda_fp8.h";
#endif
}

TEST(CudaHeaders, E2m1AgreesWithCuda) {
#if defined(DSV4_HAVE_CUDA_FP4_HEADER)
  SEED_TRACE();
  for (float x : cross_check_inputs())
    ASSERT_EQ(float_to_e2m1(x), __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)) << std::hexfloat << x;
  for (int code = 0; code < 16; ++code) {
    __nv_fp4_e2m1 cuda_code;
    cuda_code.__x = static_cast<__nv_fp4_storage_t>(code);
    EXPECT_EQ(to_bits(e2m1_to_float(static_cast<uint8_t>(code))), to_bits(static_cast<float>(cuda_code))) << code;
  }
#else
  GTEST_SKIP() << "built without /usr/local/cuda/include/cuda_fp4.h";
#endif
}

}  // namespace
}  // namespace dsv4

// Number formats of DeepSeek V4 / V4.1 activations and KV caches (SPEC §7, §8.2): bf16, fp8 e4m3fn,
// ue8m0 power-of-two scales, fp4 e2m1, and the reference fake quantizers built from them.
//
// Header-only; every function works in host C++ and in CUDA device code. The conversions are
// integer arithmetic on the fp32 bit pattern, so they do not depend on library log2/exp2 or on the
// compiler's floating-point flags. The few float operations (the x / scale divisions) are IEEE
// round-to-nearest on both sides; device code must not be built with -ftz for results whose fp32
// value is subnormal (the project's flags do not use it).
#pragma once

#include <cstdint>

#ifndef DSV4_HD
#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__
#else
#define DSV4_HD
#endif
#endif

namespace dsv4 {

// The fake quantizers of finished rows (QAT, SPEC §8.2): which one a row kind uses is decided by
// the layer recipe (src/model/layer_recipe.h); every result is exact in bf16.
enum class RowQuantizer : uint8_t {
  none,
  fp8_e4m3_32,       // V4.1 window rows: e4m3 + ue8m0 scale per 32 channels, every channel
  fp8_e4m3_nope_64,  // V4.0 rows: e4m3 + ue8m0 per 64 channels on the channels before the RoPE tail
  fp4_ue8m0_32,      // V4.1 indexer queries and keys: e2m1 + ue8m0 per 32 channels (MXFP4)
  fp4_e4m3_16,       // V4.1 compressed rows: e2m1 + e4m3 scale per 16 channels
};

// ------------------------------------------------------------------------------------------------
// Bit patterns.

DSV4_HD constexpr uint32_t float_bits(float x) { return __builtin_bit_cast(uint32_t, x); }
DSV4_HD constexpr float float_from_bits(uint32_t bits) { return __builtin_bit_cast(float, bits); }

// v >> shift rounded to nearest, ties to even; shift in [1, 31].
DSV4_HD constexpr uint32_t shift_right_round_even(uint32_t v, int shift) {
  const uint32_t kept = v >> shift;
  const uint32_t rest = v & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// IEEE round-to-nearest division, also when device code is built with approximate division.
DSV4_HD inline float divide_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ------------------------------------------------------------------------------------------------
// bf16: the upper half of an fp32.

// Round to nearest even; overflow goes to ±inf; a NaN stays a NaN (sign kept, quiet bit set).
DSV4_HD constexpr uint16_t float_to_bf16_bits(float x) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Rounding the sign-magnitude pattern as an integer carries correctly into the exponent.
  return static_cast<uint16_t>(shift_right_round_even(bits, 16));
}
DSV4_HD constexpr float bf16_bits_to_float(uint16_t bits) { return float_from_bits(uint32_t{bits} << 16); }
DSV4_HD constexpr float round_to_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// ------------------------------------------------------------------------------------------------
// fp8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f / 0xff are NaN,
// largest finite 448, smallest subnormal 2^-9.

inline constexpr float kE4m3Max = 448.0f;

// Round to nearest even. Finite values beyond ±448 and ±inf saturate to ±448 (CUDA's
// __NV_SATFINITE); NaN gives 0x7f. The sign of zero is kept, also for values that round to zero.
DSV4_HD constexpr uint8_t float_to_e4m3(float x) {
  const uint32_t bits = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7f;
  if (magnitude >= 0x43e00000u) return sign | 0x7e;  // >= 448
  const int exponent_field = static_cast<int>(magnitude >> 23);
  if (exponent_field >= 127 - 6) {
    // Normal in e4m3 (|x| >= 2^-6): rebias the exponent from 127 to 7 and keep 3 mantissa bits;
    // a mantissa carry correctly bumps the exponent.
    return sign | static_cast<uint8_t>(shift_right_round_even(magnitude - (120u << 23), 20));
  }
  // |x| < 2^-6: the code is round(|x| / 2^-9) on the subnormal grid (8 becomes the smallest
  // normal, 0x08). |x| = significand * 2^(field - 150), so the code is significand >> (141 - field).
  const uint32_t significand = exponent_field ? ((magnitude & 0x7fffffu) | 0x800000u) : magnitude;
  const int shift = 141 - (exponent_field ? exponent_field : 1);
  if (shift > 25) return sign;  // below 2^-11: rounds to zero
  return sign | static_cast<uint8_t>(shift_right_round_even(significand, shift));
}

DSV4_HD constexpr float e4m3_to_float(uint8_t code) {
  const uint32_t sign = uint32_t{code & 0x80u} << 24;
  const uint32_t exponent_field = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent_field == 0xf && mantissa == 0x7) return float_from_bits(sign | 0x7fc00000u);
  if (exponent_field == 0) {
    // Subnormal: mantissa * 2^-9, a normal fp32 (or zero).
    const float magnitude = static_cast<float>(mantissa) * 0x1p-9f;
    return float_from_bits(sign | float_bits(magnitude));
  }
  return float_from_bits(sign | ((exponent_field + 120u) << 23) | (mantissa << 20));
}

// ------------------------------------------------------------------------------------------------
// ue8m0: an unsigned power-of-two scale byte b meaning 2^(b - 127); 255 is NaN.

// ceil(log2(x)) for x > 0, exact: the fp32 exponent plus one when any mantissa bit is set
// (subnormals included). Returns -150 for ±0, 128 for inf and 129 for NaN (the sign is ignored).
DSV4_HD constexpr int ceil_log2_exponent(float positive) {
  const uint32_t magnitude = float_bits(positive) & 0x7fffffffu;
  const int exponent_field = static_cast<int>(magnitude >> 23);
  const uint32_t mantissa = magnitude & 0x7fffffu;
  if (exponent_field != 0) return exponent_field - 127 + (mantissa != 0 ? 1 : 0);
  if (mantissa == 0) return -150;
  int k = 0;  // subnormal: mantissa * 2^-149, ceil(log2(mantissa)) = k
  while ((1u << k) < mantissa) ++k;
  return -149 + k;
}

// The byte of the scale 2^exponent, clamped to the finite range [2^-127, 2^127].
DSV4_HD constexpr uint8_t ue8m0_from_exponent(int exponent) {
  const int biased = exponent + 127;
  return static_cast<uint8_t>(biased < 0 ? 0 : (biased > 254 ? 254 : biased));
}

DSV4_HD constexpr float ue8m0_to_float(uint8_t byte) {
  // 2^-127 is an fp32 subnormal; one expression, so that kernels select instead of branching.
  return float_from_bits(byte == 0xff ? 0x7fc00000u : byte == 0 ? 0x00400000u : uint32_t{byte} << 23);
}

// ------------------------------------------------------------------------------------------------
// fp4 e2m1: sign (bit 3), 2 exponent bits, 1 mantissa bit; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 for
// codes 0..7. Two codes share a byte, the even element in the low nibble.

inline constexpr float kE2m1Max = 6.0f;

// Round to nearest, ties to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
// 3.5 -> 4, 5 -> 4. Beyond ±6 (and ±inf) saturates to ±6; NaN gives +6 (code 7), as CUDA's
// satfinite conversion does. Negative values that round to zero keep the sign (code 8).
DSV4_HD constexpr uint8_t float_to_e2m1(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  if (magnitude_bits > 0x7f800000u) return 0x7;
  const uint8_t sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  const float a = float_from_bits(magnitude_bits);
  // Each bound is the midpoint between neighbouring codes; `<=` sends the tie down (to an even
  // code), `<` sends it up.
  const uint8_t code = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3
                     : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.0f ? 6 : 7;
  return sign | code;
}

// Only the low 4 bits of `code` are read.
DSV4_HD constexpr float e2m1_to_float(uint8_t code) {
  const uint32_t magnitude = code & 0x7u;
  // Codes 2..7 are (1 + m/2) * 2^(e-1): exponent field e = code >> 1, mantissa bit m = code & 1.
  const float value = magnitude < 2 ? 0.5f * static_cast<float>(magnitude)
                                    : float_from_bits((((magnitude >> 1) + 126u) << 23) | ((magnitude & 1u) << 22));
  return (code & 0x8u) ? -value : value;
}

DSV4_HD constexpr uint8_t pack_e2m1x2(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xfu) | ((odd & 0xfu) << 4));
}
// The code of element `index` of a packed array (byte index / 2, low nibble for even index).
DSV4_HD constexpr uint8_t unpack_e2m1(const uint8_t* packed, int64_t index) {
  return static_cast<uint8_t>((packed[index >> 1] >> ((index & 1) * 4)) & 0xfu);
}

// ------------------------------------------------------------------------------------------------
// Per-tile scales. A tile is a run of consecutive channels sharing one scale.

// Where the 1e-4 floor of an FP8 power-of-two scale applies. The upstreams differ (kvfmt README):
enum class Fp8ScaleFloor : uint8_t {
  // s = 2^ceil(log2(max(amax, 1e-4) / 448)): DeepSeek's V4.1 reference act_quant, and vLLM's
  // fp8_ds_mla and FP8 indexer-key inserts. An all-zero tile gets 2^-22 (byte 105).
  amax,
  // s = 2^ceil(log2(max(amax / 448, 1e-4))): vLLM's V4.1 FP8 window insert and FlashMLA's test
  // quantizers. An all-zero tile gets 2^-13 (byte 114).
  ratio,
};

inline constexpr float kFp8AmaxFloor = 1e-4f;
inline constexpr float kFp4Ue8m0AmaxFloor = 0x1.8p-124f;  // 6 * 2^-126
inline constexpr float kFp4E4m3AmaxFloor = 0x1.8p-7f;     // 6 * 2^-9

// max |x_i|; NaN elements are ignored.
DSV4_HD constexpr float abs_max(const float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = float_from_bits(float_bits(x[i]) & 0x7fffffffu);
    if (a > amax) amax = a;
  }
  return amax;
}

// ue8m0 byte of an FP8 (e4m3) tile's scale. The ratio is the fp32 quotient amax / 448 (vLLM's
// multiplication by fl(1/448) gives the same power of two for every normal fp32 amax).
DSV4_HD inline uint8_t fp8_ue8m0_scale_byte(float amax, Fp8ScaleFloor floor = Fp8ScaleFloor::amax) {
  float ratio = 0.0f;
  if (floor == Fp8ScaleFloor::amax) {
    ratio = divide_rn(amax > kFp8AmaxFloor ? amax : kFp8AmaxFloor, kE4m3Max);
  } else {
    ratio = divide_rn(amax, kE4m3Max);
    if (!(ratio > kFp8AmaxFloor)) ratio = kFp8AmaxFloor;
  }
  return ue8m0_from_exponent(ceil_log2_exponent(ratio));
}

// ue8m0 byte of an FP4 (e2m1) tile's scale: 2^ceil(log2(max(amax, 6*2^-126) / 6)).
DSV4_HD inline uint8_t fp4_ue8m0_scale_byte(float amax) {
  return ue8m0_from_exponent(ceil_log2_exponent(divide_rn(amax > kFp4Ue8m0AmaxFloor ? amax : kFp4Ue8m0AmaxFloor, kE2m1Max)));
}

// e4m3 code of an FP4 (e2m1) tile's scale: e4m3_rne(max(amax, 6*2^-9) / 6), which lies in
// [2^-9, 448] (the floor gives the lower bound, saturation the upper one).
DSV4_HD inline uint8_t fp4_e4m3_scale_code(float amax) {
  return float_to_e4m3(divide_rn(amax > kFp4E4m3AmaxFloor ? amax : kFp4E4m3AmaxFloor, kE2m1Max));
}

// ------------------------------------------------------------------------------------------------
// The reference fake quantizers (SPEC §8.2) on one tile of n values: y = dequantize(quantize(x)).
// The caller splits a row into tiles (32 channels for FP8 act_quant and MXFP4, 16 for the FP4
// compressed rows). y may be x. The results are exact in bf16.

// act_quant: e4m3 values with a ue8m0 scale.
DSV4_HD inline void fake_quant_fp8_ue8m0(const float* x, float* y, int n, Fp8ScaleFloor floor = Fp8ScaleFloor::amax) {
  const float scale = ue8m0_to_float(fp8_ue8m0_scale_byte(abs_max(x, n), floor));
  for (int i = 0; i < n; ++i) y[i] = e4m3_to_float(float_to_e4m3(divide_rn(x[i], scale))) * scale;
}

// fp4_act_quant with ue8m0 scales (indexer q/k, block 32).
DSV4_HD inline void fake_quant_fp4_ue8m0(const float* x, float* y, int n) {
  const float scale = ue8m0_to_float(fp4_ue8m0_scale_byte(abs_max(x, n)));
  for (int i = 0; i < n; ++i) y[i] = e2m1_to_float(float_to_e2m1(divide_rn(x[i], scale))) * scale;
}

// fp4_act_quant with e4m3 scales (compressed KV rows, block 16).
DSV4_HD inline void fake_quant_fp4_e4m3(const float* x, float* y, int n) {
  const float scale = e4m3_to_float(fp4_e4m3_scale_code(abs_max(x, n)));
  for (int i = 0; i < n; ++i) y[i] = e2m1_to_float(float_to_e2m1(divide_rn(x[i], scale))) * scale;
}

}  // namespace dsv4

// CUDA projections (run_linear, run_dequantize_weight) against the CPU reference linear /
// grouped_linear on random inputs, and run_linear's implementations (fp8_decode, cublaslt) on
// their own against a plain CPU product.
//
// Tolerances: f32 outputs differ from the reference only by the fp32 summation order:
// |Δ| <= 2e-6 + 1e-5·|y| for sums of <= 256 products of magnitude <= 1 (measured on an H200:
// |Δ| <= 4.8e-7, at most 0.2 of the bound). bf16 outputs may in addition round to the
// neighbouring bf16 value: rtol 2^-7 (one bf16 ulp; measured: equal).
// The implementation tests state a rigorous bound of an fp32 sum of K products in any order
// against the exact sum: each product is exact (bf16 x bf16 into fp32) and each of the K additions
// errs by at most 2^-23 of the running magnitude when rounded toward zero, as tensor cores may
// round: K·2^-23·Σ|x||w|, doubled to spare, K·2^-22·Σ|x||w|; plus one bf16 ulp of |y| for bf16
// outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

#include "cuda/cuda_test_util.h"
#include "cuda/ops/projection/linear_implementations.h"
#include "dsv4/cuda/projection.h"
#include "reference/ops.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;
using testing::DeviceTensor;

constexpr float kF32Atol = 2e-6f, kF32Rtol = 1e-5f;
constexpr float kBf16Rtol = 0x1p-7f;

// Random e4m3 codes (no NaN code) and the weight they stand for with the given block scales.
struct Fp8Weight {
  HostTensor codes;          // [groups?, out, in] e4m3
  HostTensor scales;         // ue8m0 or f32
  std::vector<float> value;  // dequantized
};

Fp8Weight random_fp8_weight(std::vector<int64_t> shape, int block_out, int block_in, DType scale_dtype, uint32_t seed) {
  const int r = static_cast<int>(shape.size());
  const int64_t out = shape[r - 2], in = shape[r - 1], groups = r == 3 ? shape[0] : 1;
  const int64_t srows = (out + block_out - 1) / block_out, scols = (in + block_in - 1) / block_in;
  std::vector<int64_t> scale_shape = {srows, scols};
  if (r == 3) scale_shape.insert(scale_shape.begin(), groups);
  Fp8Weight w{HostTensor(DType::e4m3, shape), HostTensor(scale_dtype, scale_shape), {}};
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < w.codes.numel(); ++i) {
    uint8_t code = static_cast<uint8_t>(rng() & 0xff);
    if ((code & 0x7f) == 0x7f) code ^= 0x01;  // NaN -> 448
    w.codes.as<uint8_t>()[i] = code;
  }
  std::vector<float> scale(static_cast<size_t>(w.scales.numel()));
  for (int64_t i = 0; i < w.scales.numel(); ++i) {
    const uint8_t byte = static_cast<uint8_t>(114 + rng() % 4);  // 2^-13 ... 2^-10
    scale[i] = ue8m0_to_float(byte);
    if (scale_dtype == DType::ue8m0) w.scales.as<uint8_t>()[i] = byte;
    else w.scales.as<float>()[i] = scale[i];
  }
  w.value.resize(static_cast<size_t>(w.codes.numel()));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t c = 0; c < in; ++c) {
        const int64_t i = (g * out + o) * in + c;
        w.value[i] = e4m3_to_float(w.codes.as<uint8_t>()[i]) * scale[(g * srows + o / block_out) * scols + c / block_in];
      }
  return w;
}

class LinearCudaTest : public testing::BlasCudaTest {
 protected:
  // Runs p on a fresh stream with a fresh workspace and returns y as floats.
  std::vector<float> run(LinearParams p) {
    p.blas = &*blas_;
    DeviceBuffer workspace(linear_workspace_bytes(p));
    Stream stream;
    run_linear(p, workspace.data(), stream.get());
    stream.synchronize("linear test");
    return testing::download_floats(p.y);
  }
};

TEST_F(LinearCudaTest, Bf16WeightWithF32AndBf16Outputs) {
  const int64_t rows = 37, in = 160, out = 72;
  const auto x = testing::rounded_to_bf16(testing::random_floats(rows * in, 1));
  const auto w = testing::rounded_to_bf16(testing::random_floats(out * in, 2, -0.1f, 0.1f));
  DeviceTensor dx = testing::device_tensor(x, DType::f32, {rows, in});
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {out, in});
  for (DType out_dtype : {DType::f32, DType::bf16}) {
    const bool bf16 = out_dtype == DType::bf16;
    DeviceTensor dy = testing::poisoned_tensor(out_dtype, {rows, out});
    const auto got = run({.x = dx.view, .weight = dw.view, .y = dy.view});
    std::vector<float> expected(static_cast<size_t>(rows * out));
    reference::linear(x.data(), rows, in, w.data(), out, expected.data(), {.bf16_output = bf16});
    testing::expect_close(got, expected, kF32Atol, bf16 ? kBf16Rtol : kF32Rtol, bf16 ? "bf16 y" : "f32 y");
  }
}

TEST_F(LinearCudaTest, Fp8WeightUe8m0Blocks32WithActivationQuant) {
  // V4.1: 32x32 weight blocks, the last block row and column partial; act_quant in 32-tiles.
  const int64_t rows = 19, in = 160, out = 72;
  const auto x = testing::rounded_to_bf16(testing::random_floats(rows * in, 3, -3.0f, 3.0f));
  const Fp8Weight w = random_fp8_weight({out, in}, 32, 32, DType::ue8m0, 4);
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {rows, in});
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  DeviceTensor dy = testing::poisoned_tensor(DType::bf16, {rows, out});
  const auto got = run({.x = dx.view, .weight = dw.view, .weight_scale = ds.view, .block_out = 32, .block_in = 32,
                        .activation_block = 32, .y = dy.view});
  std::vector<float> expected(static_cast<size_t>(rows * out));
  reference::linear(x.data(), rows, in, w.value.data(), out, expected.data(),
                    {.fp8_activation_block = 32, .bf16_output = true});
  testing::expect_close(got, expected, kF32Atol, kBf16Rtol, "fp8 32x32 y");
}

TEST_F(LinearCudaTest, Fp8WeightF32Blocks128SingleRowAndNoRows) {
  // V4.0: 128x128 blocks with f32 (power-of-two) scales; a decode step of one row, then none.
  const int64_t in = 256, out = 200;
  const Fp8Weight w = random_fp8_weight({out, in}, 128, 128, DType::f32, 5);
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  const auto x = testing::rounded_to_bf16(testing::random_floats(in, 6));
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {1, in});
  DeviceTensor dy = testing::poisoned_tensor(DType::f32, {1, out});
  const auto got = run({.x = dx.view, .weight = dw.view, .weight_scale = ds.view, .activation_block = 128, .y = dy.view});
  std::vector<float> expected(static_cast<size_t>(out));
  reference::linear(x.data(), 1, in, w.value.data(), out, expected.data(), {.fp8_activation_block = 128});
  testing::expect_close(got, expected, kF32Atol, kF32Rtol, "fp8 128x128 y");

  DeviceTensor empty_x = testing::device_tensor(std::vector<float>{}, DType::bf16, {0, in});
  DeviceTensor empty_y = testing::poisoned_tensor(DType::f32, {0, out});
  EXPECT_TRUE(run({.x = empty_x.view, .weight = dw.view, .weight_scale = ds.view, .y = empty_y.view}).empty());
}

TEST_F(LinearCudaTest, F32WeightOddSizes) {
  const int64_t rows = 9, in = 33, out = 17;
  const auto x = testing::random_floats(rows * in, 7);
  const auto w = testing::random_floats(out * in, 8);
  DeviceTensor dx = testing::device_tensor(x, DType::f32, {rows, in});
  DeviceTensor dw = testing::device_tensor(w, DType::f32, {out, in});
  DeviceTensor dy = testing::poisoned_tensor(DType::f32, {rows, out});
  const auto got = run({.x = dx.view, .weight = dw.view, .y = dy.view});
  std::vector<float> expected(static_cast<size_t>(rows * out));
  reference::linear(x.data(), rows, in, w.data(), out, expected.data(), {});
  testing::expect_close(got, expected, kF32Atol, kF32Rtol, "f32 GEMM y");
  // A bf16 y of an f32 product (Precision::fp32's q projections): the f32 result, rounded once
  // (cuBLASLt has no f32 -> bf16 product; the rounding may differ by one bf16 step at a tie).
  DeviceTensor dy16 = testing::poisoned_tensor(DType::bf16, {rows, out});
  const auto got16 = run({.x = dx.view, .weight = dw.view, .y = dy16.view});
  testing::expect_close(got16, testing::rounded_to_bf16(expected), kF32Atol, 1.0f / 128, "f32 GEMM bf16 y");
}

TEST_F(LinearCudaTest, GroupedOutputProjection) {
  // wo_a: x [rows, groups, in] · w[g]ᵀ per group, bf16 and fp8 weights.
  const int64_t rows = 5, groups = 3, in = 96, rank = 40;
  const auto x = testing::rounded_to_bf16(testing::random_floats(rows * groups * in, 9));
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {rows, groups, in});
  const auto w = testing::rounded_to_bf16(testing::random_floats(groups * rank * in, 10, -0.2f, 0.2f));
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {groups, rank, in});
  DeviceTensor dy = testing::poisoned_tensor(DType::f32, {rows, groups, rank});
  std::vector<float> expected(static_cast<size_t>(rows * groups * rank));
  reference::grouped_linear(x.data(), rows, groups, in, w.data(), rank, expected.data(), false);
  testing::expect_close(run({.x = dx.view, .weight = dw.view, .y = dy.view}), expected, kF32Atol, kF32Rtol,
                        "grouped bf16 y");

  const Fp8Weight w8 = random_fp8_weight({groups, rank, in}, 32, 32, DType::ue8m0, 11);
  DeviceTensor dw8 = testing::device_tensor(w8.codes), ds8 = testing::device_tensor(w8.scales);
  DeviceTensor dy8 = testing::poisoned_tensor(DType::bf16, {rows, groups, rank});
  reference::grouped_linear(x.data(), rows, groups, in, w8.value.data(), rank, expected.data(), true);
  testing::expect_close(run({.x = dx.view, .weight = dw8.view, .weight_scale = ds8.view, .block_out = 32,
                             .block_in = 32, .y = dy8.view}),
                        expected, kF32Atol, kBf16Rtol, "grouped fp8 y");
}

TEST_F(LinearCudaTest, CapturedInACudaGraph) {
  const int64_t rows = 4, in = 64, out = 48;
  const auto x = testing::rounded_to_bf16(testing::random_floats(rows * in, 12));
  const Fp8Weight w = random_fp8_weight({out, in}, 32, 32, DType::ue8m0, 13);
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {rows, in});
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  DeviceTensor dy = testing::poisoned_tensor(DType::f32, {rows, out});
  const LinearParams p{.x = dx.view, .weight = dw.view, .weight_scale = ds.view, .block_out = 32, .block_in = 32,
                       .activation_block = 32, .y = dy.view, .blas = &*blas_};
  DeviceBuffer workspace(linear_workspace_bytes(p));
  Stream stream;
  testing::run_as_graph(stream, [&](cudaStream_t s) { run_linear(p, workspace.data(), s); });
  std::vector<float> expected(static_cast<size_t>(rows * out));
  reference::linear(x.data(), rows, in, w.value.data(), out, expected.data(), {.fp8_activation_block = 32});
  testing::expect_close(testing::download_floats(dy.view), expected, kF32Atol, kF32Rtol, "graph-launched y");
}

TEST_F(LinearCudaTest, DecodeShapedGemmsRepeatBitForBit) {
  // The V4.1-Flash projections at 16 rows (a batch-16 decode step): few rows and a large K are
  // where a GEMM library splits K, and a split reduced in arbitrary order gives other bits from
  // run to run. Each projection runs 8 times; every run must give the first run's bits.
  struct Shape {
    const char* name;
    std::vector<int64_t> x, w, y;
  };
  const int64_t rows = 16;
  const Shape shapes[] = {{"wq_a", {rows, 5120}, {1280, 5120}, {rows, 1280}},
                          {"wq_b", {rows, 1280}, {32768, 1280}, {rows, 32768}},
                          {"wkv", {rows, 5120}, {512, 5120}, {rows, 512}},
                          {"wo_a", {rows, 8, 4096}, {8, 1024, 4096}, {rows, 8, 1024}},
                          {"wo_b", {rows, 8192}, {5120, 8192}, {rows, 5120}}};
  uint32_t seed = 20;
  for (const Shape& s : shapes) {
    const auto numel = [](const std::vector<int64_t>& shape) {
      return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
    };
    DeviceTensor dx = testing::device_tensor(testing::random_floats(numel(s.x), seed++, -2.0f, 2.0f), DType::bf16, s.x);
    DeviceTensor dw = testing::device_tensor(testing::random_floats(numel(s.w), seed++, -0.05f, 0.05f), DType::bf16, s.w);
    for (DType out_dtype : {DType::bf16, DType::f32}) {
      DeviceTensor dy = testing::poisoned_tensor(out_dtype, s.y);
      run({.x = dx.view, .weight = dw.view, .y = dy.view});
      const HostTensor first = to_host(dy.view);
      for (int repeat = 1; repeat < 8; ++repeat) {
        dy.buffer.fill_bytes(0xff);
        run({.x = dx.view, .weight = dw.view, .y = dy.view});
        const HostTensor again = to_host(dy.view);
        ASSERT_EQ(std::memcmp(first.data(), again.data(), first.nbytes()), 0)
            << s.name << " (" << dtype_name(out_dtype) << " y): run " << repeat << " differs from run 0";
      }
    }
  }
}

TEST_F(CudaTest, DequantizeWeightIsExact) {
  const Fp8Weight w = random_fp8_weight({70, 45}, 32, 32, DType::ue8m0, 14);
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  DeviceTensor out = testing::poisoned_tensor(DType::bf16, {70, 45});
  Stream stream;
  run_dequantize_weight({.weight = dw.view, .weight_scale = ds.view, .block_out = 32, .block_in = 32, .out = out.view},
                        stream.get());
  stream.synchronize("dequantize test");
  testing::expect_close(testing::download_floats(out.view), w.value, 0.0f, 0.0f, "dequantized weight");
}

// ---------------------------------------------------------------------------------------------
// run_linear's implementations against a plain CPU product

// y[r, g, o] = Σ_k xq[r, g, k] · w[g, o, k] in double (xq: x fake-quantized in activation_block
// tiles when > 0), and the tolerance of each element: K·2^-22·Σ|xq||w| (+ one bf16 ulp for bf16 y).
struct PlainProduct {
  std::vector<float> y, bound;
};

PlainProduct plain_product(std::vector<float> x, int64_t rows, int64_t groups, int64_t in, const std::vector<float>& w,
                           int64_t out, int activation_block, bool bf16_output) {
  if (activation_block > 0) reference::fake_quant_fp8_rows(x.data(), rows * groups, in, in, activation_block);
  PlainProduct p{std::vector<float>(static_cast<size_t>(rows * groups * out)),
                 std::vector<float>(static_cast<size_t>(rows * groups * out))};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t o = 0; o < out; ++o) {
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double product = static_cast<double>(x[(r * groups + g) * in + k]) * w[(g * out + o) * in + k];
          sum += product;
          magnitude += std::fabs(product);
        }
        const size_t i = static_cast<size_t>((r * groups + g) * out + o);
        p.y[i] = bf16_output ? round_to_bf16(static_cast<float>(sum)) : static_cast<float>(sum);
        p.bound[i] = static_cast<float>(static_cast<double>(in) * 0x1p-22 * magnitude +
                                        (bf16_output ? 0x1p-7 * std::fabs(sum) : 0.0));
      }
  return p;
}

struct ImplementationCase {
  const char* name;
  int block;               // block_out = block_in
  DType scale_dtype;
  int64_t rows, groups, out, in;
  int activation_block;    // 0: off, else the block
  DType y_dtype;
  const char* implementation;  // what run_linear must pick
  bool flat_scales = false;    // grouped weights: the checkpoint's scale layout over all groups' rows
};

class LinearImplementationCudaTest : public testing::BlasCudaTest,
                                     public ::testing::WithParamInterface<ImplementationCase> {};

TEST_P(LinearImplementationCudaTest, MatchesThePlainProductAndWritesEveryElement) {
  const ImplementationCase& c = GetParam();
  const bool grouped = c.groups > 1;
  const std::vector<int64_t> x_shape = grouped ? std::vector<int64_t>{c.rows, c.groups, c.in}
                                               : std::vector<int64_t>{c.rows, c.in};
  const std::vector<int64_t> w_shape = grouped ? std::vector<int64_t>{c.groups, c.out, c.in}
                                               : std::vector<int64_t>{c.out, c.in};
  const std::vector<int64_t> y_shape = grouped ? std::vector<int64_t>{c.rows, c.groups, c.out}
                                               : std::vector<int64_t>{c.rows, c.out};
  // Fresh non-zero inputs: x in ±[0.05, 3] with random signs, codes avoid zero and NaN.
  std::vector<float> x = testing::random_floats(c.rows * c.groups * c.in, 100 + static_cast<uint32_t>(c.rows), 0.05f, 3.0f);
  std::mt19937 signs(7);
  for (float& v : x) v = (signs() & 1) ? -v : v;
  x = testing::rounded_to_bf16(x);
  // The flat layout is a [groups·out, in] weight's scales, the grouped one per group.
  Fp8Weight w = c.flat_scales ? random_fp8_weight({c.groups * c.out, c.in}, c.block, c.block, c.scale_dtype, 31)
                              : random_fp8_weight(w_shape, c.block, c.block, c.scale_dtype, 31);
  // No zero weights either (a zero code becomes 2^-6), then the values again.
  const int64_t w_rows = c.flat_scales ? c.groups * c.out : c.out, w_groups = c.flat_scales ? 1 : c.groups;
  const int64_t srows = (w_rows + c.block - 1) / c.block, scols = (c.in + c.block - 1) / c.block;
  for (int64_t g = 0; g < w_groups; ++g)
    for (int64_t o = 0; o < w_rows; ++o)
      for (int64_t k = 0; k < c.in; ++k) {
        const int64_t i = (g * w_rows + o) * c.in + k, s = (g * srows + o / c.block) * scols + k / c.block;
        uint8_t& code = w.codes.as<uint8_t>()[i];
        if ((code & 0x7f) == 0) code |= 0x08;
        const float scale = c.scale_dtype == DType::ue8m0 ? ue8m0_to_float(w.scales.as<uint8_t>()[s])
                                                          : w.scales.as<float>()[s];
        w.value[static_cast<size_t>(i)] = e4m3_to_float(code) * scale;
      }
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, x_shape);
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  DeviceTensor dy = testing::poisoned_tensor(c.y_dtype, y_shape);  // NaN everywhere
  const TensorView weight = TensorView::contiguous(dw.view.data, DType::e4m3, w_shape, Device::cuda, dw.view.device_index);
  LinearParams p{.x = dx.view, .weight = weight, .weight_scale = ds.view, .block_out = c.block,
                 .block_in = c.block, .activation_block = c.activation_block, .y = dy.view, .blas = &*blas_};
  EXPECT_STREQ(linear_implementation(p), c.implementation);
  DeviceBuffer workspace(linear_workspace_bytes(p));
  Stream stream;
  run_linear(p, workspace.data(), stream.get());
  stream.synchronize("linear implementation test");
  const std::vector<float> got = testing::download_floats(dy.view);
  const PlainProduct expected =
      plain_product(x, c.rows, c.groups, c.in, w.value, c.out, c.activation_block, c.y_dtype == DType::bf16);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << c.name << ": element " << i << " not written";
  testing::expect_close(got, expected.y, 0.0f, 0.0f, c.name, expected.bound);
}

// V4.1: 32x32 ue8m0 blocks; V4.0: 128x128 (ue8m0 as released, f32 as the format allows). out is
// odd; in is a multiple of 16 (fp8_decode's requirement) and, without act_quant, not of the block.
INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearImplementationCudaTest,
    ::testing::Values(
        ImplementationCase{"v41_rows1_actq", 32, DType::ue8m0, 1, 1, 77, 224, 32, DType::bf16, "fp8_decode"},
        ImplementationCase{"v41_rows3", 32, DType::ue8m0, 3, 1, 77, 208, 0, DType::f32, "fp8_decode"},
        ImplementationCase{"v41_rows17_actq", 32, DType::ue8m0, 17, 1, 131, 224, 32, DType::f32, "fp8_decode"},
        ImplementationCase{"v41_rows64", 32, DType::ue8m0, 64, 1, 131, 208, 0, DType::bf16, "fp8_decode"},
        ImplementationCase{"v41_rows100_actq", 32, DType::ue8m0, 100, 1, 77, 224, 32, DType::f32, "cublaslt"},
        ImplementationCase{"v40_rows1", 128, DType::ue8m0, 1, 1, 203, 336, 0, DType::f32, "fp8_decode"},
        ImplementationCase{"v40_rows3_actq", 128, DType::ue8m0, 3, 1, 203, 384, 128, DType::bf16, "fp8_decode"},
        ImplementationCase{"v40_rows17_f32scale", 128, DType::f32, 17, 1, 203, 336, 0, DType::bf16, "fp8_decode"},
        ImplementationCase{"v40_rows64_actq", 128, DType::ue8m0, 64, 1, 77, 384, 128, DType::f32, "fp8_decode"},
        ImplementationCase{"v40_rows100", 128, DType::f32, 100, 1, 203, 336, 0, DType::bf16, "cublaslt"},
        // A long K that fp8_decode splits (few weight rows), reduced in order.
        ImplementationCase{"v41_rows5_splitk", 32, DType::ue8m0, 5, 1, 45, 4096, 32, DType::f32, "fp8_decode"},
        // wo_a-like: [rows, groups, in] x [groups, out, in], scales per group or flat over the groups.
        ImplementationCase{"grouped_rows3", 32, DType::ue8m0, 3, 3, 40, 96, 0, DType::f32, "fp8_decode"},
        ImplementationCase{"grouped_rows17_flat", 128, DType::ue8m0, 17, 2, 64, 256, 0, DType::bf16, "fp8_decode", true},
        ImplementationCase{"grouped_rows100_flat", 32, DType::ue8m0, 100, 3, 40, 96, 0, DType::f32, "cublaslt", true}),
    [](const ::testing::TestParamInfo<ImplementationCase>& info) { return std::string(info.param.name); });

TEST_F(LinearCudaTest, Fp8DecodeRowsDoNotDependOnTheBatchAndRepeatBitForBit) {
  // A row's bits are the same alone and in a batch of 17 (the split over K depends on the weight's
  // shape only), and every run gives the same bits.
  const int64_t rows = 17, in = 1024, out = 96;
  const auto x = testing::rounded_to_bf16(testing::random_floats(rows * in, 40, -2.0f, 2.0f));
  const Fp8Weight w = random_fp8_weight({out, in}, 32, 32, DType::ue8m0, 41);
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  DeviceTensor dx = testing::device_tensor(x, DType::bf16, {rows, in});
  DeviceTensor dy = testing::poisoned_tensor(DType::f32, {rows, out});
  const LinearParams batch{.x = dx.view, .weight = dw.view, .weight_scale = ds.view, .block_out = 32, .block_in = 32,
                           .y = dy.view, .blas = &*blas_};
  ASSERT_STREQ(linear_implementation(batch), "fp8_decode");
  run(batch);
  const HostTensor first = to_host(dy.view);
  for (int repeat = 0; repeat < 4; ++repeat) {
    dy.buffer.fill_bytes(0xff);
    run(batch);
    const HostTensor again = to_host(dy.view);
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.nbytes()), 0) << "run " << repeat + 1 << " differs";
  }
  for (const int64_t row : {int64_t{0}, int64_t{16}}) {
    DeviceTensor one_x = testing::device_tensor(std::vector<float>(x.begin() + row * in, x.begin() + (row + 1) * in),
                                                DType::bf16, {1, in});
    DeviceTensor one_y = testing::poisoned_tensor(DType::f32, {1, out});
    run({.x = one_x.view, .weight = dw.view, .weight_scale = ds.view, .block_out = 32, .block_in = 32,
         .y = one_y.view});
    const HostTensor alone = to_host(one_y.view);
    EXPECT_EQ(std::memcmp(alone.data(), first.as<float>() + row * out, static_cast<size_t>(out) * 4), 0)
        << "row " << row << " alone differs from the same row in the batch";
  }
}

TEST_F(LinearCudaTest, Fp8WeightF32ProductIsFp32Throughout) {
  // Precision::fp32: f32 x (not rounded to bf16) times the dequantized f32 weight in fp32.
  const int64_t rows = 6, in = 160, out = 72;
  const auto x = testing::random_floats(rows * in, 50, -3.0f, 3.0f);
  const Fp8Weight w = random_fp8_weight({out, in}, 32, 32, DType::ue8m0, 51);
  DeviceTensor dx = testing::device_tensor(x, DType::f32, {rows, in});
  DeviceTensor dw = testing::device_tensor(w.codes), ds = testing::device_tensor(w.scales);
  DeviceTensor dy = testing::poisoned_tensor(DType::f32, {rows, out});
  const LinearParams p{.x = dx.view, .weight = dw.view, .weight_scale = ds.view, .block_out = 32, .block_in = 32,
                       .f32_product = true, .y = dy.view, .blas = &*blas_};
  EXPECT_STREQ(linear_implementation(p), "cublaslt");
  const PlainProduct expected = plain_product(x, rows, 1, in, w.value, out, 0, false);
  testing::expect_close(run(p), expected.y, 0.0f, 0.0f, "f32 product y", expected.bound);
}

TEST_F(LinearCudaTest, CublasLtAsksTheHeuristicOncePerShape) {
  const int64_t in = 64, out = 48;
  const auto w = testing::rounded_to_bf16(testing::random_floats(out * in, 60));
  DeviceTensor dw = testing::device_tensor(w, DType::bf16, {out, in});
  const size_t before = blas_->cached_algorithms();
  for (const int64_t rows : {4, 4, 9, 4, 9}) {
    DeviceTensor dx = testing::device_tensor(testing::random_floats(rows * in, 61), DType::bf16, {rows, in});
    DeviceTensor dy = testing::poisoned_tensor(DType::f32, {rows, out});
    run({.x = dx.view, .weight = dw.view, .y = dy.view});
  }
  EXPECT_EQ(blas_->cached_algorithms(), before + 2);  // rows 4 and rows 9
}

// The chooser needs no device: the views only carry shapes, dtypes and (aligned) addresses.
TEST(LinearDispatch, Fp8DecodeForSmallRowCountsCublasLtOtherwise) {
  alignas(256) static char memory[256];
  static int dummy_handle;
  const auto view = [&](DType dtype, std::vector<int64_t> shape) {
    return TensorView::contiguous(memory, dtype, shape, Device::cuda);
  };
  const auto params = [&](int64_t rows, int64_t in) {
    return LinearParams{.x = view(DType::bf16, {rows, in}), .weight = view(DType::e4m3, {4096, in}),
                        .weight_scale = view(DType::ue8m0, {128, (in + 31) / 32}), .block_out = 32, .block_in = 32,
                        .y = view(DType::bf16, {rows, 4096}), .blas = reinterpret_cast<const BlasLt*>(&dummy_handle)};
  };
  const DeviceInfo h200{90, 232448}, a100{80, 166912}, turing{75, 65536};
  const auto chosen = [&](const LinearParams& p, const DeviceInfo& device) {
    validate_linear(p);
    return std::string(choose_linear(p, device).name);
  };
  for (const int64_t rows : {1, 16, 64}) {
    EXPECT_EQ(chosen(params(rows, 1024), h200), "fp8_decode") << rows << " rows";
    EXPECT_EQ(chosen(params(rows, 1024), a100), "fp8_decode") << rows << " rows";
  }
  EXPECT_EQ(chosen(params(65, 1024), h200), "cublaslt");
  EXPECT_EQ(chosen(params(4096, 1024), h200), "cublaslt");
  EXPECT_EQ(chosen(params(1, 1000), h200), "cublaslt");  // input size not a multiple of 16
  EXPECT_EQ(chosen(params(1, 1024), turing), "cublaslt");
  LinearParams p = params(1, 1024);
  p.f32_product = true;
  EXPECT_EQ(chosen(p, h200), "cublaslt");
  p = params(1, 1024);
  p.weight.dtype = DType::bf16;
  p.weight_scale = {};
  EXPECT_EQ(chosen(p, h200), "cublaslt");
  // The workspace covers either choice: the fallback's bf16 copy of the weight at any row count.
  EXPECT_GE(linear_workspace_bytes(params(1, 1024)), size_t{4096} * 1024 * 2);
}

// Validation needs no device: the views only carry shapes and dtypes.
TEST(LinearCudaValidation, ReportsTheFirstBadArgument) {
  using testing::error_of;
  using testing::fake_device_view;
  static int dummy_handle;  // never used: validation only checks that a handle is given
  LinearParams p{.x = fake_device_view(DType::bf16, {3, 64}), .weight = fake_device_view(DType::bf16, {32, 64}),
                 .y = fake_device_view(DType::f32, {3, 32}),
                 .blas = reinterpret_cast<const BlasLt*>(&dummy_handle)};
  EXPECT_NO_THROW(validate_linear(p));

  LinearParams bad = p;
  bad.x = fake_device_view(DType::bf16, {3, 2, 2, 64});
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'x' has rank 4, expected 2 ([rows, in]) or 3 ([rows, groups, in])");
  bad = p;
  bad.weight = fake_device_view(DType::bf16, {2, 32, 64});
  EXPECT_EQ(error_of([&] { validate_linear(bad); }), "dsv4: linear: argument 'weight' has rank 3, expected 2");
  bad = p;
  bad.y.device = Device::cpu;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }), "dsv4: linear: argument 'y' is on cpu, expected cuda");
  bad = p;
  bad.x.dtype = DType::f16;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'x' has dtype F16, expected BF16 or F32");
  bad = p;
  bad.weight = fake_device_view(DType::bf16, {64, 32});
  bad.weight.stride = {1, 64};  // a transposed view
  bad.weight.shape = {32, 64};
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'weight' is not contiguous (shape [32, 64], strides [1, 64])");
  bad = p;
  bad.weight = fake_device_view(DType::bf16, {32, 60});
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'weight' has shape [32, 60], expected [32, 64]");
  bad = p;
  bad.y = fake_device_view(DType::f32, {3, 31});
  EXPECT_EQ(error_of([&] { validate_linear(bad); }), "dsv4: linear: argument 'y' has shape [3, 31], expected [3, 32]");
  bad = p;
  bad.weight.dtype = DType::e4m3;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'weight_scale' is missing; an e4m3 weight needs its block scales");
  bad.weight_scale = fake_device_view(DType::ue8m0, {2, 2});
  bad.block_out = bad.block_in = 32;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'weight_scale' has shape [2, 2], expected [1, 2]");
  bad = p;
  bad.weight_scale = fake_device_view(DType::ue8m0, {1, 1});
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: argument 'weight_scale' is given for a BF16 weight; only e4m3 weights have block scales");
  bad = p;
  bad.activation_block = 48;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: activation_block 48 does not divide the input size 64");
  bad = p;
  bad.f32_product = true;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }),
            "dsv4: linear: f32_product is set for a BF16 weight; give the weight as F32 for an fp32 product");
  bad = p;
  bad.blas = nullptr;
  EXPECT_EQ(error_of([&] { validate_linear(bad); }), "dsv4: linear: argument 'blas' is null (pass the BlasLt of the stream)");

  // A grouped e4m3 weight takes its scales per group or over all groups' rows (the checkpoint's).
  LinearParams grouped{.x = fake_device_view(DType::bf16, {3, 2, 64}), .weight = fake_device_view(DType::e4m3, {2, 40, 64}),
                       .weight_scale = fake_device_view(DType::ue8m0, {2, 2, 2}), .block_out = 32, .block_in = 32,
                       .y = fake_device_view(DType::f32, {3, 2, 40}),
                       .blas = reinterpret_cast<const BlasLt*>(&dummy_handle)};
  EXPECT_NO_THROW(validate_linear(grouped));
  grouped.weight_scale = fake_device_view(DType::ue8m0, {3, 2});  // ceil(2 · 40 / 32) rows
  EXPECT_NO_THROW(validate_linear(grouped));
  grouped.weight_scale = fake_device_view(DType::ue8m0, {2, 2});
  EXPECT_EQ(error_of([&] { validate_linear(grouped); }),
            "dsv4: linear: argument 'weight_scale' has shape [2, 2], expected [3, 2]");
}

}  // namespace
}  // namespace dsv4::cuda

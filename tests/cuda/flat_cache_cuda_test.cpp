// The cache addressing the C API and the Python ops use on the GPU: flat caches (no block table:
// rows are slots, FlashMLA's indices) read by the sparse attention with no window, a per-token
// pick count and no sink; run_cache_decode and run_cache_insert without RoPE against the host
// codec (kv_format's encode_rows / decode_rows), byte for byte and bit for bit.
//
// Attention tolerance: fp32 SIMT against a double recomputation from the host-decoded rows,
// |Δ| <= 1e-5 + 1e-4·|out| (the fp32 kernel's error against fp32 references is <= 1.3e-6 on an
// H200, attention_cuda_test.cpp).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>

#include "cuda/cuda_test_util.h"
#include "dsv4/cuda/attention.h"
#include "dsv4/cuda/cache.h"
#include "dsv4/cuda/qkv.h"

namespace dsv4::cuda {
namespace {

using testing::CudaTest;

constexpr int64_t kDim = 512;

// Random rows encoded at every slot of `pages` pages of `format` (as kv_encode would).
std::vector<std::byte> random_pages(const PageGeometry& g, int64_t pages, uint32_t seed) {
  std::vector<std::byte> bytes(static_cast<size_t>(pages * g.page_stride), std::byte{0});
  const int64_t rows = pages * g.rows_per_page;
  const std::vector<float> x = testing::random_floats(rows * g.row.dims, seed, -3.0f, 3.0f);
  std::vector<int64_t> slots(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) slots[i] = i;
  encode_rows(g, x.data(), rows, slots.data(), std::span<std::byte>(bytes));
  return bytes;
}

class FlatAttention : public CudaTest, public ::testing::WithParamInterface<KvRowFormat> {};

TEST_P(FlatAttention, PicksAreSlotsWithPickCountAndNoSink) {
  const PageGeometry g = page_geometry(GetParam(), kDim, 64);
  constexpr int64_t kPages = 3, kTokens = 5, kHeads = 16, kPicks = 70;
  const int64_t capacity = kPages * g.rows_per_page;
  const std::vector<std::byte> pages = random_pages(g, kPages, 3);
  // Picks: valid slots, -1, and slots past the pages (skipped: not addressable).
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> slot(-1, static_cast<int32_t>(capacity + 8));
  std::vector<int32_t> picks(kTokens * kPicks), counts = {kPicks, 33, 0, 1, kPicks + 5};
  for (int32_t& p : picks) p = slot(rng);
  const std::vector<float> q = testing::rounded_to_bf16(testing::random_floats(kTokens * kHeads * kDim, 11));
  const float scale = 0.06f;

  auto d_pages = testing::device_array(pages, DType::u8, {kPages, g.page_stride});
  auto d_q = testing::device_tensor(q, DType::bf16, {kTokens, kHeads, kDim});
  auto d_picks = testing::device_array(picks, DType::i32, {kTokens, kPicks});
  auto d_counts = testing::device_array(counts, DType::i32, {kTokens});
  auto out = testing::poisoned_tensor(DType::f32, {kTokens, kHeads, kDim});
  auto lse = testing::poisoned_tensor(DType::f32, {kTokens, kHeads});
  SparseAttentionParams p;
  p.q = d_q.view;
  p.window_size = 0;
  p.compressed = PagedCache{.pages = d_pages.view, .geometry = g};
  p.picks = d_picks.view;
  p.pick_count = d_counts.view;
  p.scale = scale;
  p.out = out.view;
  p.lse = lse.view;
  Stream stream;
  DeviceBuffer workspace(sparse_attention_workspace_bytes(p));
  run_sparse_attention(p, workspace.data(), stream.get());
  stream.synchronize();
  const std::vector<float> got = testing::download_floats(out.view), got_lse = testing::download_floats(lse.view);

  std::vector<float> want(got.size()), want_lse(got_lse.size());
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<std::vector<float>> rows;
    for (int64_t i = 0; i < std::min<int64_t>(counts[t], kPicks); ++i) {
      const int64_t s = picks[t * kPicks + i];
      if (s < 0 || s >= capacity) continue;
      std::vector<float> row(kDim);
      decode_rows(g, std::span<const std::byte>(pages), &s, 1, row.data());
      rows.push_back(std::move(row));
    }
    for (int64_t h = 0; h < kHeads; ++h) {
      std::vector<double> logit(rows.size());
      double m = -INFINITY, sum = 0.0;
      for (size_t i = 0; i < rows.size(); ++i) {
        double dot = 0.0;
        for (int64_t c = 0; c < kDim; ++c) dot += double(q[(t * kHeads + h) * kDim + c]) * rows[i][c];
        logit[i] = dot * scale;
        m = std::max(m, logit[i]);
      }
      for (double l : logit) sum += std::exp(l - m);
      want_lse[t * kHeads + h] = rows.empty() ? -INFINITY : float(m + std::log(sum));
      for (int64_t c = 0; c < kDim; ++c) {
        double o = 0.0;
        for (size_t i = 0; i < rows.size(); ++i) o += std::exp(logit[i] - m) * rows[i][c];
        want[(t * kHeads + h) * kDim + c] = rows.empty() ? 0.0f : float(o / sum);
      }
    }
  }
  testing::expect_close(got, want, 1e-5f, 1e-4f, "flat attention out");
  for (size_t i = 0; i < want_lse.size(); ++i) {
    if (std::isinf(want_lse[i])) EXPECT_EQ(got_lse[i], want_lse[i]) << "lse " << i;
    else EXPECT_NEAR(got_lse[i], want_lse[i], 1e-5 + 1e-5 * std::fabs(want_lse[i])) << "lse " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, FlatAttention,
                         ::testing::Values(KvRowFormat::bf16, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4,
                                           KvRowFormat::fp8_ds_mla, KvRowFormat::f32),
                         [](const auto& info) { return std::string(kv_row_format_name(info.param)); });

class CacheCodec : public CudaTest, public ::testing::WithParamInterface<std::tuple<KvRowFormat, PagePlacement>> {};

TEST_P(CacheCodec, DeviceDecodeAndInsertEqualTheHostCodec) {
  const auto [format, placement] = GetParam();
  const bool index = format == KvRowFormat::index_mxfp4 || format == KvRowFormat::index_fp8;
  if (format == KvRowFormat::fp8_ds_mla && placement == PagePlacement::interleaved) GTEST_SKIP();
  const int64_t dims = index ? 128 : kDim, rows = 9, kPages = 2;
  const PageGeometry g = page_geometry(format, dims, 8, placement);
  const std::vector<float> x = testing::random_floats(rows * dims, 5, -4.0f, 4.0f);
  // Slots in shuffled order, one negative (skipped / zeros) and one past the pages.
  const std::vector<int64_t> slots = {3, 15, 0, -1, 7, 8, 12, 2, kPages * 8 + 1};
  std::vector<std::byte> host_pages(static_cast<size_t>(kPages * g.page_stride), std::byte{0});
  std::vector<int64_t> host_slots;
  std::vector<float> host_x;
  for (int64_t i = 0; i < rows; ++i)
    if (slots[i] < kPages * 8) {
      host_slots.push_back(slots[i]);
      host_x.insert(host_x.end(), x.begin() + i * dims, x.begin() + (i + 1) * dims);
    }
  encode_rows(g, host_x.data(), static_cast<int64_t>(host_slots.size()), host_slots.data(),
              std::span<std::byte>(host_pages));

  Stream stream;
  auto d_pages = testing::device_array(std::vector<std::byte>(host_pages.size(), std::byte{0}), DType::u8,
                                       {kPages, g.page_stride});
  auto d_x = testing::device_tensor(x, DType::f32, {rows, dims});
  auto d_slots = testing::device_array(slots, DType::i64, {rows});
  CacheInsertParams insert;
  insert.rows = d_x.view;
  insert.slots = d_slots.view;
  insert.cache = PagedCache{.pages = d_pages.view, .geometry = g};
  insert.bf16_rounding = false;
  run_cache_insert(insert, stream.get());
  auto out = testing::poisoned_tensor(DType::f32, {rows, dims});
  run_cache_decode({.cache = insert.cache, .slots = d_slots.view, .out = out.view}, stream.get());
  stream.synchronize();
  EXPECT_EQ(testing::download_as<std::byte>(d_pages.view), host_pages) << "inserted bytes";
  const std::vector<float> got = testing::download_floats(out.view);
  for (int64_t i = 0; i < rows; ++i) {
    std::vector<float> want(static_cast<size_t>(dims), 0.0f);
    const int64_t s = slots[i] < kPages * 8 ? slots[i] : -1;
    decode_rows(g, std::span<const std::byte>(host_pages), &s, 1, want.data());
    for (int64_t c = 0; c < dims; ++c)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i * dims + c]), std::bit_cast<uint32_t>(want[c]))
          << "row " << i << " channel " << c;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CacheCodec,
    ::testing::Combine(::testing::ValuesIn(kEveryKvRowFormat),
                       ::testing::Values(PagePlacement::segregated, PagePlacement::interleaved)),
    [](const auto& info) {
      return std::string(kv_row_format_name(std::get<0>(info.param))) +
             (std::get<1>(info.param) == PagePlacement::segregated ? "_segregated" : "_interleaved");
    });

// run_cache_stage decodes whole pages into bf16 pages, bit for bit the host codec's values: pages
// staged in shuffled order, one twice, a negative id and one past the source (zeros); the staged
// page beyond the list keeps its poison.
class CacheStage : public CudaTest, public ::testing::WithParamInterface<std::tuple<KvRowFormat, PagePlacement>> {};

TEST_P(CacheStage, StagedPagesHoldTheHostCodecsValues) {
  const auto [format, placement] = GetParam();
  const PageGeometry g = page_geometry(format, kDim, 16, placement), staged_g = page_geometry(KvRowFormat::bf16, kDim, 16);
  constexpr int64_t kSourcePages = 5, kStagedPages = 8;
  const std::vector<std::byte> host_pages = random_pages(g, kSourcePages, 11);
  const std::vector<int32_t> pages = {3, 0, 4, -1, 2, 3, kSourcePages};  // one staged page left over
  Stream stream;
  auto d_source = testing::device_array(host_pages, DType::u8, {kSourcePages, g.page_stride});
  auto d_pages = testing::device_array(pages, DType::i32, {static_cast<int64_t>(pages.size())});
  auto d_staged = testing::poisoned_tensor(DType::u8, {kStagedPages, staged_g.page_stride});
  const std::vector<std::byte> poison = testing::download_as<std::byte>(d_staged.view);
  run_cache_stage({.source = {.pages = d_source.view, .geometry = g},
                   .pages = d_pages.view,
                   .staged = {.pages = d_staged.view, .geometry = staged_g}},
                  stream.get());
  stream.synchronize();
  const std::vector<std::byte> staged = testing::download_as<std::byte>(d_staged.view);
  for (int64_t i = 0; i < kStagedPages; ++i)
    for (int64_t r = 0; r < g.rows_per_page; ++r) {
      std::vector<float> want(static_cast<size_t>(kDim), 0.0f);
      const bool listed = i < static_cast<int64_t>(pages.size());
      const int32_t source = listed ? pages[i] : -1;
      if (source >= 0 && source < kSourcePages) {
        const int64_t slot = source * g.rows_per_page + r;
        decode_rows(g, std::span<const std::byte>(host_pages), &slot, 1, want.data());
      }
      const int64_t at = i * staged_g.page_stride + staged_g.data_offset(r);
      for (int64_t c = 0; c < kDim; ++c) {
        const size_t byte = static_cast<size_t>(at + 2 * c);
        uint16_t got_bits;
        std::memcpy(&got_bits, staged.data() + byte, 2);
        if (!listed) {
          uint16_t poison_bits;
          std::memcpy(&poison_bits, poison.data() + byte, 2);
          ASSERT_EQ(got_bits, poison_bits) << "unlisted staged page " << i << " row " << r << " channel " << c;
          continue;
        }
        // The codec's values are exact in bf16: the upper half of their f32 bits.
        const uint32_t want_bits = std::bit_cast<uint32_t>(want[static_cast<size_t>(c)]);
        ASSERT_EQ(want_bits & 0xffffu, 0u) << "value not exact in bf16";
        ASSERT_EQ(got_bits, static_cast<uint16_t>(want_bits >> 16))
            << "staged page " << i << " (source " << source << ") row " << r << " channel " << c;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, CacheStage,
    ::testing::Values(std::tuple{KvRowFormat::v41_fp8, PagePlacement::segregated},
                      std::tuple{KvRowFormat::v41_fp8, PagePlacement::interleaved},
                      std::tuple{KvRowFormat::v41_fp4, PagePlacement::segregated},
                      std::tuple{KvRowFormat::v41_fp4, PagePlacement::interleaved},
                      std::tuple{KvRowFormat::fp8_ds_mla, PagePlacement::segregated},
                      std::tuple{KvRowFormat::bf16, PagePlacement::segregated}),
    [](const auto& info) {
      return std::string(kv_row_format_name(std::get<0>(info.param))) +
             (std::get<1>(info.param) == PagePlacement::segregated ? "_segregated" : "_interleaved");
    });

TEST(CacheStageValidation, NamesTheBadArgument) {
  using testing::error_of;
  CacheStageParams p;
  p.source.geometry = page_geometry(KvRowFormat::v41_fp4, kDim, 16);
  p.source.pages = testing::fake_device_view(DType::u8, {4, p.source.geometry.page_stride});
  p.pages = testing::fake_device_view(DType::i32, {3});
  p.staged.geometry = page_geometry(KvRowFormat::bf16, kDim, 16);
  p.staged.pages = testing::fake_device_view(DType::u8, {3, p.staged.geometry.page_stride});
  EXPECT_NO_THROW(validate_cache_stage(p));
  CacheStageParams bad = p;
  bad.pages = testing::fake_device_view(DType::i64, {3});
  EXPECT_EQ(error_of([&] { validate_cache_stage(bad); }),
            "dsv4: cache_stage: argument 'pages' has dtype I64, expected I32");
  bad = p;
  bad.source.geometry = page_geometry(KvRowFormat::f32, kDim, 16);
  bad.source.pages = testing::fake_device_view(DType::u8, {4, bad.source.geometry.page_stride});
  EXPECT_EQ(error_of([&] { validate_cache_stage(bad); }),
            "dsv4: cache_stage: cache 'source' has format f32, expected one of v41_fp8, v41_fp4, fp8_ds_mla, bf16");
  bad = p;
  bad.staged.geometry = page_geometry(KvRowFormat::bf16, kDim, 32);
  bad.staged.pages = testing::fake_device_view(DType::u8, {3, bad.staged.geometry.page_stride});
  EXPECT_EQ(error_of([&] { validate_cache_stage(bad); }),
            "dsv4: cache_stage: cache 'staged' has 32 rows per page, expected the source's 16");
  bad = p;
  bad.staged.pages = testing::fake_device_view(DType::u8, {2, p.staged.geometry.page_stride});
  EXPECT_EQ(error_of([&] { validate_cache_stage(bad); }),
            "dsv4: cache_stage: cache 'staged' has 2 pages, expected at least 3 (one per entry of 'pages')");
  bad = p;
  bad.source.geometry = page_geometry(KvRowFormat::fp8_ds_mla, kDim, 16, PagePlacement::interleaved);
  bad.source.pages = testing::fake_device_view(DType::u8, {4, bad.source.geometry.page_stride});
  EXPECT_EQ(error_of([&] { validate_cache_stage(bad); }),
            "dsv4: cache_stage: cache 'source' has row data that is not 16-byte aligned");
}

TEST(CacheDecodeValidation, NamesTheBadArgument) {
  CacheDecodeParams p;
  p.cache.geometry = page_geometry(KvRowFormat::v41_fp8, kDim, 64);
  p.cache.pages = testing::fake_device_view(DType::u8, {2, p.cache.geometry.page_stride});
  p.slots = testing::fake_device_view(DType::i64, {4});
  p.out = testing::fake_device_view(DType::f32, {4, 256});
  EXPECT_THROW(
      {
        try {
          validate_cache_decode(p);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("cache_decode: argument 'out' has shape [4, 256], expected [4, 512]"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
}

}  // namespace
}  // namespace dsv4::cuda

// KV-cache row formats in their real byte layouts (SPEC §7, shared/golden/kvfmt/README.md) and
// the page geometry that places rows in pages. docs/formats.md describes each format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dsv4/numeric.h"

namespace dsv4 {

enum class KvRowFormat : uint8_t {
  bf16,            // 512 (or 128 for index keys) raw bf16 values
  fp8_per_tensor,  // e4m3 values of x / tensor_scale, no per-row scales
  v41_fp8,         // V4.1 window rows: 512 e4m3 + 16 ue8m0 (32-channel tiles) = 528 B
  v41_fp4,         // V4.1 compressed rows: 256 B e2m1 + 32 e4m3 scales (16-channel tiles) = 288 B
  fp8_ds_mla,      // V4.0: 448 e4m3 NoPE + 64 bf16 RoPE + 7 ue8m0 + 1 pad = 584 B
  index_mxfp4,     // index keys: 64 B e2m1 + 4 ue8m0 (32-channel tiles) = 68 B
  index_fp8,       // index keys: 128 e4m3 + one fp32 power-of-two scale = 132 B
  f32,             // raw fp32 values (any dims): exact, the caches of Precision::fp32
};
// Every row format, for the operations that read or write rows of any of them.
inline const std::vector<KvRowFormat> kEveryKvRowFormat = {
    KvRowFormat::bf16,       KvRowFormat::fp8_per_tensor, KvRowFormat::v41_fp8,  KvRowFormat::v41_fp4,
    KvRowFormat::fp8_ds_mla, KvRowFormat::index_mxfp4,    KvRowFormat::index_fp8, KvRowFormat::f32};
const char* kv_row_format_name(KvRowFormat f);
// Inverse of kv_row_format_name; throws naming the accepted names.
KvRowFormat parse_kv_row_format(const std::string& name);

// Where a row's scale bytes live: after all data rows of the page (vLLM, vLLM's FlashMLA fork) or
// right after the row's data (deepseek-ai FlashMLA's V4.1 records).
enum class PagePlacement : uint8_t { segregated, interleaved };

struct RowLayout {
  int64_t dims = 0;         // channels per row (512, or index_head_dim for index keys)
  int64_t data_bytes = 0;   // bytes of values per row
  int64_t scale_bytes = 0;  // bytes of scales per row (incl. padding bytes inside the scale row)
  int64_t alignment = 1;    // page stride is rounded up to a multiple of this
  int64_t row_bytes() const { return data_bytes + scale_bytes; }
};
// Throws unless `dims` suits the format: exactly 512 for v41_fp8, v41_fp4 and fp8_ds_mla (whole
// attention heads), a multiple of 32 for index_mxfp4, 1 ... 1048576 otherwise.
RowLayout row_layout(KvRowFormat f, int64_t dims);

struct PageGeometry {
  KvRowFormat format = KvRowFormat::bf16;
  PagePlacement placement = PagePlacement::segregated;
  RowLayout row;
  int64_t rows_per_page = 0;
  int64_t page_stride = 0;  // bytes from one page to the next
  int64_t data_offset(int64_t row_in_page) const;
  int64_t scale_offset(int64_t row_in_page) const;
};
// Segregated pages are rounded up to the format's alignment; interleaved pages are unpadded
// (rows_per_page records back to back). rows_per_page must be 1 ... 1048576.
PageGeometry page_geometry(KvRowFormat f, int64_t dims, int64_t rows_per_page,
                           PagePlacement placement = PagePlacement::segregated);

// Rows per page the cache manager and `dsv4 plan` use for a format (vLLM's choices on SM90:
// 32-token window pages for v41_fp8, 64 rows otherwise).
int64_t default_rows_per_page(KvRowFormat f);

// How encode_rows quantizes where the upstream encoders differ (kvfmt README). The defaults make
// decode(encode(x)) equal DeepSeek's V4.1 reference fake quantization (numeric.h) for v41_fp8,
// v41_fp4 and index_mxfp4, and reproduce vLLM's bytes for fp8_ds_mla and index_fp8.
struct EncodeOptions {
  // Floor of the power-of-two FP8 scales of v41_fp8, fp8_ds_mla and index_fp8 (other formats
  // ignore it). Fp8ScaleFloor::ratio reproduces vLLM's V4.1 FP8 window insert and FlashMLA's
  // test quantizers (V4.0 and V4.1) byte for byte.
  Fp8ScaleFloor fp8_scale_floor = Fp8ScaleFloor::amax;
};

// Encodes n rows x [n, dims] (fp32) into the pages at `slots` (slot = page * rows_per_page + row;
// slot < 0 is skipped). `tensor_scale` (finite, > 0) is used by fp8_per_tensor only: the stored
// value is e4m3(x / tensor_scale). Rows are encoded in order (a repeated slot keeps the last row).
// Bytes of a row that the format leaves free (fp8_ds_mla scale padding) are written as 0; other
// rows and page padding are not touched. The caller guarantees that every slot lies in `pages`;
// the span overload checks it.
void encode_rows(const PageGeometry& g, const float* x, int64_t n, const int64_t* slots,
                 std::byte* pages, float tensor_scale = 1.0f, const EncodeOptions& options = {});
void encode_rows(const PageGeometry& g, const float* x, int64_t n, const int64_t* slots,
                 std::span<std::byte> pages, float tensor_scale = 1.0f, const EncodeOptions& options = {});
// Decodes n rows from `slots` into out [n, dims] (fp32). Values are exactly the dequantized ones
// (code x scale); a slot < 0 gives a row of zeros. As for encode_rows, the span overload checks
// that every slot lies in `pages`.
void decode_rows(const PageGeometry& g, const std::byte* pages, const int64_t* slots, int64_t n,
                 float* out, float tensor_scale = 1.0f);
void decode_rows(const PageGeometry& g, std::span<const std::byte> pages, const int64_t* slots, int64_t n,
                 float* out, float tensor_scale = 1.0f);

// Named sets of formats for the three caches, as the CLI's --kv-format takes them:
// "v4.1-native" (v41_fp8 / v41_fp4 / index_mxfp4), "fp8_ds_mla" (fp8_ds_mla / fp8_ds_mla /
// index_fp8), "bf16" (bf16 / bf16 / bf16), "fp8" (fp8_per_tensor / fp8_per_tensor / index_fp8),
// "f32" (f32 / f32 / f32).
struct KvFormatSet {
  std::string name;
  KvRowFormat window;
  KvRowFormat compressed;
  KvRowFormat index_keys;
};
// Throws naming the accepted names.
KvFormatSet kv_format_set(const std::string& name);
std::vector<std::string> kv_format_set_names();

}  // namespace dsv4

// The fp8 warpgroup-MMA implementation of run_index_scores ("wgmma": FP4 queries against
// index_mxfp4 keys, sm_90a), index_scores_wgmma_kernel.cuh; the kernels are instantiated in
// src/cuda/instantiations/index_scores_wgmma_*.cu.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "cuda/common/paged_rows.h"
#include "cuda/ops/indexer/indexer_implementations.h"
#include "cuda/ops/indexer/wgmma/index_scores_wgmma_kernel.cuh"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

namespace index_wgmma {
#define DSV4_WGMMA_INDEX_SCORES(kBlocks, kBf16Rounding, kTokenRuns)                      \
  extern template void launch_index_scores_wgmma<kBlocks, kBf16Rounding, kTokenRuns>( \
      const IndexScoresWgmmaLaunch&, cudaStream_t);
DSV4_WGMMA_INDEX_SCORES(2, false, false)
DSV4_WGMMA_INDEX_SCORES(2, true, false)
DSV4_WGMMA_INDEX_SCORES(4, false, false)
DSV4_WGMMA_INDEX_SCORES(4, true, false)
DSV4_WGMMA_INDEX_SCORES(2, false, true)
DSV4_WGMMA_INDEX_SCORES(2, true, true)
DSV4_WGMMA_INDEX_SCORES(4, false, true)
DSV4_WGMMA_INDEX_SCORES(4, true, true)
#undef DSV4_WGMMA_INDEX_SCORES
}  // namespace index_wgmma

namespace {

using index_wgmma::IndexScoresWgmmaLaunch;
using index_wgmma::launch_index_scores_wgmma;

constexpr int64_t kMaxGridY = 65535;
// The shared memory of a CTA with token runs: its share of an SM's 228 KB (ctas_per_sm of them),
// less the 1 KB the hardware reserves per CTA. (One token fits the four one-token CTAs' share.)
constexpr size_t kTokenRunsSharedBudget = (228 / index_wgmma::ctas_per_sm(true) - 1) * 1024;
constexpr int64_t kMinKeysPerCta = 1024;     // 8 stages
// Up to eight waves where fewer leave places of their last wave empty: a prefill chunk of 2048
// tokens is 342 CTAs of six (fp32) on 396 places, which eight splits of the keys fill to 99 %.
constexpr int kWaves = 8;

// Whether CTAs of tokens_per_cta tokens run the token-run kernel (else the one-token one).
constexpr bool runs_tokens(int tokens_per_cta) { return tokens_per_cta > 1; }

// A CTA's shared memory for tokens_per_cta tokens, in the layout of the kernel that takes them.
size_t shared_bytes(int blocks, bool bf16_rounding, int tokens_per_cta) {
  auto bytes = [&]<int kBlocks, bool kBf16Rounding>() {
    using index_wgmma::SharedLayout;
    return runs_tokens(tokens_per_cta) ? SharedLayout<kBlocks, kBf16Rounding, true>{tokens_per_cta}.bytes()
                                       : SharedLayout<kBlocks, kBf16Rounding, false>{tokens_per_cta}.bytes();
  };
  if (blocks == 2) return bf16_rounding ? bytes.operator()<2, true>() : bytes.operator()<2, false>();
  return bf16_rounding ? bytes.operator()<4, true>() : bytes.operator()<4, false>();
}

// Tokens per CTA: as many as the budget of CTAs with token runs allows (1: the one-token kernel).
int tokens_per_cta(int64_t tokens, int blocks, bool bf16_rounding) {
  return index_tokens_per_cta(tokens, index_wgmma::kMaxTokensPerCta, kTokenRunsSharedBudget,
                              [&](int n) { return shared_bytes(blocks, bf16_rounding, n); });
}

std::string supports(const IndexScoresParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability(90, device); !why_not.empty()) return why_not;
  if (!p.fp4_queries) return "needs fp4_queries (q read as e2m1 codes)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the FP4 values are read from bf16 bits)";
  const KvRowFormat f = p.keys.geometry.format;
  if (f != KvRowFormat::index_mxfp4)
    return std::string("keys have format ") + kv_row_format_name(f) + ", supports index_mxfp4";
  const int64_t dim = p.q.shape[2], heads = p.q.shape[1], tokens = p.q.shape[0];
  if (dim != 64 && dim != 128) return "index_dim " + std::to_string(dim) + ", supports 64 and 128";
  if (p.scores.shape[1] > index_wgmma::kMaxEntries)
    return std::to_string(p.scores.shape[1]) + " entries, supports at most " + std::to_string(index_wgmma::kMaxEntries);
  if (p.keys.geometry.rows_per_page > INT32_MAX)
    return std::to_string(p.keys.geometry.rows_per_page) + " rows per page, supports at most " + std::to_string(INT32_MAX);
  if (heads > index_wgmma::kHeads)
    return std::to_string(heads) + " index heads, supports at most " + std::to_string(index_wgmma::kHeads);
  // A row's scales: dim / 32 ue8m0 bytes.
  if (std::string why_not = tensor_core_copies_supported(p, dim / 32); !why_not.empty()) return why_not;
  const int blocks = static_cast<int>(dim / 32);
  const int per_cta = tokens_per_cta(tokens, blocks, p.bf16_rounding);
  if ((tokens + per_cta - 1) / per_cta > kMaxGridY)
    return std::to_string(tokens) + " tokens, supports at most " + std::to_string(kMaxGridY * per_cta);
  return needs_shared_memory(static_cast<long long>(shared_bytes(blocks, p.bf16_rounding, per_cta)), device);
}

// The driver's tensor-map encoder (null when the driver has none), looked up once.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return status == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
                                                                         : nullptr;
  }();
  return encoder;
}

// Tensor copies (IndexScoresWgmmaLaunch) need segregated pages of whole 64-row boxes: rows of
// row_bytes data back to back from the page start and their scale bytes back to back (kBlocks a
// row), 16-byte aligned pages and scale blocks, and the maps encoded: the rows [pages][rows][row
// bytes] with the swizzle of SwizzledKeyRows (64-byte rows: 64 B, 32-byte rows: 32 B), the scales
// [pages][rows x kBlocks bytes]. Else cp.async.
bool encode_key_maps(const DeviceRows& k, int blocks, CUtensorMap* rows, CUtensorMap* scales) {
  const int64_t row_bytes = blocks * 16;  // MXFP4: 32 channels a block, two codes a byte
  const bool fits = k.data_row_stride == row_bytes && k.scale_row_stride == blocks &&
                    k.rows_per_page % index_wgmma::kCopyRows == 0 && k.num_pages >= 1 &&
                    reinterpret_cast<uintptr_t>(k.pages) % 16 == 0 && k.page_stride % 16 == 0 && k.scale_base % 16 == 0 &&
                    k.scale_base >= k.rows_per_page * row_bytes && k.num_pages <= INT32_MAX && k.rows_per_page * blocks <= INT32_MAX;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = fits ? tensor_map_encoder() : nullptr;
  if (encode == nullptr) return false;
  const auto page_stride = static_cast<cuuint64_t>(k.page_stride);
  const auto rows_per_page = static_cast<cuuint64_t>(k.rows_per_page), pages = static_cast<cuuint64_t>(k.num_pages);
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const cuuint64_t row_dims[3] = {static_cast<cuuint64_t>(row_bytes), rows_per_page, pages};
  const cuuint64_t row_strides[2] = {static_cast<cuuint64_t>(k.data_row_stride), page_stride};
  const cuuint32_t row_box[3] = {static_cast<cuuint32_t>(row_bytes), index_wgmma::kCopyRows, 1};
  const cuuint64_t scale_dims[2] = {rows_per_page * blocks, pages};
  const cuuint32_t scale_box[2] = {static_cast<cuuint32_t>(index_wgmma::kCopyRows * blocks), 1};
  return encode(rows, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, k.pages, row_dims, row_strides, row_box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, blocks == 4 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS &&
         encode(scales, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, k.pages + k.scale_base, scale_dims, &page_stride, scale_box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

void run(const IndexScoresParams& p, cudaStream_t stream) {
  IndexScoresWgmmaLaunch a{};
  static_cast<IndexScoresRangeLaunch&>(a) = IndexScoresRangeLaunch{index_scores_launch(p)};
  if (a.tokens == 0 || a.entries == 0) return;
  const int blocks = static_cast<int>(p.q.shape[2] / 32);
  a.tokens_per_cta = tokens_per_cta(a.tokens, blocks, a.bf16_rounding);
  const bool token_runs = runs_tokens(a.tokens_per_cta);
  // Token runs share each stage among their tokens, so its per-row copies cost little there; with
  // tensor copies the prefill measured slower (RESULTS, thirty-second session).
  a.tensor_copies = !token_runs && encode_key_maps(a.keys, blocks, &a.key_rows, &a.scale_rows);
  a.keys_per_cta = index_keys_per_cta(a.entries, (a.tokens + a.tokens_per_cta - 1) / a.tokens_per_cta,
                                      shared_bytes(blocks, a.bf16_rounding, a.tokens_per_cta), index_wgmma::ctas_per_sm(token_runs),
                                      index_wgmma::kStageRows, kMinKeysPerCta, kWaves, device_info());
  using Launch = void (*)(const IndexScoresWgmmaLaunch&, cudaStream_t);
  constexpr Launch kLaunches[2][2][2] = {  // [dim 128][bf16_rounding][token_runs]
      {{launch_index_scores_wgmma<2, false, false>, launch_index_scores_wgmma<2, false, true>},
       {launch_index_scores_wgmma<2, true, false>, launch_index_scores_wgmma<2, true, true>}},
      {{launch_index_scores_wgmma<4, false, false>, launch_index_scores_wgmma<4, false, true>},
       {launch_index_scores_wgmma<4, true, false>, launch_index_scores_wgmma<4, true, true>}}};
  kLaunches[blocks == 4][a.bf16_rounding][token_runs](a, stream);
  check_launch("index_scores");
}

}  // namespace

const IndexScoresImplementation kIndexScoresWgmma = {"wgmma", &supports, &run};

}  // namespace dsv4::cuda

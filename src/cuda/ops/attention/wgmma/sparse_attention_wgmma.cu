// The Hopper warpgroup-MMA implementation of run_sparse_attention ("wgmma", kernel in
// sparse_attention_wgmma_kernel.cuh): one block of three warpgroups per (token, 64 heads) and SM,
// rows split over blocks with split_kv so that a small step still fills one wave of an H100 / H200.
// The kernels are instantiated in src/cuda/instantiations/sparse_attention_wgmma_*.cu.
#include <string>

#include "cuda/ops/attention/sparse_attention_implementations.h"
#include "cuda/ops/attention/wgmma/sparse_attention_wgmma_kernel.cuh"
#include "dsv4/kv_format.h"

namespace dsv4::cuda {

#define DSV4_WGMMA_ATTENTION(Out, Window, Compressed) \
  extern template void launch_sparse_attention_wgmma<Out, KvRowFormat::Window, KvRowFormat::Compressed>( \
      const SparseAttentionLaunch&, cudaStream_t);
DSV4_WGMMA_ATTENTION(uint16_t, v41_fp8, v41_fp4)
DSV4_WGMMA_ATTENTION(float, v41_fp8, v41_fp4)
DSV4_WGMMA_ATTENTION(uint16_t, fp8_ds_mla, fp8_ds_mla)
DSV4_WGMMA_ATTENTION(float, fp8_ds_mla, fp8_ds_mla)
#undef DSV4_WGMMA_ATTENTION

namespace {

using attention_wgmma::kHeadDim;

SplitKvPlan plan(int64_t tokens, int64_t heads, int64_t max_rows, bool split_allowed) {
  const int64_t head_groups = (heads + attention_wgmma::kHeadsPerBlock - 1) / attention_wgmma::kHeadsPerBlock;
  return plan_split_kv_one_wave(tokens * head_groups, (max_rows + attention_wgmma::kTileRows - 1) / attention_wgmma::kTileRows,
                                split_allowed);
}

SplitKvPlan plan(const SparseAttentionParams& p, bool split_allowed) {
  return plan(p.q.shape[0], p.q.shape[1], max_attended_rows(p), split_allowed);
}

// The format pairs the kernel is built for (decoded exactly to bf16: e4m3 codes times ue8m0 scales,
// e2m1 codes times e4m3 scales): the V4.1 native caches and FlashMLA's fp8_ds_mla rows for both.
// Other pairs and bf16 rows (1024 bytes, too large for the raw ring) go to decode_mma.
enum class FormatPair { v41_native, fp8_ds_mla, other };

FormatPair format_pair(const SparseAttentionParams& p) {
  const bool window = is_present(p.window.pages), compressed = is_present(p.compressed.pages);
  auto is = [](const PagedCache& c, KvRowFormat f) { return c.geometry.format == f; };
  if ((!window || is(p.window, KvRowFormat::v41_fp8)) && (!compressed || is(p.compressed, KvRowFormat::v41_fp4)))
    return FormatPair::v41_native;
  if ((!window || is(p.window, KvRowFormat::fp8_ds_mla)) && (!compressed || is(p.compressed, KvRowFormat::fp8_ds_mla)))
    return FormatPair::fp8_ds_mla;
  return FormatPair::other;
}

constexpr KvRowFormat kFormats[] = {KvRowFormat::v41_fp8, KvRowFormat::v41_fp4, KvRowFormat::fp8_ds_mla};

// sm_90a machine code only (wgmma, setmaxnreg).
std::string supports(const SparseAttentionParams& p, const DeviceInfo& device) {
  if (std::string why_not = needs_compute_capability(90, device); !why_not.empty()) return why_not;
  using Native = attention_wgmma::Ring<KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>;
  using DsMla = attention_wgmma::Ring<KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla>;
  const size_t shared = format_pair(p) == FormatPair::fp8_ds_mla ? DsMla::kSharedBytes : Native::kSharedBytes;
  static_assert(Native::kCopyBytes == 16 && DsMla::kCopyBytes == 8);
  if (std::string why_not = needs_shared_memory(static_cast<long long>(shared), device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_value("head_dim", kHeadDim, p.q.shape[2]); !why_not.empty()) return why_not;
  if (!p.bf16_rounding) return "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the tensor cores read q as bf16)";
  const FormatPair pair = format_pair(p);
  // The raw rows are copied 16 bytes at a time where the pair's rows allow (Ring::kCopyBytes).
  const int copy_bytes = pair == FormatPair::v41_native ? Native::kCopyBytes : DsMla::kCopyBytes;
  if (std::string why_not = gathered_caches_supported(
          p, kFormats, "expected a quantized format (v41_fp8, v41_fp4, fp8_ds_mla)", copy_bytes);
      !why_not.empty())
    return why_not;
  if (pair == FormatPair::other) return "needs window v41_fp8 with compressed v41_fp4, or fp8_ds_mla for both";
  return "";
}

size_t workspace_bytes(const SparseAttentionParams& p) {
  return split_kv_workspace_bytes(p.q.shape[0], p.q.shape[1], kHeadDim, plan(p, true).splits);
}

size_t max_workspace_bytes(int64_t max_tokens, int64_t heads, int64_t max_rows) {
  return split_kv_max_workspace_bytes(max_tokens, heads, kHeadDim,
                                      [&](int64_t tokens) { return plan(tokens, heads, max_rows, true).splits; });
}

void run(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.q.shape[0] == 0 || p.q.shape[1] == 0) return;
  const SparseAttentionLaunch a = make_sparse_attention_launch(p, plan(p, workspace != nullptr), workspace, kHeadDim);
  const bool bf16_out = p.out.dtype == DType::bf16;
  if (format_pair(p) == FormatPair::v41_native)
    bf16_out ? launch_sparse_attention_wgmma<uint16_t, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>(a, stream)
             : launch_sparse_attention_wgmma<float, KvRowFormat::v41_fp8, KvRowFormat::v41_fp4>(a, stream);
  else
    bf16_out ? launch_sparse_attention_wgmma<uint16_t, KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla>(a, stream)
             : launch_sparse_attention_wgmma<float, KvRowFormat::fp8_ds_mla, KvRowFormat::fp8_ds_mla>(a, stream);
  check_launch("sparse_attention (wgmma)");
  if (a.splits > 1) combine_sparse_attention_splits(a, p.out.dtype, kHeadDim, stream);
}

}  // namespace

const SparseAttentionImplementation kSparseAttentionWgmma = {"wgmma", &supports, &workspace_bytes, &max_workspace_bytes,
                                                             &run};

}  // namespace dsv4::cuda

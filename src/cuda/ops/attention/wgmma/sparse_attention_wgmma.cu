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

// One block per SM (the accumulators of 64 heads x 512 channels take half the register file).
constexpr AttentionBlocking kBlocking{.heads_per_block = attention_wgmma::kHeadsPerBlock,
                                      .tile_rows = attention_wgmma::kTileRows, .head_dim = kHeadDim,
                                      .one_block_per_sm = true};

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
  const FormatPair pair = format_pair(p);
  const size_t shared = pair == FormatPair::fp8_ds_mla ? DsMla::kSharedBytes : Native::kSharedBytes;
  if (std::string why_not = needs_shared_memory(static_cast<long long>(shared), device); !why_not.empty()) return why_not;
  if (std::string why_not = needs_value("head_dim", kHeadDim, p.q.shape[2]); !why_not.empty()) return why_not;
  if (!p.bf16_rounding) return "needs bf16_rounding (the exp-scores are bf16 on the tensor cores)";
  if (p.q.dtype != DType::bf16) return "needs bf16 q (the tensor cores read q as bf16)";
  // The raw rows are copied 16 bytes at a time where the pair's rows allow (Ring::kCopyBytes).
  const int copy_bytes = pair == FormatPair::v41_native ? Native::kCopyBytes : DsMla::kCopyBytes;
  if (std::string why_not = gathered_caches_supported(
          p, kFormats, "expected a quantized format (v41_fp8, v41_fp4, fp8_ds_mla)", copy_bytes);
      !why_not.empty())
    return why_not;
  if (pair == FormatPair::other) return "needs window v41_fp8 with compressed v41_fp4, or fp8_ds_mla for both";
  return "";
}

void run(const SparseAttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.q.shape[0] == 0 || p.q.shape[1] == 0) return;
  const SparseAttentionLaunch a =
      make_sparse_attention_launch(p, kSparseAttentionWgmma.plan(p, workspace != nullptr), workspace, kHeadDim);
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

const SparseAttentionImplementation kSparseAttentionWgmma = {"wgmma", &supports, kBlocking, &run};

}  // namespace dsv4::cuda
